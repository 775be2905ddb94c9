"""One FilterSet for deployments (``serving.deployments.filters.DeploymentFilterSet``): the console's
Models page and the API's ``/api/serving/deployments/`` select the same rows for the same query, each
narrowed first to the deployments the caller may see."""

from __future__ import annotations

import pytest

from scheduler.services import NodeReport, register_node
from serving.models import Deployment

pytestmark = pytest.mark.django_db

PAGE, LIST = "/models/", "/api/serving/deployments/"


def _node(name):
    return register_node(NodeReport(name=name, address="127.0.0.1", cpu_count=8, memory_total_bytes=64 * 2**30,
                                    memory_available_bytes=60 * 2**30))


@pytest.fixture
def deployed(personas, admin_user):
    """acme's search project runs two models on cpu-01 and one on cpu-02; globex runs one on cpu-01
    with a name that looks like acme's; one deployment has no owner (administrators only)."""
    cpu1, cpu2 = _node("cpu-01"), _node("cpu-02")
    acme, globex = personas.acme.project, personas.globex.project
    for name, node, owner, state, engine in (
            ("acme-chat", cpu1, acme, "ready", "llamacpp"),
            ("acme-embed", cpu2, acme, "stopped", "llamacpp"),
            ("acme-large", cpu1, acme, "ready", "vllm"),
            ("globex-secret-chat", cpu1, globex, "ready", "llamacpp"),
            ("fleet-shared", cpu2, None, "ready", "llamacpp")):
        Deployment.objects.create(name=name, model_path=f"/models/{name}.gguf", node=node, owner=owner, state=state,
                                  engine=engine)
    return personas


def on_the_page(client, query) -> list[str]:
    page = client.get(PAGE, query)
    assert page.status_code == 200
    return [str(row.public_id) for row in page.context["table"].rows]


def through_the_api(client, query) -> list[str]:
    answer = client.get(LIST, query)
    assert answer.status_code == 200, answer.content
    return [row["id"] for row in answer.json()["results"]]


ACME = {"acme-chat", "acme-embed", "acme-large"}
QUERIES = [{}, {"q": "chat"}, {"q": "ACME"}, {"q": "secret"}, {"state": "ready"}, {"state": "stopped"},
           {"engine": "llamacpp"}, {"engine": "vllm"}, {"node": "cpu-01"}, {"node": "cpu-02"}, {"node": "cpu-99"},
           {"state": "ready", "engine": "llamacpp", "node": "cpu-01", "q": "chat"}]


@pytest.mark.parametrize("who", ["admin", "olivia", "vera", "oscar"])
def test_the_models_page_and_the_api_select_the_same_deployments(client, deployed, admin_user, who):
    client.force_login(admin_user if who == "admin" else getattr(deployed, who))
    seen = set()
    for query in QUERIES:
        rows = on_the_page(client, query)
        assert rows == through_the_api(client, query), query
        seen |= set(Deployment.objects.filter(public_id__in=rows).values_list("name", flat=True))
    expected = {"admin": {"acme-chat", "acme-embed", "acme-large", "globex-secret-chat", "fleet-shared"},
                "oscar": {"globex-secret-chat"}}
    assert seen == expected.get(who, ACME)


def test_each_filter_selects_what_it_says(client, deployed):
    client.force_login(deployed.olivia)
    names = {key: sorted(Deployment.objects.filter(public_id__in=on_the_page(client, query))
                         .values_list("name", flat=True)) for key, query in (
        ("ready", {"state": "ready"}), ("vllm", {"engine": "vllm"}), ("cpu-02", {"node": "cpu-02"}),
        ("chat", {"q": "chat"}), ("all", {"state": "ready", "engine": "llamacpp", "node": "cpu-01"}))}
    assert names == {"ready": ["acme-chat", "acme-large"], "vllm": ["acme-large"], "cpu-02": ["acme-embed"],
                     "chat": ["acme-chat"], "all": ["acme-chat"]}


def test_an_outsider_filtering_by_another_tenants_deployment_gets_nothing_and_no_error(client, deployed):
    client.force_login(deployed.oscar)
    for query in ({"q": "acme-chat"}, {"q": "acme", "node": "cpu-01"}, {"engine": "vllm"}):
        page = client.get(PAGE, query)
        assert page.status_code == 200 and list(page.context["table"].rows) == []
        assert not page.context["filterset"].form.errors
        assert not [name for name in ACME - set(query.values()) if name in page.content.decode()]
        answer = client.get(LIST, query)
        assert answer.status_code == 200 and answer.json()["results"] == []
    # His own filter finds his own deployment on the node they share.
    assert len(on_the_page(client, {"node": "cpu-01"})) == 1


@pytest.mark.parametrize("query, field", [({"state": "won"}, "state"), ({"engine": "tensorrt"}, "engine")])
def test_a_choice_that_does_not_exist_is_a_400_in_the_api_and_an_empty_table_with_the_reason_on_the_page(
        client, deployed, query, field):
    client.force_login(deployed.olivia)
    answer = client.get(LIST, query)
    assert answer.status_code == 400 and field in answer.json()["error"]["details"]
    page = client.get(PAGE, query)
    assert page.status_code == 200 and list(page.context["table"].rows) == []
    assert field in page.context["filterset"].form.errors
    assert "Select a valid choice" in page.content.decode()


def test_the_filtered_table_refreshes_itself_with_its_filters(client, deployed):
    client.force_login(deployed.olivia)
    fragment = client.get(PAGE, {"state": "stopped"}, HTTP_HX_REQUEST="true")
    body = fragment.content.decode()
    assert fragment.status_code == 200 and "<html" not in body and 'id="deployments-table"' in body
    assert 'hx-get="/models/?state=stopped"' in body
    assert "acme-embed" in body and "acme-chat" not in body
    assert "No deployments match these filters." in client.get(PAGE, {"node": "cpu-99"}).content.decode()
    page = client.get(PAGE).content.decode()
    assert 'class="filters"' in page and 'hx-target="#deployments-table"' in page
