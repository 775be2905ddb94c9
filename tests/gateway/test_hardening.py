"""What a security review found at the gateway's edge: request bodies of the wrong shape, token
counts out of range and a model's own cap on them, model names echoed back unbounded, revocations
that took the cache's lifetime to arrive, and a playground that named other tenants' splits."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import httpx
import pytest

from gateway import auth as gateway_auth
from gateway.models import ModelSplit
from serving import events
from serving.control import routing
from serving.models import ModelEntry
from tenancy.errors import ApiKeyRevoked
from tenancy.services import clients
from tests.assets.llama_server import free_port
from tests.assets.waiting import wait_until
from tests.gateway.conftest import GatewayProcess

pytestmark = [pytest.mark.django_db(transaction=True)]

PROFILE = {"name": "cpu", "engine": "llamacpp", "file": "/models/x.gguf", "context": 2048}


def post(gateway, path, key, **body):
    return httpx.post(f"{gateway.base_url}{path}", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                      json=body)


def error_of(response, status):
    assert response.status_code == status, response.text
    return response.json()["error"]


@pytest.fixture
def unreachable(deploy):
    """``unreachable(name, **deploy_options)``: a model whose one replica nobody listens on — a
    request that reaches for the engine is a 502, one refused before it is not."""

    def make(name, **options):
        return deploy(name, replica_id=str(uuid.uuid4()), port=free_port(), **options)

    return make


def catalog_entry(name, **fields):
    fields = {"task": "chat", "profiles": [PROFILE], **fields}
    return ModelEntry.objects.create(name=name, source_kind="local", source_path="/models/x.gguf", format="gguf",
                                     **fields)


# --- 1. the body's shape ------------------------------------------------------------------------------

CHAT_SHAPES = [
    ({"messages": [{"role": 5, "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": None, "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": ["user"], "content": "hi"}]}, "messages[0].role"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [5]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "stream"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream_options": "x"}, "stream_options"),
]


@pytest.mark.parametrize("body,param", CHAT_SHAPES)
def test_a_chat_body_of_the_wrong_shape_is_400_naming_the_field_before_the_engine(gateway, unreachable, make_key,
                                                                                   body, param):
    unreachable("shapes")
    error = error_of(post(gateway, "/v1/chat/completions", make_key().key, model="shapes", **body), 400)
    assert error["code"] == "invalid_request" and error["param"] == param and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": [{"text": "a"}]}, "prompt"),
    ("/v1/embeddings", {"input": {"text": "a"}}, "input"),
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/rerank", {"query": 5, "documents": ["a"]}, "query"),
    ("/v1/rerank", {"query": "q", "documents": "a"}, "documents"),
])
def test_other_endpoints_refuse_the_wrong_shape_too(gateway, unreachable, make_key, path, body, param):
    unreachable("shapes-too")
    error = error_of(post(gateway, path, make_key().key, model="shapes-too", **body), 400)
    assert error["code"] == "invalid_request" and error["param"] == param


@pytest.mark.llama
def test_a_role_that_is_not_a_string_is_400_not_the_engines_502(gateway, chat_engine, deploy, make_key):
    deploy("smollm2", chat_engine)
    key = make_key().key
    error = error_of(post(gateway, "/v1/chat/completions", key, model="smollm2", max_tokens=2,
                          messages=[{"role": 5, "content": "hi"}]), 400)
    assert error["code"] == "invalid_request" and error["param"] == "messages[0].role"
    fine = post(gateway, "/v1/chat/completions", key, model="smollm2", max_tokens=2,
                messages=[{"role": "user", "content": "hi"}])
    assert fine.status_code == 200, fine.text


# --- 2. how many tokens a request may ask for --------------------------------------------------------------

@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", "n_predict"])
@pytest.mark.parametrize("value", [-1, 0, True, False, 1.5, "5", [5], {"n": 5}])
def test_a_token_count_is_a_whole_number_of_at_least_one(gateway, unreachable, make_key, field, value):
    unreachable("counted")
    error = error_of(post(gateway, "/v1/chat/completions", make_key().key, model="counted",
                          messages=[{"role": "user", "content": "hi"}], **{field: value}), 400)
    assert error["code"] == "invalid_request" and error["param"] == field


@pytest.mark.parametrize("value", [0, -3, True, 129, 2.0])
def test_n_is_a_whole_number_from_1_to_128(gateway, unreachable, make_key, value):
    unreachable("counted-n")
    error = error_of(post(gateway, "/v1/completions", make_key().key, model="counted-n", prompt="a", n=value), 400)
    assert error["code"] == "invalid_request" and error["param"] == "n"


@pytest.mark.parametrize("value", [10**9, 2**63, 2049])
def test_without_a_cap_the_context_bounds_the_output(gateway, unreachable, make_key, value):
    made = unreachable("bounded")
    made.deployment.config = {"context": 2048}
    made.deployment.save(update_fields=["config"])
    events.routing_changed()
    key = make_key().key
    error = error_of(post(gateway, "/v1/completions", key, model="bounded", prompt="a", max_tokens=value), 400)
    assert error["code"] == "max_tokens_above_context" and error["param"] == "max_tokens"
    assert "2048" in error["message"] and error["details"]["context"] == 2048
    # Within the context the request goes on to the engine (here nobody listens: 502).
    assert post(gateway, "/v1/completions", key, model="bounded", prompt="a", max_tokens=2048).status_code == 502


def test_a_catalog_cap_refuses_more_and_names_the_cap(gateway, unreachable, make_key):
    catalog_entry("capped", max_output_tokens=5)
    unreachable("capped")
    key = make_key().key
    for field in ("max_tokens", "max_completion_tokens", "n_predict"):
        error = error_of(post(gateway, "/v1/chat/completions", key, model="capped", **{field: 6},
                              messages=[{"role": "user", "content": "hi"}]), 400)
        assert error["code"] == "max_tokens_above_cap" and error["param"] == field
        assert "cap of 5 output tokens" in error["message"] and error["details"]["max_output_tokens"] == 5
    assert post(gateway, "/v1/chat/completions", key, model="capped", max_tokens=5,
                messages=[{"role": "user", "content": "hi"}]).status_code == 502  # allowed: on to the engine


def test_the_routing_table_carries_the_cap_and_the_context(node, deploy):
    catalog_entry("on-demand-capped", max_output_tokens=64)
    catalog_entry("vllm-someday", profiles=[{"name": "gpu", "engine": "vllm", "file": "/m", "context": None}])
    made = deploy("running", state="ready")
    made.deployment.config = {"context": 8192}
    made.deployment.save(update_fields=["config"])
    table = routing.load_table()
    assert table.route("on-demand-capped").max_output_tokens == 64
    assert table.route("on-demand-capped").context == 2048  # its profile's, before anything runs
    assert table.route("running").context == 8192 and table.route("running").max_output_tokens is None
    assert table.route("vllm-someday").context is None  # vLLM's default is the model's own: not known here


@pytest.mark.llama
def test_a_request_naming_no_limit_gets_the_models_cap(gateway, tiny_engine, deploy, make_key):
    catalog_entry("tiny-capped", task="completion", max_output_tokens=3)
    deploy("tiny-capped", tiny_engine, task="completion")
    answer = post(gateway, "/v1/completions", make_key().key, model="tiny-capped", prompt="Once upon a time",
                  ignore_eos=True)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 3


def test_the_cap_is_set_through_the_catalog_api_and_shown_on_the_card(client, admin_user, held):
    client.force_login(admin_user)
    url = f"/api/serving/catalog/models/{held.public_id}/"
    assert client.get(url).json()["max_output_tokens"] is None
    changed = client.patch(url, {"max_output_tokens": 512}, content_type="application/json")
    assert changed.status_code == 200, changed.content
    assert changed.json()["max_output_tokens"] == 512
    held.refresh_from_db()
    assert held.max_output_tokens == 512
    page = client.get(f"/models/held/{held.public_id}/").content.decode()
    assert 'name="max_output_tokens" min="1" value="512"' in page
    for wrong in (0, -1, True, "many", 2**40):
        refused = client.patch(url, {"max_output_tokens": wrong}, content_type="application/json")
        assert refused.status_code == 400, (wrong, refused.content)
    held.refresh_from_db()
    assert held.max_output_tokens == 512
    cleared = client.patch(url, {"max_output_tokens": None}, content_type="application/json")
    assert cleared.status_code == 200 and cleared.json()["max_output_tokens"] is None
    saved = client.post(f"/models/held/{held.public_id}/", {"scaling_min": "0", "scaling_max": "1",
                                                            "max_output_tokens": "256"}, follow=True)
    assert b"at most 256 output tokens a request" in saved.content
    refused = client.post(f"/models/held/{held.public_id}/", {"max_output_tokens": "0"})
    assert refused.status_code == 400 and b'data-field="max_output_tokens"' in refused.content


def test_a_cap_set_through_the_api_reaches_the_gateway(gateway, client, admin_user, held, unreachable, make_key):
    unreachable(held.name)
    key = make_key().key

    def ask(tokens):
        return post(gateway, "/v1/completions", key, model=held.name, prompt="a", max_tokens=tokens)

    assert ask(7).status_code == 502  # no cap: on to the engine (nobody listens)
    client.force_login(admin_user)
    assert client.patch(f"/api/serving/catalog/models/{held.public_id}/", {"max_output_tokens": 6},
                        content_type="application/json").status_code == 200
    refused = wait_until(lambda: (answer := ask(7)).status_code == 400 and answer, 5, what="the cap applied")
    assert refused.json()["error"]["code"] == "max_tokens_above_cap"
    assert ask(6).status_code == 502


@pytest.fixture
def held(mirror_root, tiny_model):
    from serving.catalog import entries
    from tenancy.audit import Actor

    return entries.import_local(Actor(system="tests"), tiny_model, name="tiny-held")


@pytest.fixture
def mirror_root(tmp_path, settings):
    root = tmp_path / "models"
    root.mkdir()
    settings.SCHEDULER_MODEL_ROOTS = [root.resolve()]
    return root.resolve()


# --- 3. a model name is echoed bounded --------------------------------------------------------------------

def test_a_huge_model_name_is_echoed_as_a_short_prefix(gateway, make_key, tree):
    huge = "m" * 300_000
    key = make_key().key
    answer = post(gateway, "/v1/completions", key, model=huge, prompt="a")
    error = error_of(answer, 404)
    assert error["code"] == "model_not_found" and len(answer.content) < 1000
    assert error["details"]["model"] == "m" * 100 + "…" and "m" * 101 not in error["message"]
    narrow = make_key(all_models=False, allowed_models=["other"]).key
    refused = post(gateway, "/v1/completions", narrow, model=huge, prompt="a")
    assert error_of(refused, 403)["details"]["model"] == "m" * 100 + "…" and len(refused.content) < 1000
    ModelSplit.objects.create(model_name=huge[:200], scope=tree.project, variants=[], environments=["staging"])
    events.routing_changed()
    # The change message reaches the gateway a moment later (a table read just now is kept): ask until
    # it answers with the split's refusal.
    def refused_by_the_split():
        answer = post(gateway, "/v1/completions", key, model=huge[:200], prompt="a")
        return answer if answer.status_code == 403 else None

    split_refusal = wait_until(refused_by_the_split, 30, what="the split seen by the gateway")
    assert error_of(split_refusal, 403)["code"] == "environment_not_allowed"
    assert "m" * 101 not in split_refusal.text


# --- 4. revocation, at once -------------------------------------------------------------------------------

def models_status(gateway, key: str) -> int:
    """/v1/models answers 200 to a working key and refuses a revoked one: the key check alone, no engine."""
    return httpx.get(f"{gateway.base_url}/v1/models", headers={"Authorization": f"Bearer {key}"},
                     timeout=30).status_code


class Hammer:
    """Requests with one key from a few threads until stopped; each outcome with when it was sent."""

    def __init__(self, gateway, key: str, threads: int = 6):
        self.gateway, self.key = gateway, key
        self.outcomes: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run) for _ in range(threads)]

    def _run(self):
        with httpx.Client(base_url=self.gateway.base_url, timeout=30,
                          headers={"Authorization": f"Bearer {self.key}"}) as http:
            while not self._stop.is_set():
                sent = time.monotonic()
                self.outcomes.append((sent, http.get("/v1/models").status_code))

    def __enter__(self):
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for thread in self._threads:
            thread.join(30)

    def sent_after(self, moment: float) -> list[int]:
        return [status for sent, status in self.outcomes if sent > moment]


def assert_refused_at_once(gateway, key: str, change, refused: int = 401) -> None:
    """While requests with ``key`` flow, ``change()``: none sent after it returned succeeds, neither
    from the flow nor from 20 sent together right after."""
    assert models_status(gateway, key) == 200  # now cached by the gateway (30 s in these tests)
    with Hammer(gateway, key) as hammer:
        wait_until(lambda: len(hammer.outcomes) > 20, 30, interval=0.01, what="requests flowing")
        change()
        done = time.monotonic()
        with ThreadPoolExecutor(20) as pool:
            burst = list(pool.map(lambda _: models_status(gateway, key), range(20)))
        wait_until(lambda: len(hammer.sent_after(done)) > 50, 30, interval=0.01, what="requests after the change")
    assert burst == [refused] * 20
    after = hammer.sent_after(done)
    assert set(after) == {refused}, f"{after.count(200)} of {len(after)} requests after the change succeeded"
    assert 200 in [status for sent, status in hammer.outcomes if sent <= done]  # it did work before


def test_a_revoked_key_is_refused_at_once_while_requests_flow(gateway, make_key, tree):
    caller = make_key()
    assert_refused_at_once(gateway, caller.key, lambda: clients.revoke_credential(tree.actor, caller.credential))


def test_deleting_the_client_refuses_its_keys_at_once(gateway, make_key, tree):
    caller = make_key()
    assert_refused_at_once(gateway, caller.key, lambda: clients.delete_client(tree.actor, caller.client))


def test_disabling_the_client_refuses_its_keys_at_once(gateway, make_key, tree):
    caller = make_key()
    assert_refused_at_once(gateway, caller.key,
                           lambda: clients.update_client(tree.actor, caller.client, is_active=False), refused=403)


def test_a_key_rotated_without_overlap_is_refused_at_once(gateway, make_key, tree):
    caller = make_key()
    assert_refused_at_once(gateway, caller.key,
                           lambda: clients.rotate_credential(tree.actor, caller.credential, overlap=timedelta(0)))


@pytest.fixture(scope="module")
def embedded_gateway(django_db_setup, django_db_blocker, artifacts_dir):
    """A gateway process without Redis (the embedded mode): it hears of nothing another process does."""
    with django_db_blocker.unblock():
        process = GatewayProcess(artifacts_dir / "gateway-embedded.log", environ={"REDIS_URL": ""})
    yield process
    process.stop()


def test_without_redis_a_key_revoked_through_the_same_process_is_refused_at_once(embedded_gateway, make_key):
    caller, manager = make_key(), make_key(access="management")

    def revoke():
        answer = httpx.post(f"{embedded_gateway.base_url}/api/tenancy/credentials/{caller.credential.public_id}"
                            f"/revoke/", headers={"Authorization": f"Bearer {manager.key}"}, timeout=30)
        assert answer.status_code == 200, answer.text

    assert_refused_at_once(embedded_gateway, caller.key, revoke)


@dataclasses.dataclass
class _Loaded:
    lookup: str


def test_a_request_after_a_revocation_never_joins_a_load_begun_before_it(monkeypatch):
    """The first use of a key is read while it is revoked: that read serves only the requests that
    were already waiting for it, and is not kept."""
    revoked = threading.Event()
    reads, release = [], {}

    async def run_db(fn, plaintext):
        reads.append(plaintext)
        if revoked.is_set():
            raise ApiKeyRevoked("This API key was revoked.")
        await release["read"].wait()
        return _Loaded(lookup="abc"), None

    monkeypatch.setattr(gateway_auth, "run_db", run_db)

    async def scenario():
        cache = gateway_auth.AuthCache(30)
        release["read"] = asyncio.Event()
        before = asyncio.create_task(cache.principal("brk_abc_secret"))
        while not reads:  # the first read is under way
            await asyncio.sleep(0)
        revoked.set()
        cache.drop_lookup("abc")  # the revocation message arrives while the first read runs
        after = asyncio.create_task(cache.principal("brk_abc_secret"))
        await asyncio.sleep(0)
        release["read"].set()
        assert (await before).lookup == "abc"  # it was in flight before the revocation
        with pytest.raises(ApiKeyRevoked):
            await after
        with pytest.raises(ApiKeyRevoked):  # and the first read was not kept
            await cache.principal("brk_abc_secret")

    asyncio.run(scenario())
    assert len(reads) == 2  # the second is the refusal, kept from then on


def test_a_load_begun_before_the_cache_is_cleared_is_not_kept(monkeypatch):
    """Clearing (a lost subscription: revocations may have been missed) discards loads under way."""
    calls, gate = [], {}

    async def run_db(fn, plaintext):
        calls.append(plaintext)
        if len(calls) == 1:
            await gate["read"].wait()
        return _Loaded(lookup="abc"), None

    monkeypatch.setattr(gateway_auth, "run_db", run_db)

    async def scenario():
        gate["read"] = asyncio.Event()
        cache = gateway_auth.AuthCache(30)
        first = asyncio.create_task(cache.principal("brk_abc_secret"))
        while not calls:
            await asyncio.sleep(0)
        cache.clear()
        gate["read"].set()
        await first
        await cache.principal("brk_abc_secret")

    asyncio.run(scenario())
    assert len(calls) == 2


# --- 5. the playground lists what the caller's clients may call -------------------------------------------

def test_the_playground_never_names_another_tenants_split(client, personas):
    from tenancy.audit import Actor

    catalog_entry("shared-base")
    ModelSplit.objects.create(model_name="acme-secret-canary", scope=personas.acme.project,
                              variants=[{"model": "shared-base", "weight": 1}])
    actor = Actor(system="tests")
    clients.create_client(actor, personas.acme.project, "acme-app", all_models=True)
    clients.create_client(actor, personas.globex.project, "globex-app", all_models=True)
    client.force_login(personas.oscar)
    page = client.get("/gateway/playground/").content.decode()
    assert "globex-app" in page and "shared-base" in page
    assert "acme-secret-canary" not in page
    client.force_login(personas.max)
    assert "acme-secret-canary" in client.get("/gateway/playground/").content.decode()
