"""The playground's kept key after a revocation, against a gateway process of its own: the refusal
is said once and the next send mints a new key. Here over Redis, which carries the revocation to the
gateway process at once; the embedded default (one process: the console is the gateway's) is walked
end to end by tests/test_newcomer_journey.py, whose last step is this one."""

import pytest
from django.test import override_settings

from tenancy.models import Credential
from tests.assets.waiting import wait_until
from tests.gateway.test_console_playground import member  # noqa: F401  (a fixture)


@pytest.mark.django_db
def test_a_revoked_playground_key_is_refused_once_and_the_next_request_mints_a_new_one(
        client, member, gateway, deploy, make_key, chat_engine):
    from tenancy.audit import Actor
    from tenancy.services import clients

    deploy("play-chat", chat_engine)
    app = make_key(environment="staging").client
    client.force_login(member)
    send = {"client": str(app.public_id), "model": "play-chat", "kind": "chat", "text": "Say hi."}
    with override_settings(GATEWAY_INTERNAL_URL=gateway.base_url):
        assert "200 in" in client.post("/gateway/playground/", send, HTTP_HX_REQUEST="true").content.decode()
        first = Credential.objects.get(client=app, name="playground")
        clients.revoke_credential(Actor(user=member), first)
        # Heard by the gateway process over Redis at once, or without Redis once its cached reading ends.
        refused = wait_until(lambda: "401" in (answer := client.post("/gateway/playground/", send,
                                                                       HTTP_HX_REQUEST="true").content.decode())
                             and answer, 15, what="the revoked key refused")
        assert "api_key_revoked" in refused and "makes it a new one" in refused
        again = client.post("/gateway/playground/", send, HTTP_HX_REQUEST="true").content.decode()
    assert "200 in" in again, again
    minted = Credential.objects.filter(client=app, name="playground")
    assert minted.count() == 2 and minted.exclude(pk=first.pk).get().revoked_at is None
