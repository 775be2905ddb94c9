"""`manage.py serve_model OWNER/REPO`: from the (local) hub to a real llama-server through a real
agent, in one command, ending with an answer and its tokens per second."""

from __future__ import annotations

import io

import pytest
from django.core.management import CommandError, call_command

from serving.models import FetchJob, ModelEntry
from serving.models import Deployment
from tests.assets.hub_server import hub  # noqa: F401  (fixture)

pytestmark = [pytest.mark.llama, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def hub_repo(hub, smollm2_model):
    hub.add("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF",
            {"smollm2-135m-instruct-Q4_1.gguf": smollm2_model.read_bytes(), "README.md": b"# SmolLM2"})
    return hub


def test_serve_model_fetches_deploys_and_answers(hub_repo, agent, model_root, settings):
    settings.SERVING_MIRROR_DISK_MARGIN_BYTES = 0
    out = io.StringIO()
    call_command("serve_model", "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", "--quant", "Q4_1", "--context", "512",
                 "--here", stdout=out)
    printed = out.getvalue()
    for step in ("resolve", "fetch", "check", "catalog", "deploy", "wait", "smoke"):
        assert f"ok {step}" in printed, printed
    assert "tokens/s" in printed and "smollm2-135m-instruct is served." in printed
    job = FetchJob.objects.get(kind="serve")
    assert job.result["tokens_per_second"] > 0 and job.result["answer"]
    assert Deployment.objects.get(name="smollm2-135m-instruct").state == "ready"
    assert ModelEntry.objects.get(name="smollm2-135m-instruct").files.get().verified


def test_serve_model_on_demand_stops_at_the_catalog(hub_repo, model_root, settings, db):
    settings.SERVING_MIRROR_DISK_MARGIN_BYTES = 0
    out = io.StringIO()
    call_command("serve_model", "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", "--quant", "Q4_1", "--on-demand",
                 "--here", stdout=out)
    assert "-- deploy" in out.getvalue() and not Deployment.objects.exists()
    assert ModelEntry.objects.get().scaling_min == 0


def test_serve_model_names_the_reason_it_stops(hub_repo, model_root, db):
    with pytest.raises(CommandError) as stopped:
        call_command("serve_model", "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", "--quant", "Q9_X", "--here",
                     stdout=io.StringIO())
    assert "No Q9_X file" in str(stopped.value)
