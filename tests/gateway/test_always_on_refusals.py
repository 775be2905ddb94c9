"""An always-on catalog model with no ready replica — parked by the recovery ladder, or never placed —
is answered by the real gateway at once with 503 ``model_not_loaded`` and why, not 404
``model_not_found`` nor "not an on-demand model". One the reconcile loop is bringing back (placed
before, its replica since failed) is waited for in the admission queue like an on-demand load:
served once a replica is ready, else 503 ``model_loading`` with ``Retry-After`` and why."""

import threading
import time

import httpx
import pytest

from scheduler import recovery_service
from scheduler.models import PlacementDecision
from serving import events
from serving.models import ModelEntry
from tests.assets.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def always_on(name, **fields):
    made = ModelEntry.objects.create(name=name, task="completion", source_kind="local", format="gguf",
                                     scaling_min=1, fingerprint="fp-1", **fields)
    events.routing_changed()
    return made


def ask(gateway, key, model):
    started = time.monotonic()
    answer = httpx.post(f"{gateway.base_url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                        timeout=30, json={"model": model, "prompt": "a", "max_tokens": 1})
    return answer, time.monotonic() - started


def test_a_parked_always_on_model_answers_503_naming_its_park_reason(gateway, deploy, make_key):
    always_on("parked-always")
    deploy("parked-always", state="failed")  # what its failed launches left behind
    for _ in range(5):
        recovery_service.note_failure("parked-always", "crash", "engine exited with status 1 while loading", "fp-1")
    answer, took = ask(gateway, make_key().key, "parked-always")
    assert took < 5 and answer.status_code == 503 and "retry-after" not in answer.headers
    error = answer.json()["error"]
    assert error["code"] == "model_not_loaded"
    assert "parked after 5 failure(s) in a row: engine exited with status 1 while loading" in error["message"]
    assert "not an on-demand model" not in error["message"]
    details = error["details"]
    assert details["model"] == "parked-always" and details["parked"] is True and details["failure"] == "crash"
    assert details["last_error"] == "engine exited with status 1 while loading"
    assert "parked after 5 failure(s)" in details["reason"]


def test_an_always_on_model_never_placed_answers_503_with_why_not_404(gateway, make_key):
    always_on("never-placed-always")  # no deployment at all, and no servable file to place
    answer, took = ask(gateway, make_key().key, "never-placed-always")
    assert took < 5 and answer.status_code == 503, answer.text
    error = answer.json()["error"]
    assert error["code"] == "model_not_loaded" and "always on" in error["message"]
    assert error["details"]["reason"] == "it has no verified, servable file with an estimate: nothing can place it"
    unknown, _ = ask(gateway, make_key().key, "no-such-model-at-all")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


# --- an always-on model being brought back ----------------------------------------------------------

def coming_back(name, deploy):
    """An always-on model the placement policy placed, whose replica has since failed: the next
    reconcile pass relaunches it (its profile's size is given, so it is servable without a file)."""
    always_on(name, profiles=[{"name": "cpu", "engine": "llamacpp", "memory_bytes": 2**20}])
    PlacementDecision.objects.create(model=name, verdict=PlacementDecision.Verdict.PLACED, inputs_digest="d",
                                     fingerprint="f", detail="placed on gw-node")
    deploy(name, task="completion", state="failed")  # the deployment its failed replica left


def waiting(gateway, model):
    """Requests the gateway holds in its admission queue for ``model`` now (its Prometheus gauge)."""
    text = httpx.get(f"{gateway.base_url}/metrics", timeout=5).text
    line = next((l for l in text.splitlines() if l.startswith(f'berth_gateway_waiting{{model="{model}"}}')), "")
    return float(line.split()[-1]) if line else 0.0


def test_an_always_on_model_coming_back_is_waited_for_then_503_model_loading_with_retry_after(gateway_b, deploy,
                                                                                              make_key):
    coming_back("back-later", deploy)
    answer, took = ask(gateway_b, make_key().key, "back-later")  # gateway_b waits 2 s at most
    assert answer.status_code == 503 and took >= 2, answer.text
    error = answer.json()["error"]
    assert error["code"] == "model_loading" and "will not be" not in error["message"]
    assert error["details"]["reason"] == "its replica ended; the reconcile loop relaunches it"
    assert "coming back" in error["message"]
    # The next pass (15 s) plus its load (no past load known: BERTH_GATEWAY_EXPECTED_LOAD_SECONDS, 60 s),
    # less the 2 s it waited.
    retry = int(answer.headers["retry-after"])
    assert 60 <= retry <= 75 and error["details"]["expected_seconds"] == retry


def test_an_always_on_model_backing_off_says_so_and_when_to_retry(gateway_b, deploy, make_key):
    coming_back("backing-off", deploy)
    for _ in range(3):  # the third crash in a row: relaunched 40 s after it (10 s doubled twice)
        recovery_service.note_failure("backing-off", "crash", "engine exited with status 1 while loading", "fp-1")
    answer, _ = ask(gateway_b, make_key().key, "backing-off")
    error = answer.json()["error"]
    assert answer.status_code == 503 and error["code"] == "model_loading", answer.text
    assert "backoff" in error["details"]["reason"]
    assert 90 <= int(answer.headers["retry-after"]) <= 100  # 40 s of backoff left, then 60 s to load, less 2 s


def test_a_request_for_an_always_on_model_coming_back_is_served_once_its_replica_is_ready(gateway, tiny_engine,
                                                                                           deploy, make_key):
    coming_back("back-soon", deploy)
    key = make_key().key
    answers = []
    asking = threading.Thread(target=lambda: answers.append(ask(gateway, key, "back-soon")[0]))
    asking.start()
    try:
        wait_until(lambda: waiting(gateway, "back-soon") == 1, 20, what="the request waiting in the admission queue")
        deploy("back-soon", tiny_engine, task="completion")  # the reconcile loop relaunched it; it is ready
    finally:
        asking.join(60)
    assert answers and answers[0].status_code == 200, answers and answers[0].text
