"""Live deployment state: transitions published on Redis reach the console as server-sent events."""

import asyncio
import json

import pytest
import redis
from django.conf import settings

from scheduler.services import NodeReport, register_node
from serving.events import DEPLOYMENTS_CHANNEL as CHANNEL
from serving.views.live import deployment_events
from serving.models import Deployment


def test_the_stream_carries_this_deployments_transitions_only():
    async def scenario():
        events = deployment_events("dep-a", stream_seconds=30)
        assert (await events.__anext__()).startswith("retry:")  # subscribed by now
        publisher = redis.Redis.from_url(settings.REDIS_URL)
        publisher.publish(CHANNEL, json.dumps({"deployment": "dep-b", "to": "ready"}))
        publisher.publish(CHANNEL, json.dumps({"deployment": "dep-a", "from": "loading", "to": "ready"}))
        received = await asyncio.wait_for(events.__anext__(), 10)
        await events.aclose()
        return received

    received = asyncio.run(scenario())
    assert received.startswith("event: state\ndata: ")
    assert json.loads(received.split("data: ", 1)[1]) == {"deployment": "dep-a", "from": "loading", "to": "ready"}


@pytest.mark.django_db(transaction=True)  # the async view reads through its own connection
def test_the_stream_is_for_those_who_may_see_the_deployment(client, personas):
    node = register_node(NodeReport(name="n", address="127.0.0.1"))
    deployment = Deployment.objects.create(name="m", model_path="/m.gguf", node=node, owner=personas.acme.project)
    url = f"/models/deployments/{deployment.public_id}/stream/"
    client.force_login(personas.oscar)
    assert client.get(url).status_code == 404
    client.force_login(personas.vera)
    response = client.get(url)
    assert response.status_code == 200 and response["Content-Type"] == "text/event-stream"
    response.close()
    page = client.get(f"/models/deployments/{deployment.public_id}/").content.decode()
    assert "EventSource" in page and 'hx-trigger="deployment-changed from:body"' in page
