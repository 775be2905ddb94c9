"""The tenancy command for an administrator without a browser."""

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from tenancy.models import AuditEvent, Contract, Membership, Scope
from tenancy.services import clients

pytestmark = pytest.mark.django_db


def run(*args) -> str:
    from io import StringIO

    out = StringIO()
    call_command("tenancy", *args, stdout=out)
    return out.getvalue()


def test_create_tree_makes_every_missing_level_once():
    output = run("create-tree", "project:acme/ml/search", "--name", "Search")
    assert [s.written for s in Scope.objects.all()] == ["org:acme", "team:acme/ml", "project:acme/ml/search"]
    assert Scope.objects.get(path="acme/ml/search").name == "Search"
    assert "project:acme/ml/search is ready." in output
    run("create-tree", "project:acme/ml/search")
    assert Scope.objects.count() == 3
    assert AuditEvent.objects.filter(action="scope.create", actor="system:cli").count() == 3


def test_create_tree_refuses_a_malformed_scope():
    with pytest.raises(CommandError, match="project:ORG/TEAM/PROJECT"):
        run("create-tree", "project:acme/search")


def test_add_member_and_change_their_role(django_user_model):
    run("create-tree", "team:acme/ml")
    run("add-member", "max", "team:acme/ml", "viewer", "--create-user")
    run("add-member", "max", "team:ml", "member")
    membership = Membership.objects.get()
    assert (membership.user.username, membership.scope.path, membership.role) == ("max", "acme/ml", "member")
    assert not membership.user.has_usable_password()


def test_add_member_of_an_unknown_user_says_how_to_create_one():
    run("create-tree", "org:acme")
    with pytest.raises(CommandError, match="--create-user"):
        run("add-member", "ghost", "org:acme", "viewer")


def test_create_client_prints_a_working_key_once():
    run("create-tree", "project:acme/ml/search")
    output = run("create-client", "project:acme/ml/search", "search-app", "--models", "smollm2,qwen")
    key = output.strip().splitlines()[-1]
    credential = clients.authenticate(key)
    assert credential.client.allowed_models == ["smollm2", "qwen"] and not credential.client.all_models
    assert key not in str(list(AuditEvent.objects.values_list("details", flat=True)))


def test_production_key_from_the_command_line_still_needs_an_approval():
    run("create-tree", "project:acme/ml/search")
    with pytest.raises(CommandError, match=r"approval_required"):
        run("create-client", "project:acme/ml/search", "prod", "--environment", "production")


def test_set_contract_and_refusals_name_the_figures():
    run("create-tree", "org:acme")
    run("set-contract", "org:acme", "--gpu-memory-gib-limit", "160", "--rpm-limit", "600")
    contract = Contract.objects.get()
    assert contract.gpu_memory_gib_limit == 160 and contract.rpm_limit == 600
    with pytest.raises(CommandError, match=r"guarantee \(200 GiB\) exceeds its limit \(160 GiB\)"):
        run("set-contract", "org:acme", "--gpu-memory-gib-guarantee", "200")
    with pytest.raises(CommandError, match="approval_required"):
        run("set-contract", "org:acme", "--gpu-memory-gib-limit", "none")
