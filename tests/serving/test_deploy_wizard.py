"""The deploy wizard starts from what the mirror holds: a held model and its profile fill it in,
each engine's settings are its declared options, a GPU is chosen on the node, and a caller sees and
deploys only the models within their reach."""

from __future__ import annotations

import re

import pytest

from scheduler.models import Accelerator
from scheduler.services import NodeReport, register_node
from serving import queues
from serving.catalog import entries
from serving.models import Deployment
from serving.views import engine_settings
from serving.views.forms import DeployForm
from tenancy.audit import Actor
from tests.assets.hub_server import mirror_root  # noqa: F401  (a fixture)

pytestmark = pytest.mark.django_db


@pytest.fixture
def no_agent(monkeypatch):
    sent = []
    monkeypatch.setattr(queues, "to_node", lambda operation, replica: sent.append((operation, replica.public_id)))
    return sent


@pytest.fixture
def held(mirror_root, tiny_model, personas):
    """A model of acme's search project, with a profile of its own."""
    entry = entries.import_local(Actor(system="tests"), tiny_model, name="tiny-held", owner=personas.acme.project)
    entry.profiles = [{**entry.profiles[0], "name": "small", "context": 512, "parallel": 2},
                      {**entry.profiles[0], "name": "roomy", "context": 1024, "parallel": 4}]
    entry.save(update_fields=["profiles"])
    return entry


@pytest.fixture
def elsewhere(mirror_root, tiny_model, personas):
    return entries.import_local(Actor(system="tests"), tiny_model, name="globex-secret", owner=personas.globex.project)


def selected(html: str, name: str) -> str | None:
    """The value of the option chosen in the select called ``name``."""
    select = re.search(rf'<select name="{name}".*?</select>', html, re.S).group(0)
    found = re.search(r'<option value="([^"]*)"[^>]*selected', select)
    return found.group(1) if found else None


def wizard_data(html: str) -> dict[str, str]:
    """What the browser would post from the wizard as filled in: inputs' values and chosen options,
    leaving out the settings of the engine not chosen (their fieldset is disabled)."""
    form = html[html.index('<form id="deploy-form"'):html.index("</form>", html.index('<form id="deploy-form"'))]
    for hidden in re.findall(r'<fieldset data-engine="[^"]+"[^>]*disabled>.*?</fieldset>', form, re.S):
        form = form.replace(hidden, "")
    data = dict(re.findall(r'<input type="(?:text|number|hidden)" name="([^"]+)" value="([^"]*)"', form))
    for name in re.findall(r'<select name="([^"]+)"', form):
        data[name] = selected(form, name) or re.search(
            rf'<select name="{name}".*?<option value="([^"]*)"', form, re.S).group(1)
    return data


def test_held_offers_deploy_for_each_verified_model_and_the_card_too(client, personas, held):
    client.force_login(personas.max)
    page = client.get("/models/held/").content.decode()
    assert f'href="/models/deploy/?model={held.public_id}" data-action="deploy">Deploy</a>' in page
    card = client.get(f"/models/held/{held.public_id}/").content.decode()
    assert f'data-action="deploy" href="/models/deploy/?model={held.public_id}"' in card


def test_a_held_model_fills_the_wizard_in_with_its_first_profile(client, personas, held, node):
    client.force_login(personas.max)
    html = client.get("/models/deploy/", {"model": str(held.public_id)}).content.decode()
    assert selected(html, "model") == str(held.public_id) and selected(html, "profile") == "small"
    data = wizard_data(html)
    assert (data["name"], data["owner"], data["context"], data["parallel"]) == \
        ("tiny-held", "project:acme/ml/search", "512", "2")
    assert 'name="model_path"' not in html  # a typed path is for administrators
    assert re.search(r'<fieldset data-engine="llamacpp" class="engine-settings">', html)
    assert re.search(r'<fieldset data-engine="vllm" class="engine-settings" hidden disabled>', html)
    assert 'name="llamacpp_gpu_layers"' in html and 'name="vllm_dtype"' in html
    assert 'name="vllm_max_model_len"' not in html  # the common "context" field sets it
    # Another profile, as htmx asks when it is picked: its settings come in.
    other = client.get("/models/deploy/", {"model": str(held.public_id), "profile": "roomy"}).content.decode()
    assert wizard_data(other)["context"] == "1024" and selected(other, "profile") == "roomy"


def test_deploying_from_held_runs_the_catalog_model_with_the_settings_as_adjusted(
        client, personas, held, node, no_agent, django_capture_on_commit_callbacks):
    client.force_login(personas.max)
    data = wizard_data(client.get("/models/deploy/", {"model": str(held.public_id)}).content.decode())
    preview = client.post("/models/deploy/preview/", data, HTTP_HX_REQUEST="true").content.decode()
    assert "Memory check" in preview and "Fits:" in preview
    data.update(context="768", llamacpp_cache_type_k="q8_0", llamacpp_flash_attn="off")
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post("/models/deploy/", data)
    deployment = Deployment.objects.get()
    assert response.status_code == 302 and response["Location"] == f"/models/deployments/{deployment.public_id}/"
    assert (deployment.name, deployment.profile, deployment.owner) == ("tiny-held", "small", personas.acme.project)
    assert deployment.model_path == str(entries.served_path(held, "small"))
    assert {k: deployment.config[k] for k in ("context", "parallel", "cache_type_k", "flash_attn")} == \
        {"context": 768, "parallel": 2, "cache_type_k": "q8_0", "flash_attn": "off"}
    assert deployment.gpu_uuids == [] and no_agent == [("start", deployment.replica_set.get().public_id)]
    # Held now says what runs it.
    assert f"{deployment.state} 0/1" in client.get("/models/held/").content.decode()


def test_each_engine_problem_is_said_under_its_field_and_nothing_is_deployed(client, personas, held, node, no_agent):
    client.force_login(personas.max)
    data = wizard_data(client.get("/models/deploy/", {"model": str(held.public_id)}).content.decode())
    data.update(llamacpp_gpu_layers="lots", llamacpp_batch_size="0")
    response = client.post("/models/deploy/", data)
    html = response.content.decode()
    assert response.status_code == 400 and not Deployment.objects.exists()
    gpu_layers = html[html.index('name="llamacpp_gpu_layers"'):html.index('name="llamacpp_cache_type_k"')]
    assert "must be a whole number or all" in gpu_layers
    batch = html[html.index('name="llamacpp_batch_size"'):html.index('name="llamacpp_ubatch_size"')]
    assert "must be at least 1" in batch


def test_vllm_settings_are_its_own_and_the_common_fields_take_its_names(personas, held, node):
    form = DeployForm({"model": str(held.public_id), "profile": "small", "name": "tiny-held", "node": node.name,
                       "task": "chat", "engine": "vllm", "runtime": "docker", "owner": "project:acme/ml/search",
                       "priority": "50", "context": "2048", "parallel": "8", "vllm_dtype": "bfloat16",
                       "vllm_enforce_eager": "on", "vllm_enable_sleep_mode": "off", "vllm_cpu_offload_gb": "1.5",
                       "llamacpp_gpu_layers": "all"}, user=personas.max)
    assert form.is_valid(), form.errors
    assert form.engine_config() == {"max_model_len": 2048, "max_num_seqs": 8, "dtype": "bfloat16",
                                    "enforce_eager": True, "enable_sleep_mode": False, "cpu_offload_gb": 1.5}


def test_a_gpu_is_chosen_on_the_node_and_one_of_another_node_is_refused(personas, held, node):
    other = register_node(NodeReport(name="gpu-node", address="127.0.0.1", cpu_count=8))
    card = Accelerator.objects.create(node=other, index=0, uuid="GPU-wizard-0", accelerator_class="H100",
                                      memory_total_bytes=80 * 2**30)
    base = {"model": str(held.public_id), "profile": "small", "name": "tiny-held", "task": "chat",
            "engine": "llamacpp", "runtime": "process", "owner": "project:acme/ml/search", "priority": "50",
            "accelerator": str(card.public_id)}
    wrong = DeployForm({**base, "node": node.name}, user=personas.max)
    assert not wrong.is_valid() and f"is not on {node.name}" in wrong.errors["accelerator"][0]
    right = DeployForm({**base, "node": other.name}, user=personas.max)
    assert right.is_valid(), right.errors
    assert right.cleaned_data["accelerator"] == card
    assert "H100 #0, 80 GiB" in str(right["accelerator"])  # offered under its node


def test_a_caller_sees_and_deploys_only_models_within_reach(client, personas, held, elsewhere, node, no_agent):
    client.force_login(personas.max)
    html = client.get("/models/deploy/").content.decode()
    assert "tiny-held" in html and "globex-secret" not in html
    # Its id typed in by hand fills nothing in and deploys nothing.
    html = client.get("/models/deploy/", {"model": str(elsewhere.public_id)}).content.decode()
    assert "globex-secret" not in html and selected(html, "model") in (None, "")
    response = client.post("/models/deploy/", {"model": str(elsewhere.public_id), "name": "stolen", "node": node.name,
                                               "task": "chat", "engine": "llamacpp", "runtime": "process",
                                               "owner": "project:acme/ml/search", "priority": "50"})
    assert response.status_code == 400 and not Deployment.objects.exists()
    assert "globex-secret" not in response.content.decode()
    # Nothing chosen: it asks for a held model.
    response = client.post("/models/deploy/preview/", {"name": "x", "node": node.name, "task": "chat",
                                                       "engine": "llamacpp", "runtime": "process", "priority": "50"},
                           HTTP_HX_REQUEST="true")
    assert "Held model: Pick a model the mirror holds." in response.content.decode()


def test_an_administrator_may_type_a_path_instead(client, admin_user, held, node):
    client.force_login(admin_user)
    html = client.get("/models/deploy/").content.decode()
    assert 'name="model_path"' in html
    assert "globex-secret" not in html and "tiny-held" in html


@pytest.mark.parametrize(("kind", "config"), [
    ("llamacpp", {"gpu_layers": "all", "flash_attn": "on", "embeddings": True, "batch_size": 512}),
    ("vllm", {"dtype": "half", "enforce_eager": False, "cpu_offload_gb": 2.5, "tensor_parallel_size": 2}),
])
def test_settings_read_back_what_they_were_filled_in_with(kind, config):
    assert engine_settings.read(kind, engine_settings.initial(kind, config)) == config
