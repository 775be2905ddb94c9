"""A catalog profile in each engine's terms: a vLLM model from the catalog is estimated (so the
placement policy can place it), deploys with vLLM's own settings, counts vLLM's slots as its
capacity, and its degraded relaunch shortens the context and moves a quarter of the weights to
host memory. No GPU here: the node is a recorded H100 host, and the deployment is checked as far
as the command line vLLM would be started with."""

from __future__ import annotations

import pytest
from django.core.cache import cache

from scheduler.estimation.reading import read_model
from scheduler.models import Accelerator
from scheduler.nvml import discover_gpus
from scheduler.services import EngineReport, NodeReport, register_node
from serving import queues
from serving.catalog import profiles, room, servability
from serving.catalog.entries import import_local
from serving.control.placement import deploy_request
from serving.models import ModelEntry
from serving.control import placement
from serving.deployments import service
from serving.engines.vllm import VLLM
from serving.models import Deployment
from tests.assets.hf_models import LLAMA_CONFIG, llama_like, write_hf_model
from tests.assets.recorded_nvml import RecordedNvml, recorded_smi
from tenancy.audit import Actor

pytestmark = pytest.mark.django_db
ACTOR = Actor(system="tests")
GIB = 2**30


@pytest.fixture
def vllm_entry(tmp_path, settings):
    root = tmp_path / "models"
    root.mkdir()
    settings.SCHEDULER_MODEL_ROOTS = [root.resolve()]
    cache.clear()
    folder = write_hf_model(tmp_path / "src" / "tiny-llama", LLAMA_CONFIG, llama_like())
    return import_local(ACTOR, folder, name="tiny-vllm")


@pytest.fixture
def gpu_node():
    return register_node(NodeReport(name="h100-01", address="127.0.0.1", cpu_count=128,
                                    memory_total_bytes=2048 * GIB, memory_available_bytes=1900 * GIB,
                                    engines=(EngineReport(kind="vllm", version="0.11.0"),),
                                    gpus=discover_gpus(RecordedNvml.load("h100x8"), recorded_smi(None))))


def command_line(request, accelerator):
    spec_config = VLLM().validate_config(request.config)  # what the deployment service checks too
    from serving.engines.base import LaunchSpec

    spec = LaunchSpec(replica_id="r1", engine="vllm", model_path=request.model_path, served_name="tiny-vllm",
                      host="127.0.0.1", port=18000, api_key="k", config=spec_config, gpu_uuids=(accelerator.uuid,),
                      gpu_memory_total_bytes=accelerator.memory_total_bytes, reservation_bytes=4 * GIB)
    return list(VLLM().command(spec).argv)


def test_a_vllm_entry_is_estimated_and_deploys_with_vllms_settings(vllm_entry, gpu_node):
    [profile] = vllm_entry.profiles
    assert (vllm_entry.format, profile["engine"], profile["context"], profile["parallel"]) == \
        ("safetensors", "vllm", 4096, 16)
    verdict = servability.check(profile["file"], profile=profile)
    assert verdict.servable and verdict.engine == "vllm"
    breakdown = verdict.estimate["breakdown"]
    assert breakdown["inputs"]["max_model_len"] == 4096 and breakdown["inputs"]["max_num_seqs"] == 16
    desired = room.desired_model(vllm_entry)
    assert desired.profiles[0].gpus == 1 and desired.profiles[0].memory_bytes == verdict.estimate["total_bytes"]

    gpu = Accelerator.objects.filter(node=gpu_node).order_by("index").first()
    request = deploy_request(vllm_entry, gpu_node, accelerator=gpu)
    assert request.engine == "vllm" and request.config == {"max_model_len": 4096, "max_num_seqs": 16}
    argv = command_line(request, gpu)
    assert argv[argv.index("--max-model-len") + 1] == "4096" and argv[argv.index("--max-num-seqs") + 1] == "16"
    assert "--cpu-offload-gb" not in argv
    assert profiles.slots(profiles.first(vllm_entry)) == 16  # load scaling's capacity per replica
    assert profiles.slots({"engine": "vllm"}) == 256 and profiles.slots({"engine": "llamacpp"}) == 1


def test_the_placement_loop_places_a_vllm_model_on_a_gpu(vllm_entry, gpu_node, monkeypatch,
                                                         django_capture_on_commit_callbacks):
    sent = []
    monkeypatch.setattr(queues, "to_node", lambda operation, replica: sent.append(operation))
    ModelEntry.objects.filter(pk=vllm_entry.pk).update(scaling_min=1, scaling_max=1)
    with django_capture_on_commit_callbacks(execute=True):
        assert placement.reconcile()["launched"] == ["tiny-vllm"]
    deployment = Deployment.objects.get(name="tiny-vllm")
    assert deployment.engine == "vllm" and len(deployment.gpu_uuids) == 1 and sent == ["start"]
    assert deployment.config["max_model_len"] == 4096 and deployment.config["max_num_seqs"] == 16
    assert placement.reconcile()["launched"] == []  # converged


def test_a_degraded_vllm_relaunch_halves_the_context_and_offloads_a_quarter_of_the_weights(vllm_entry, gpu_node):
    gpu = Accelerator.objects.filter(node=gpu_node).order_by("index").first()
    weights = read_model(vllm_entry.profiles[0]["file"]).weights_bytes
    request = deploy_request(vllm_entry, gpu_node, accelerator=gpu, level=1)
    offload = request.config["cpu_offload_gb"]
    assert request.config["max_model_len"] == 2048 and request.config["max_num_seqs"] == 16
    assert weights / 4 / GIB <= offload < weights / 4 / GIB + 0.01
    argv = command_line(request, gpu)
    assert argv[argv.index("--max-model-len") + 1] == "2048" and argv[argv.index("--cpu-offload-gb") + 1] == f"{offload:g}"

    # With no context in the profile vLLM runs the model's own length: the degrade halves that.
    ModelEntry.objects.filter(pk=vllm_entry.pk).update(profiles=[{**vllm_entry.profiles[0], "context": None}])
    vllm_entry.refresh_from_db()
    assert "max_model_len" not in deploy_request(vllm_entry, gpu_node, accelerator=gpu).config
    degraded = deploy_request(vllm_entry, gpu_node, accelerator=gpu, level=1).config
    assert degraded["max_model_len"] == LLAMA_CONFIG["max_position_embeddings"] // 2


def test_an_unreadable_vllm_folder_is_not_servable_and_says_why(tmp_path):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    verdict = servability.check(folder, profile={"engine": "vllm", "context": 4096})
    assert not verdict.servable and verdict.reason and verdict.estimate is None


def test_a_draft_rides_in_the_deploy_request_and_in_the_policys_model(tmp_path, settings, tiny_model):
    import shutil

    from scheduler import memory
    from serving.catalog import placing

    settings.SCHEDULER_MODEL_ROOTS = [tmp_path.resolve()]
    node = register_node(NodeReport(name="cpu-01", address="127.0.0.1", cpu_count=8, memory_total_bytes=64 * GIB,
                                    memory_available_bytes=60 * GIB, engines=(EngineReport(kind="llamacpp", version="b1"),)))
    main = import_local(ACTOR, shutil.copy(tiny_model, tmp_path / "main.gguf"), name="main")
    small = import_local(ACTOR, shutil.copy(tiny_model, tmp_path / "small.gguf"), name="small")
    alone = room.desired_model(main)
    assert alone.draft is None
    main = placing.change(ACTOR, main, {"draft": "small"})
    request = deploy_request(main, node)
    assert request.config["draft_model"] == str(servability_path(small))
    drafted = room.desired_model(main)
    added = memory.estimate_and_fit(servability_path(main), "llamacpp", profiles.estimate_config(main.profiles[0]),
                                    draft_path=servability_path(small), check_root=False).estimate.inputs["draft"]["bytes"]
    assert drafted.draft.model == "small" and drafted.draft.memory_bytes == added > 0
    assert drafted.profiles == alone.profiles  # the model's own figure; the draft's comes on top, as its own
    ModelEntry.objects.filter(pk=small.pk).delete()
    main.refresh_from_db()
    assert room.desired_model(main) is None  # what it must load beside it is gone: it cannot be placed


def servability_path(entry):
    from serving.catalog.entries import served_path

    return served_path(entry)



def test_a_profile_on_two_gpus_is_estimated_for_each_of_them(vllm_entry):
    one = room.desired_model(vllm_entry).profiles[0]
    ModelEntry.objects.filter(pk=vllm_entry.pk).update(profiles=[{**vllm_entry.profiles[0], "gpus": 2}])
    vllm_entry.refresh_from_db()
    two = room.desired_model(vllm_entry).profiles[0]
    assert (one.gpus, two.gpus) == (1, 2) and two.memory_bytes < one.memory_bytes  # vLLM shards the model
    assert profiles.estimate_config(vllm_entry.profiles[0])["tensor_parallel_size"] == 2
    assert profiles.estimate_config({"engine": "llamacpp", "gpus": 2}) == {"ctx_size": 4096, "n_gpu_layers": -1,
                                                                          "split_gpus": 2}
    assert profiles.estimate_config({"engine": "llamacpp"}) == {"ctx_size": 4096}  # a CPU profile
