"""serve_model's smoke request for a project's model goes through the real gateway, as one of that
project's clients would send it: routed to the replica, recorded as the project's usage, and its key
revoked once answered."""

import pytest

from gateway.models import UsageRecord
from serving.control import serve_model
from tenancy.models import Credential
from tests.assets.waiting import wait_until

pytestmark = [pytest.mark.llama, pytest.mark.django_db(transaction=True)]


def test_a_project_models_smoke_request_goes_through_the_gateway(gateway, tiny_engine, deploy, tree, settings):
    made = deploy("smoke-tiny", tiny_engine)
    made.deployment.owner = tree.project
    made.deployment.save(update_fields=["owner"])
    settings.SERVING_GATEWAY_URL = gateway.base_url
    answer, rate, via = serve_model.smoke_test(made.replica, tree.actor)
    assert via == gateway.base_url and isinstance(answer, str) and rate > 0
    record = wait_until(lambda: UsageRecord.objects.filter(model_served="smoke-tiny").first(), 20,
                        what="the smoke request's usage record")
    assert record.status == 200 and str(record.replica_id) == tiny_engine.replica_id
    assert record.client.name == serve_model.SMOKE_CLIENT and record.client.project == tree.project
    assert Credential.objects.get(pk=record.credential_id).revoked_at is not None
