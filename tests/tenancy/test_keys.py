"""API keys: shown once, stored as a keyed hash, one lookup to authenticate, and their lifecycle."""

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from tenancy import keys
from tenancy.errors import (ApiKeyExpired, ApiKeyRevoked, ApprovalRequired, ClientDisabled, InvalidApiKey,
                            MalformedAuthorization)
from tenancy.models import AuditEvent, Credential
from tenancy.services import approvals, clients

pytestmark = pytest.mark.django_db


@pytest.fixture
def client_app(personas):
    return clients.create_client(personas.max_actor, personas.acme.project, "search-app", all_models=True)


def test_key_has_a_readable_prefix_and_only_its_keyed_hash_is_stored(personas, client_app):
    credential, plaintext = clients.create_credential(personas.max_actor, client_app, name="ci")
    assert plaintext.startswith("brk_") and len(plaintext.split("_", 2)[2]) >= 43  # 32 random bytes
    row = Credential.objects.get(pk=credential.pk)
    stored = bytes(row.secret_hash)
    assert len(stored) == 32 and plaintext.encode() not in stored
    assert plaintext.split("_", 2)[2] not in str(Credential.objects.filter(pk=row.pk).values().get())
    assert plaintext.startswith(row.prefix)


def test_authentication_is_one_query(personas, client_app):
    _, plaintext = clients.create_credential(personas.max_actor, client_app)
    clients.authenticate(plaintext)  # first use writes last_used_at
    with CaptureQueriesContext(connection) as queries:
        credential = clients.authenticate(plaintext)
    assert len(queries) == 1
    assert credential.client.project.path == "acme/ml/search"  # client and project came with it


def test_last_used_is_written_at_most_once_a_minute(personas, client_app):
    credential, plaintext = clients.create_credential(personas.max_actor, client_app)
    first = clients.authenticate(plaintext).last_used_at
    assert clients.authenticate(plaintext).last_used_at == first
    Credential.objects.filter(pk=credential.pk).update(last_used_at=timezone.now() - timedelta(minutes=2))
    assert clients.authenticate(plaintext).last_used_at > first


@pytest.mark.parametrize("header", [None, "", "brk_abc", "Basic dXNlcjpwYXNz", "Bearer "])
def test_malformed_authorization_header_is_refused(header):
    with pytest.raises(MalformedAuthorization):
        clients.credential_from_header(header)


def test_wrong_and_malformed_keys_are_refused_alike(personas, client_app):
    _, plaintext = clients.create_credential(personas.max_actor, client_app)
    lookup = plaintext.split("_")[1]
    for wrong in (plaintext[:-1] + ("A" if plaintext[-1] != "A" else "B"), f"brk_{lookup}_" + "x" * 43,
                  "brk_000000000000_" + "y" * 43, "sk-not-ours", ""):
        with pytest.raises(InvalidApiKey):
            clients.authenticate(wrong)


def test_expired_key_is_refused(personas, client_app):
    credential, plaintext = clients.create_credential(personas.max_actor, client_app, lifetime=timedelta(days=30))
    assert credential.expires_at > timezone.now() + timedelta(days=29)
    Credential.objects.filter(pk=credential.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    with pytest.raises(ApiKeyExpired):
        clients.authenticate(plaintext)


def test_revoked_key_stops_at_once(personas, client_app):
    credential, plaintext = clients.create_credential(personas.max_actor, client_app)
    clients.revoke_credential(personas.max_actor, credential)
    with pytest.raises(ApiKeyRevoked):
        clients.authenticate(plaintext)


def test_key_of_a_disabled_client_is_refused(personas, client_app):
    _, plaintext = clients.create_credential(personas.max_actor, client_app)
    clients.update_client(personas.max_actor, client_app, is_active=False)
    with pytest.raises(ClientDisabled):
        clients.authenticate(plaintext)


def test_rotation_overlaps_then_only_the_new_key_works(personas, client_app):
    old, old_plain = clients.create_credential(personas.max_actor, client_app, lifetime=timedelta(days=90))
    new, new_plain = clients.rotate_credential(personas.max_actor, old, overlap=timedelta(hours=1))
    assert clients.authenticate(old_plain).pk == old.pk  # inside the window both work
    assert clients.authenticate(new_plain).pk == new.pk
    assert new.lifetime == timedelta(days=90) and new.expires_at > timezone.now() + timedelta(days=89)
    old.refresh_from_db()
    assert old.expires_at <= timezone.now() + timedelta(hours=1)
    Credential.objects.filter(pk=old.pk).update(expires_at=timezone.now() - timedelta(seconds=1))  # the window ends
    with pytest.raises(ApiKeyExpired):
        clients.authenticate(old_plain)
    assert clients.authenticate(new_plain).pk == new.pk


def test_production_key_needs_an_approval_from_someone_else(personas):
    production = clients.create_client(personas.olivia_actor, personas.acme.project, "prod-app",
                                       environment="production")
    with pytest.raises(ApprovalRequired) as needed:
        clients.create_credential(personas.max_actor, production)
    evidence = needed.value.details["evidence"]
    approval = approvals.request_approval(personas.max_actor, "credential.create_production", personas.acme.project,
                                          production, evidence, "the search app goes live")
    approvals.decide(personas.olivia_actor, approval, approve=True)
    credential, _ = clients.create_credential(personas.max_actor, production, approval=approval.public_id)
    assert credential.client == production


def test_viewer_cannot_make_keys_and_outsider_cannot_see_the_client(personas, client_app):
    from berth.errors import NotFound
    from tenancy.errors import Forbidden

    with pytest.raises(Forbidden):
        clients.create_credential(personas.vera_actor, client_app)
    with pytest.raises(NotFound):
        clients.create_credential(personas.oscar_actor, client_app)


def test_key_events_are_audited_once_each_and_never_hold_the_secret(personas, client_app):
    before = AuditEvent.objects.count()
    credential, plaintext = clients.create_credential(personas.max_actor, client_app)
    new, new_plain = clients.rotate_credential(personas.max_actor, credential)
    clients.revoke_credential(personas.max_actor, new)
    clients.revoke_credential(personas.max_actor, new)  # already revoked: no second event
    events = list(AuditEvent.objects.order_by("id")[before:])
    assert [e.action for e in events] == ["credential.create", "credential.rotate", "credential.revoke"]
    dump = " ".join(str(e.details) for e in AuditEvent.objects.all())
    for secret in (plaintext, new_plain):
        assert secret.split("_", 2)[2] not in dump


def test_digest_depends_on_the_pepper(settings):
    secret = "s" * 43
    first = keys.digest(secret)
    settings.KEY_PEPPER = "another-pepper-entirely-0123456789abcdef"
    assert keys.digest(secret) != first


def test_authentication_returns_fields_as_the_orm_would(personas):
    client = clients.create_client(personas.max_actor, personas.acme.project, "picky", allowed_models=["a", "b"])
    credential, plaintext = clients.create_credential(personas.max_actor, client, lifetime=timedelta(days=1))
    found = clients.authenticate(plaintext)
    assert found.client.allowed_models == ["a", "b"] and found.client.allows_model("a")
    assert not found.client.allows_model("c")
    assert found.lifetime == timedelta(days=1) and found.public_id == credential.public_id
    assert found.client.project.path == "acme/ml/search"


def test_key_limits_are_validated_and_carried_over_on_rotation(personas, client_app):
    from tenancy.errors import InvalidTree

    with pytest.raises(InvalidTree) as refused:
        clients.create_credential(personas.max_actor, client_app, rpm_limit=0, colour=1)
    assert set(refused.value.details) == {"rpm_limit", "colour"}
    credential, _ = clients.create_credential(personas.max_actor, client_app, rpm_limit=60, concurrency_limit=2)
    new, _ = clients.rotate_credential(personas.max_actor, credential)
    assert (new.rpm_limit, new.tpm_limit, new.concurrency_limit) == (60, None, 2)


def test_every_authenticated_field_equals_the_orm_value_and_the_key_keeps_working(personas):
    """On every database (SQLite hands datetimes back as text): an expiring key works on its first use
    and every later one, and each field the single-lookup query returns is the ORM's own value."""
    client = clients.create_client(personas.max_actor, personas.acme.project, "steady")
    credential, plaintext = clients.create_credential(personas.max_actor, client, lifetime=timedelta(days=1))
    for _ in range(3):
        found = clients.authenticate(plaintext)
    assert found.last_used_at is not None and timezone.is_aware(found.last_used_at)
    for found_row, orm_row in ((found, Credential.objects.get(pk=credential.pk)), (found.client, client),
                               (found.client.project, personas.acme.project)):
        orm_row.refresh_from_db()
        for field in type(orm_row)._meta.concrete_fields:
            assert getattr(found_row, field.attname) == getattr(orm_row, field.attname), field.name
