"""An always-on catalog model with no ready replica — parked by the recovery ladder, or never placed —
is answered by the real gateway at once with 503 ``model_not_loaded`` and why, not 404
``model_not_found`` nor "not an on-demand model"."""

import time

import httpx
import pytest

from scheduler import recovery_service
from serving import events
from serving.models import ModelEntry

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
