"""One FilterSet for placement decisions (``scheduler.filtersets.PlacementDecisionFilterSet``): the
console's placement page and the API's ``/api/scheduler/decisions/`` select the same rows for the same
query, each narrowed first to the decisions the caller may read."""

import pytest

from scheduler.models import PlacementDecision
from scheduler.placement_service import headroom, record_plan
from scheduler.policy.inputs import GIB, DesiredModel, Profile
from scheduler.policy.plan import schedule
from scheduler.snapshot import current_snapshot

pytestmark = pytest.mark.django_db

DECISIONS, PAGE = "/api/scheduler/decisions/", "/fleet/placement/"


def llm(mid, gib=30, **kw):
    return DesiredModel(mid, (Profile("default", "vllm", 1, gib * GIB),), **kw)


@pytest.fixture
def staff(django_user_model):
    return django_user_model.objects.create_user("stella", "stella@example.org", "a-long-test-password",
                                                 is_staff=True)


@pytest.fixture
def decided(personas, h100_node):
    """Plans about a model of acme/ml/search, one of globex and a shared one: placed, then refused;
    and a dry run of acme's."""
    models = (llm("acme-search-llm", owner="acme/ml/search"), llm("globex-secret-llm", owner="globex"),
              llm("shared-llm"))
    fits = current_snapshot(models, now=1000.0)
    record_plan(fits, schedule(fits))
    too_big = tuple(llm(m.id, gib=500, owner=m.owner) for m in models)
    refused = current_snapshot(too_big, now=1001.0)
    record_plan(refused, schedule(refused))
    headroom(current_snapshot(models[:1], now=1002.0), "acme-search-llm")
    return personas


QUERIES = [{}, {"model": "acme-search-llm"}, {"model": "globex-secret-llm"}, {"model": " shared-llm "},
           {"verdict": "placed"}, {"verdict": "unschedulable"}, {"kind": "plan"}, {"kind": "headroom"},
           {"model": "acme-search-llm", "verdict": "placed", "kind": "plan"}]


@pytest.mark.parametrize("who", ["staff", "olivia", "vera", "oscar"])
def test_the_placement_page_and_the_api_select_the_same_decisions(client, decided, staff, who):
    user = staff if who == "staff" else getattr(decided, who)
    client.force_login(user)
    seen = set()
    for query in QUERIES:
        page = client.get(PAGE, query)
        assert page.status_code == 200
        on_the_page = [str(row.public_id) for row in page.context["decisions"]]
        answer = client.get(DECISIONS, query)
        assert answer.status_code == 200, answer.content
        assert on_the_page == [row["public_id"] for row in answer.json()["results"]], query
        seen |= {row.model for row in page.context["decisions"]}
    expected = {"staff": {"acme-search-llm", "globex-secret-llm", "shared-llm"}, "oscar": {"globex-secret-llm"}}
    assert seen == expected.get(who, {"acme-search-llm"})


def test_an_outsider_filtering_by_another_tenants_model_gets_nothing(client, decided):
    assert PlacementDecision.objects.filter(model="acme-search-llm").exists()
    client.force_login(decided.oscar)
    page = client.get(PAGE, {"model": "acme-search-llm"})
    assert list(page.context["decisions"]) == []
    answer = client.get(DECISIONS, {"model": "acme-search-llm"})
    assert answer.status_code == 200 and answer.json()["results"] == []


def test_a_verdict_that_does_not_exist_is_a_400_naming_the_filter_and_selects_nothing_on_the_page(client, decided):
    client.force_login(decided.olivia)
    answer = client.get(DECISIONS, {"verdict": "won"})
    assert answer.status_code == 400 and "verdict" in answer.json()["error"]["details"]
    page = client.get(PAGE, {"verdict": "won"})
    assert page.status_code == 200 and list(page.context["decisions"]) == []
