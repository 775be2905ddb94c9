"""Capacity contracts through the management API: read and set by scope, the limit check, the
limit chain, and who may do which."""

import pytest

from tenancy.models import AuditEvent, Contract
from tenancy.services import contracts

pytestmark = pytest.mark.django_db

CONTRACTS = "/api/tenancy/contracts/"


def url(scope) -> str:
    return f"{CONTRACTS}{scope.public_id}/"


def error_code(response) -> str:
    return response.json()["error"]["code"]


def test_a_scope_without_a_contract_reads_as_an_empty_one(personas, api):
    body = api(personas.vera).get(url(personas.acme.project)).json()
    assert body["id"] is None and body["scope_written"] == "project:acme/ml/search"
    assert body["gpu_memory_gib_limit"] is None and body["budget_mode"] == "hard"


def test_owner_sets_a_contract_and_patch_keeps_the_other_figures(personas, api):
    olivia = api(personas.olivia)
    # (Setting a guarantee needs an approval: test_hardening shows it.)
    put = olivia.put(url(personas.acme.org), {"gpu_memory_gib_limit": "160", "rpm_limit": 6000, "budget_mode": "soft"})
    assert put.status_code == 200, put.content
    assert put.json()["gpu_memory_gib_limit"] == "160.00" and put.json()["id"]
    patched = olivia.patch(url(personas.acme.org), {"gpus_limit": 8})
    assert patched.status_code == 200
    assert (patched.json()["gpus_limit"], patched.json()["gpu_memory_gib_limit"], patched.json()["rpm_limit"]) \
        == ("8.00", "160.00", 6000)
    assert olivia.get(url(personas.acme.org)).json()["gpus_limit"] == "8.00"


def test_a_weekly_token_budget_is_set_and_read_beside_the_daily_and_monthly(personas, api):
    olivia = api(personas.olivia)
    assert olivia.get(url(personas.acme.team)).json()["weekly_token_budget"] is None
    put = olivia.put(url(personas.acme.team), {"daily_token_budget": 1000, "weekly_token_budget": 5000,
                                               "monthly_token_budget": 20000})
    assert put.status_code == 200, put.content
    assert (put.json()["daily_token_budget"], put.json()["weekly_token_budget"], put.json()["monthly_token_budget"]) \
        == (1000, 5000, 20000)
    assert olivia.patch(url(personas.acme.team), {"weekly_token_budget": 4000}).json()["weekly_token_budget"] == 4000
    assert Contract.objects.get(scope=personas.acme.team).weekly_token_budget == 4000
    chain = olivia.get(CONTRACTS + "chain/", {"scope": "project:acme/ml/search"}).json()
    assert [(row["scope_written"], row["weekly_token_budget"]) for row in chain] == [("team:acme/ml", 4000)]
    refused = olivia.patch(url(personas.acme.team), {"weekly_token_budget": 4500})  # a raise: approval
    assert (refused.status_code, error_code(refused)) == (428, "approval_required")
    assert refused.json()["error"]["details"]["evidence"]["proposed"]["weekly_token_budget"] == "4500"
    typed = olivia.patch(url(personas.acme.team), {"weekly_token_budget": -1})
    assert typed.status_code == 400 and "weekly_token_budget" in typed.json()["error"]["details"]


def test_member_and_viewer_cannot_change_contracts(personas, api):
    assert api(personas.max).patch(url(personas.acme.team), {"gpus_limit": 4}).status_code == 403
    assert api(personas.vera).patch(url(personas.acme.project), {"gpus_limit": 4}).status_code == 403
    assert api(personas.vera).put(url(personas.acme.project), {"gpus_limit": 4}).status_code == 403
    assert not Contract.objects.exists()


def test_outsider_gets_404_for_another_orgs_contract(personas, api):
    contracts.set_contract(personas.olivia_actor, personas.acme.org, gpus_limit=8)
    oscar = api(personas.oscar)
    responses = [oscar.get(url(personas.acme.org)), oscar.patch(url(personas.acme.org), {"gpus_limit": 1}),
                 oscar.get(CONTRACTS + "chain/", {"scope": "org:acme"}),
                 oscar.post(CONTRACTS + "check/", {"scope": "org:acme", "gpus": 1})]
    assert [r.status_code for r in responses] == [404] * 4
    assert oscar.get(CONTRACTS).json()["results"] == []
    assert Contract.objects.get().gpus_limit == 8


def test_invalid_contracts_are_refused_with_the_figures_named(personas, api):
    olivia = api(personas.olivia)
    over = olivia.patch(url(personas.acme.org), {"gpu_memory_gib_guarantee": 200, "gpu_memory_gib_limit": 160})
    assert (over.status_code, error_code(over)) == (400, "invalid_contract")
    assert "guarantee (200 GiB) exceeds its limit (160 GiB)" in over.json()["error"]["message"]
    Contract.objects.create(scope=personas.acme.org, gpus_guarantee=4)  # set with an approval, say
    children = olivia.patch(url(personas.acme.team), {"gpus_guarantee": 6})
    assert error_code(children) == "invalid_contract"
    assert "more than its own guarantee of 4" in children.json()["error"]["details"]["gpus_guarantee"]
    typed = olivia.patch(url(personas.acme.org), {"gpus_limit": "lots", "budget_mode": "maybe", "rpm_limit": -1})
    assert (typed.status_code, error_code(typed)) == (400, "invalid")
    assert set(typed.json()["error"]["details"]) == {"gpus_limit", "budget_mode", "rpm_limit"}


def test_check_names_the_scope_and_figure_that_refuse(personas, api):
    contracts.set_contract(personas.olivia_actor, personas.acme.org, gpu_memory_gib_limit=160)
    contracts.reserve(personas.acme.project, "replica:1", gpu_memory_gib=150)
    vera = api(personas.vera)
    refused = vera.post(CONTRACTS + "check/", {"scope": "project:acme/ml/search", "gpu_memory_gib": "20"})
    assert refused.status_code == 200
    verdict = refused.json()
    assert verdict["fits"] is False
    assert [(r["scope"], r["figure"], r["held"], r["limit"]) for r in verdict["refusals"]] \
        == [("org:acme", "gpu_memory_gib", "150.00", "160.00")]
    assert verdict["refusals"][0]["message"].startswith("org:acme is at its GPU memory limit (150 GiB of 160")
    fits = vera.post(CONTRACTS + "check/", {"scope": "project:acme/ml/search", "gpu_memory_gib": "10"})
    assert fits.json() == {"fits": True, "refusals": []}


def test_chain_lists_the_limits_above_a_scope_nearest_first(personas, api):
    contracts.set_contract(personas.olivia_actor, personas.acme.org, gpus_limit=8)
    contracts.set_contract(personas.olivia_actor, personas.acme.team, gpus_limit=4)
    chain = api(personas.olivia).get(CONTRACTS + "chain/", {"scope": "project:acme/ml/search"})
    assert chain.status_code == 200
    assert [(row["scope_written"], row["gpus_limit"]) for row in chain.json()] \
        == [("team:acme/ml", "4.00"), ("org:acme", "8.00")]
    # Only contracts the caller may read directly: vera views the project alone (test_hardening has more).
    assert api(personas.vera).get(CONTRACTS + "chain/", {"scope": "project:acme/ml/search"}).json() == []


def test_contract_list_is_narrowed_and_filtered_by_scope(personas, api):
    contracts.set_contract(personas.olivia_actor, personas.acme.org, gpus_limit=8)
    contracts.set_contract(personas.olivia_actor, personas.acme.team, gpus_limit=4)
    contracts.set_contract(personas.oscar_actor, personas.globex.org, gpus_limit=2)
    assert [r["scope_written"] for r in api(personas.max).get(CONTRACTS).json()["results"]] == ["team:acme/ml"]
    olivia = api(personas.olivia).get(CONTRACTS, {"scope": "team:acme/ml"}).json()["results"]
    assert [r["scope_written"] for r in olivia] == ["team:acme/ml"]


def test_setting_a_contract_leaves_exactly_one_event(personas, api):
    before = AuditEvent.objects.count()
    api(personas.olivia).patch(url(personas.acme.team), {"cores_limit": 64})
    assert list(AuditEvent.objects.order_by("id").values_list("action", flat=True)[before:]) == ["contract.set"]
