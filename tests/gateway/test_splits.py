"""Canary/experiment splits: by weight, sticky per client, managed through the API; and the
environments a split allows."""

import httpx
import pytest

from gateway.models import ModelSplit
from gateway.splits import Split
from serving.models import ModelEntry
from tenancy.models import Membership, Role
from tests.gateway.usage import record_of


@pytest.fixture
def admin_of_team(django_user_model, tree):
    user = django_user_model.objects.create_user("ada", "ada@example.org", "a-long-test-password")
    Membership.objects.create(user=user, scope=tree.team, role=Role.ADMIN)
    return user


@pytest.fixture
def member_of_team(django_user_model, tree):
    user = django_user_model.objects.create_user("mo", "mo@example.org", "a-long-test-password")
    Membership.objects.create(user=user, scope=tree.team, role=Role.MEMBER)
    return user


@pytest.fixture
def staff(django_user_model):
    return django_user_model.objects.create_user("sam", "sam@example.org", "a-long-test-password", is_staff=True)


def entry(name):
    return ModelEntry.objects.create(name=name, task="completion", source_kind="local", format="gguf", scaling_min=1)


@pytest.mark.django_db
def test_split_api_validates_and_checks_who_may_manage(client, tree, admin_of_team, member_of_team, staff):
    entry("cat-a")
    entry("cat-b")
    url = "/api/gateway/splits/"
    good = {"model_name": "cat", "scope": tree.team.path, "variants": [{"model": "cat-a", "weight": 90},
                                                                       {"model": "cat-b", "weight": 10}]}
    client.force_login(member_of_team)
    assert client.post(url, good, content_type="application/json").status_code == 403
    client.force_login(admin_of_team)
    assert client.post(url, {**good, "scope": None}, content_type="application/json").status_code == 403
    for bad, field in [({"variants": [{"model": "cat-a", "weight": 0}]}, "weight"),
                       ({"variants": [{"model": "cat", "weight": 1}]}, "itself"),
                       ({"variants": [{"model": "nope", "weight": 1}]}, "No model"),
                       ({"variants": [], "environments": []}, "needs variants"),
                       ({"environments": ["prod"]}, "")]:
        answer = client.post(url, {**good, **bad}, content_type="application/json")
        assert answer.status_code == 400, (bad, answer.content)
        assert field in answer.content.decode()
    made = client.post(url, good, content_type="application/json")
    assert made.status_code == 201, made.content
    split = made.json()
    assert split["scope"] == tree.team.path and split["variants"][1] == {"model": "cat-b", "weight": 10}
    assert client.post(url, good, content_type="application/json").status_code == 400  # one per model and scope
    changed = client.patch(f"{url}{split['id']}/", {"environments": ["staging"]}, content_type="application/json")
    assert changed.status_code == 200 and changed.json()["environments"] == ["staging"]
    assert ModelSplit.objects.get().environments == ["staging"]
    client.force_login(member_of_team)
    assert [s["id"] for s in client.get(url).json()["results"]] == [split["id"]]  # visible, not changeable
    assert client.delete(f"{url}{split['id']}/").status_code == 403
    client.force_login(staff)
    fleet = client.post(url, {**good, "model_name": "cat2", "scope": None}, content_type="application/json")
    assert fleet.status_code == 201 and fleet.json()["scope"] is None
    assert client.delete(f"{url}{split['id']}/").status_code == 204


def test_sticky_choice_follows_the_weights():
    split = Split("m", "", ("a", "b"), (90, 100), frozenset())
    clients = [f"client-{n}" for n in range(2000)]
    chosen = [split.choose(c) for c in clients]
    assert chosen == [split.choose(c) for c in clients]  # stable
    share = chosen.count("b") / len(chosen)
    assert 0.07 < share < 0.13
    assert Split("m", "", (), (), frozenset()).choose("x") == "m"


@pytest.mark.llama
@pytest.mark.django_db(transaction=True)
def test_a_client_always_sees_one_variant_and_usage_keeps_both_names(gateway, deploy, make_key, tiny_engine,
                                                                     chat_engine, client, staff, tree):
    deploy("exp-a", tiny_engine, task="completion")
    deploy("exp-b", chat_engine, task="completion")
    client.force_login(staff)
    made = client.post("/api/gateway/splits/", {"model_name": "experiment", "scope": tree.project.path,
                                                "variants": [{"model": "exp-a", "weight": 1},
                                                             {"model": "exp-b", "weight": 1}]},
                       content_type="application/json")
    assert made.status_code == 201, made.content
    rule = Split("experiment", tree.project.path, ("exp-a", "exp-b"), (1, 2), frozenset())
    keys, seen = [], set()
    while len(seen) < 2 and len(keys) < 24:  # clients until both variants are expected
        made_key = make_key()
        keys.append(made_key)
        seen.add(rule.choose(str(made_key.client.public_id)))
    assert seen == {"exp-a", "exp-b"}
    for n, made_key in enumerate(keys):
        expected = rule.choose(str(made_key.client.public_id))
        for attempt in range(2):
            request_id = f"split-{n}-{attempt}"
            answer = httpx.post(f"{gateway.base_url}/v1/completions", timeout=120,
                                headers={"Authorization": f"Bearer {made_key.key}", "X-Request-Id": request_id},
                                json={"model": "experiment", "prompt": "hi", "max_tokens": 1})
            assert answer.status_code == 200, answer.text
            record = record_of(request_id)
            assert (record.model_asked, record.model_served) == ("experiment", expected)
    listed = {m.id for m in gateway.openai(keys[0].key).models.list().data}
    assert "experiment" in listed


@pytest.mark.llama
@pytest.mark.django_db(transaction=True)
def test_a_split_limited_to_environments_refuses_other_clients(gateway, deploy, make_key, tiny_engine, tree):
    from gateway import services
    from tenancy.audit import Actor

    deploy("env-only", tiny_engine, task="completion")
    services.save_split(Actor(system="tests"), None, model_name="env-only", scope=tree.org, variants=[],
                        environments=["staging"])
    staging, development = make_key(environment="staging"), make_key(environment="development")
    body = {"model": "env-only", "prompt": "hi", "max_tokens": 1}

    def ask(key):
        return httpx.post(f"{gateway.base_url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                          json=body, timeout=120)

    refused = ask(development.key)
    assert refused.status_code == 403, refused.text
    assert refused.json()["error"]["code"] == "environment_not_allowed"
    assert ask(staging.key).status_code == 200
    assert "env-only" not in {m.id for m in gateway.openai(development.key).models.list().data}
    assert "env-only" in {m.id for m in gateway.openai(staging.key).models.list().data}
