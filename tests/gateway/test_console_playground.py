"""The console's charts (inline SVG, one aggregate query each, filtered by scope) and the playground
(a request sent through a real gateway process as one of the caller's clients, key never shown)."""

from datetime import timedelta

import pytest
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.db import connection
from django.utils import timezone

from gateway import services
from gateway.models import UsageRecord
from tenancy.models import Credential, Membership, Role
from tests.gateway.usage import record_of


@pytest.fixture
def member(django_user_model, tree):
    user = django_user_model.objects.create_user("pia", "pia@example.org", "a-long-test-password")
    Membership.objects.create(user=user, scope=tree.team, role=Role.MEMBER)
    return user


def usage(path, model, days_ago, total_ms, tokens=(3, 4)):
    started = timezone.now() - timedelta(days=days_ago)
    return UsageRecord.objects.create(request_id=f"r-{model}-{days_ago}-{total_ms}", started_at=started,
                                      finished_at=started, endpoint="chat/completions", model_asked=model,
                                      model_served=model, status=200, total_ms=total_ms, prompt_tokens=tokens[0],
                                      completion_tokens=tokens[1], scope_path=path)


@pytest.mark.django_db
def test_charts_are_inline_svg_from_one_query_each_and_follow_the_scope(client, member, tree):
    for n in range(10):
        usage(tree.project.path, "alpha", n % 3, 10.0 * (n + 1))
    usage(tree.team.path + "/other", "beta", 0, 500.0)
    usage("elsewhere/x/y", "gamma", 0, 900.0)
    visible = services.visible_usage(member)
    with CaptureQueriesContext(connection) as queries:
        daily = services.per_day(visible)
    assert len(queries) == 1 and sum(row["requests"] for row in daily) == 11
    with CaptureQueriesContext(connection) as queries:
        latency = {row["model_served"]: row for row in services.latency_by_model(visible)}
    assert len(queries) == 1 and set(latency) == {"alpha", "beta"}
    assert latency["alpha"]["p50"] == pytest.approx(55.0) and latency["alpha"]["requests"] == 10
    assert latency["alpha"]["p99"] == pytest.approx(99.1)

    client.force_login(member)
    page = client.get("/gateway/").content.decode()
    assert page.count("<svg") == 3 and "Latency percentiles per model" in page and "<script" not in page.split(
        "<h1>")[1]
    assert "gamma" not in page
    narrowed = client.get("/gateway/", {"scope": tree.project.path}).content.decode()
    svg = narrowed[narrowed.index("<svg"):narrowed.rindex("</svg>")]
    assert "alpha" in svg and "beta" not in svg


@pytest.mark.django_db
def test_console_split_form_saves_and_refuses_with_a_message(client, tree, django_user_model):
    from serving.models import ModelEntry

    admin = django_user_model.objects.create_user("ari", "ari@example.org", "a-long-test-password")
    Membership.objects.create(user=admin, scope=tree.project, role=Role.ADMIN)
    for name in ("v1", "v2"):
        ModelEntry.objects.create(name=name, task="chat", source_kind="local", format="gguf")
    client.force_login(admin)
    saved = client.post("/gateway/splits/", {"model_name": "chatty", "scope": tree.project.path,
                                             "variants": "v1:3, v2:1", "environments": ["staging", "development"]},
                        follow=True)
    assert "Split saved" in saved.content.decode()
    split = services.visible_splits(admin).get()
    assert split.variants == [{"model": "v1", "weight": 3}, {"model": "v2", "weight": 1}]
    assert split.environments == ["staging", "development"]
    page = client.get("/gateway/").content.decode()
    assert "v1 (3), v2 (1)" in page
    refused = client.post("/gateway/splits/", {"model_name": "chatty2", "scope": "", "variants": "v1:1"}, follow=True)
    assert "Only staff" in refused.content.decode()
    client.post(f"/gateway/splits/{split.public_id}/delete/")
    assert not services.visible_splits(admin).exists()


@pytest.mark.llama
@pytest.mark.django_db(transaction=True)
def test_playground_sends_chat_and_embedding_as_a_chosen_client(client, member, gateway, deploy, make_key,
                                                                 chat_engine, embedding_engine, tree, caplog):
    deploy("play-chat", chat_engine)
    deploy("play-embed", embedding_engine, task="embedding")
    app = make_key(environment="staging").client  # a client of the team the caller is a member of
    client.force_login(member)
    page = client.get("/gateway/playground/").content.decode()
    assert str(app.public_id) in page and "play-chat" in page
    with override_settings(GATEWAY_INTERNAL_URL=gateway.base_url):
        answer = client.post("/gateway/playground/", {"client": str(app.public_id), "model": "play-chat",
                                                      "kind": "chat", "text": "Say hi."}, HTTP_HX_REQUEST="true")
        text = answer.content.decode()
        assert answer.status_code == 200 and "200 in" in text and "completion" in text, text
        assert "<html" not in text  # the HTMX fragment alone
        embedded = client.post("/gateway/playground/", {"client": str(app.public_id), "model": "play-embed",
                                                        "kind": "embedding", "text": "hello"},
                               HTTP_HX_REQUEST="true").content.decode()
        assert "dimensions" in embedded, embedded
        unknown = client.post("/gateway/playground/", {"client": str(app.public_id), "model": "nope",
                                                       "kind": "chat", "text": "x"}, HTTP_HX_REQUEST="true")
        assert "model_not_found" in unknown.content.decode()
    minted = Credential.objects.filter(client=app, name="playground")
    assert minted.count() == 1  # reused from the session for the next requests
    key = client.session["gateway_playground_keys"][str(app.public_id)][0]
    assert minted.get().expires_at - timezone.now() <= timedelta(minutes=10)
    assert key not in text and key not in embedded and key not in caplog.text
    assert key not in gateway.log()
    request_id = text.split("request_id=")[1].split('"')[0]
    record = record_of(request_id)
    assert record.client_id == app.pk and record.model_served == "play-chat"


@pytest.mark.django_db
def test_playground_refuses_a_client_the_caller_may_not_use(client, member, tree, django_user_model):
    from tenancy.audit import Actor
    from tenancy.services import clients
    from tenancy.services.tree import create_scope

    other_org = create_scope(Actor(system="tests"), "org", tree.org.slug + "x", "Other")
    other_team = create_scope(Actor(system="tests"), "team", "t", "T", other_org)
    other_project = create_scope(Actor(system="tests"), "project", "p", "P", other_team)
    foreign = clients.create_client(Actor(system="tests"), other_project, "foreign", all_models=True)
    client.force_login(member)
    answer = client.post("/gateway/playground/", {"client": str(foreign.public_id), "model": "m", "kind": "chat",
                                                  "text": "x"}, HTTP_HX_REQUEST="true").content.decode()
    assert "Choose one of your service clients" in answer
    assert not Credential.objects.filter(client=foreign).exists()
