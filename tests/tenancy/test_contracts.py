"""Contracts: validation names the figures, holdings sum up the tree, limits name the refusing scope."""

import threading
from decimal import Decimal

import pytest
from django.db import connection

from tenancy.errors import ApprovalRequired, ApprovalStale, CapacityExceeded, Forbidden, InvalidContract
from tenancy.models import AuditEvent, Contract, Reservation
from tenancy.services import approvals, contracts

pytestmark = pytest.mark.django_db


def test_guarantee_above_the_limit_is_refused_with_the_figures(personas):
    with pytest.raises(InvalidContract) as refused:
        contracts.set_contract(personas.olivia_actor, personas.acme.org, gpu_memory_gib_guarantee=200,
                               gpu_memory_gib_limit=160)
    assert "guarantee (200 GiB) exceeds its limit (160 GiB)" in refused.value.message
    assert "gpu_memory_gib_guarantee" in refused.value.details


def test_children_guarantees_cannot_exceed_the_parents(personas):
    olivia = personas.olivia_actor
    # Guarantees set with approvals (test_hardening shows that they need them): written directly here.
    Contract.objects.create(scope=personas.acme.org, gpus_guarantee=8)
    Contract.objects.create(scope=personas.acme.team, gpus_guarantee=6)
    from tenancy.services import tree

    other = tree.create_scope(olivia, "team", "infra", parent=personas.acme.org)
    with pytest.raises(InvalidContract) as refused:
        contracts.set_contract(olivia, other, gpus_guarantee=3)
    assert "guarantees under org:acme would add up to 9, more than its own guarantee of 8" in refused.value.message
    with pytest.raises(InvalidContract, match="children add up to 6, more than the 5 asked for"):
        contracts.set_contract(olivia, personas.acme.org, gpus_guarantee=5)


@pytest.mark.parametrize("figures, field", [({"gpus_limit": -1}, "gpus_limit"), ({"rpm_limit": 1.5}, "rpm_limit"),
                                            ({"gpus_limit": "lots"}, "gpus_limit"), ({"colour": 1}, "colour"),
                                            ({"budget_mode": "maybe"}, "budget_mode")])
def test_malformed_figures_are_refused(personas, figures, field):
    with pytest.raises(InvalidContract) as refused:
        contracts.set_contract(personas.olivia_actor, personas.acme.org, **figures)
    assert field in refused.value.details


def test_member_cannot_set_contracts(personas):
    with pytest.raises(Forbidden):
        contracts.set_contract(personas.max_actor, personas.acme.project, gpus_limit=1)


def test_holdings_sum_up_the_tree_and_the_chain_reads_nearest_first(personas):
    contracts.set_contract(personas.olivia_actor, personas.acme.org, gpu_memory_gib_limit=160)
    contracts.set_contract(personas.olivia_actor, personas.acme.project, gpu_memory_gib_limit=100)
    contracts.reserve(personas.acme.project, "replica:a", gpu_memory_gib=40, gpus=1)
    contracts.reserve(personas.acme.team, "replica:b", gpu_memory_gib=20)
    assert contracts.holdings(personas.acme.org).gpu_memory_gib == Decimal(60)
    assert contracts.holdings(personas.acme.project).gpu_memory_gib == Decimal(40)
    assert contracts.holdings(personas.globex.org).gpu_memory_gib == Decimal(0)
    assert [c.scope.path for c in contracts.limit_chain(personas.acme.project)] == ["acme/ml/search", "acme"]


def test_limit_check_names_the_refusing_scope_and_figure(personas):
    contracts.set_contract(personas.olivia_actor, personas.acme.org, gpu_memory_gib_limit=160)
    contracts.reserve(personas.acme.project, "replica:a", gpu_memory_gib=150)
    verdict = contracts.check_addition(personas.acme.project, gpu_memory_gib=20)
    assert not verdict.fits
    assert verdict.refusals[0].message == "org:acme is at its GPU memory limit (150 GiB of 160 held; 20 GiB more asked)"
    assert contracts.check_addition(personas.acme.project, gpu_memory_gib=10).fits
    with pytest.raises(CapacityExceeded) as refused:
        contracts.reserve(personas.acme.project, "replica:b", gpu_memory_gib=20)
    assert refused.value.details["refusals"][0]["scope"] == "org:acme"


def test_release_frees_what_was_held(personas):
    contracts.reserve(personas.acme.project, "replica:a", cores=4)
    assert contracts.release("replica:a") is True
    assert contracts.release("replica:a") is False
    assert contracts.holdings(personas.acme.org).cores == 0


@pytest.mark.django_db(transaction=True)
def test_two_concurrent_reservations_cannot_both_take_the_last_of_a_limit(personas):
    contracts.set_contract(personas.olivia_actor, personas.acme.org, gpus_limit=1)
    results = []
    barrier = threading.Barrier(2)

    def take(holder):
        barrier.wait()
        try:
            contracts.reserve(personas.acme.project, holder, gpus=1)
            results.append("ok")
        except CapacityExceeded:
            results.append("refused")
        finally:
            connection.close()

    threads = [threading.Thread(target=take, args=(f"replica:{i}",)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(results) == ["ok", "refused"]
    assert Reservation.objects.count() == 1


def test_raising_a_limit_needs_an_approval_and_stale_evidence_is_refused(personas, django_user_model):
    olivia = personas.olivia_actor
    contracts.set_contract(olivia, personas.acme.org, gpu_memory_gib_limit=160)  # a first limit lowers: no approval
    with pytest.raises(ApprovalRequired) as needed:
        contracts.set_contract(olivia, personas.acme.org, gpu_memory_gib_limit=320)
    approval = approvals.request_approval(olivia, "contract.raise_limit", personas.acme.org, personas.acme.org,
                                          needed.value.details["evidence"], "two more H100s")
    from tenancy.audit import Actor
    from tenancy.models import Membership

    second = django_user_model.objects.create_user("sam")
    Membership.objects.create(user=second, scope=personas.acme.org, role="admin")
    approvals.decide(Actor(user=second), approval, approve=True)
    contracts.set_contract(olivia, personas.acme.org, gpus_limit=8)  # the contract changed since the approval
    with pytest.raises(ApprovalStale):
        contracts.set_contract(olivia, personas.acme.org, approval=approval.public_id, gpu_memory_gib_limit=320)


def test_a_weekly_budget_loosened_needs_an_approval_as_the_daily_and_monthly_do(personas):
    olivia = personas.olivia_actor
    contracts.set_contract(olivia, personas.acme.team, weekly_token_budget=5000)  # a first budget lowers
    contracts.set_contract(olivia, personas.acme.team, weekly_token_budget=4000)  # and lowering again
    for loosened in ({"weekly_token_budget": 6000}, {"weekly_token_budget": None}, {"budget_mode": "soft"}):
        with pytest.raises(ApprovalRequired):
            contracts.set_contract(olivia, personas.acme.team, **loosened)
    assert Contract.objects.get(scope=personas.acme.team).weekly_token_budget == 4000


def test_each_contract_change_is_audited_once(personas):
    before = AuditEvent.objects.count()
    contracts.set_contract(personas.olivia_actor, personas.acme.org, cores_limit=64, rpm_limit=600)
    event = AuditEvent.objects.order_by("id")[before:].get()
    assert event.action == "contract.set"
    assert event.details["changed"]["cores_limit"] == {"from": None, "to": "64"}
    assert event.details["changed"]["rpm_limit"] == {"from": None, "to": "600"}
