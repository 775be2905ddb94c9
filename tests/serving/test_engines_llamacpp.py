"""llama.cpp's command line, environment, configuration and probe: what Berth asks llama-server to do."""

from __future__ import annotations

import pytest

from serving.engines.llamacpp import LlamaCpp
from serving.engines.llamacpp_image import IMAGE
from serving.engines.registry import engine_for
from serving.errors import InvalidEngineConfig, UnknownEngine


@pytest.fixture
def engine(llama_server_binary):
    return LlamaCpp(binary=llama_server_binary)


def flag_value(argv, flag):
    return argv[argv.index(flag) + 1]


def test_command_line_carries_model_address_alias_context_and_threads(engine, launch_spec, llama_server_binary):
    spec = launch_spec("/models/m.gguf", port=18080, cores=3, config={"context": 2048, "parallel": 4})

    command = engine.command(spec)

    argv = command.argv
    assert argv[0] == str(llama_server_binary)
    assert flag_value(argv, "-m") == "/models/m.gguf"
    assert flag_value(argv, "--host") == "127.0.0.1"
    assert flag_value(argv, "--port") == "18080"
    assert flag_value(argv, "--alias") == "berth-test"
    assert flag_value(argv, "-c") == "2048"
    assert flag_value(argv, "--parallel") == "4"
    assert flag_value(argv, "-t") == "3"
    assert "--metrics" in argv
    assert "--no-webui" in argv  # this llama-server knows the flag (checked with --help)
    # Its memory bounded to what the estimate counts: no prompt cache, two window checkpoints a slot.
    assert flag_value(argv, "--cache-ram") == "0" and flag_value(argv, "--ctx-checkpoints") == "2"
    assert command.image == IMAGE


def test_api_key_goes_through_the_environment_never_argv(engine, launch_spec):
    spec = launch_spec("/models/m.gguf", api_key="bre_secret_value")

    command = engine.command(spec)

    assert command.env["LLAMA_API_KEY"] == "bre_secret_value"
    assert not any("bre_secret_value" in arg for arg in command.argv)
    assert "--api-key" not in command.argv


def test_defaults_are_4096_context_one_slot_and_no_gpu_layers_without_a_gpu(engine, launch_spec):
    command = engine.command(launch_spec("/models/m.gguf", config={}))

    assert flag_value(command.argv, "-c") == "4096"
    assert flag_value(command.argv, "--parallel") == "1"
    assert flag_value(command.argv, "--n-gpu-layers") == "0"
    assert command.env["CUDA_VISIBLE_DEVICES"] == ""  # a CPU placement sees no GPU


def test_a_gpu_placement_offloads_every_layer_to_the_placed_devices_only(engine, launch_spec):
    spec = launch_spec("/models/m.gguf", gpu_uuids=("GPU-aaaa", "MIG-bbbb"))

    command = engine.command(spec)

    assert flag_value(command.argv, "--n-gpu-layers") == "999"
    assert command.env["CUDA_VISIBLE_DEVICES"] == "GPU-aaaa,MIG-bbbb"


def test_all_layers_can_be_asked_for_and_a_validated_configuration_validates_again(engine, launch_spec):
    cleaned = engine.validate_config({"gpu_layers": "all", "context": None})

    assert cleaned["context"] == 4096  # null is the default, not "-c None"
    assert engine.validate_config(cleaned) == cleaned  # what a deployment stores is valid as it is
    assert flag_value(engine.command(launch_spec("/m.gguf", config=cleaned)).argv, "--n-gpu-layers") == "999"
    with pytest.raises(InvalidEngineConfig):
        engine.validate_config({"gpu_layers": "most"})


def test_embedding_configuration_adds_embeddings_and_pooling(engine, launch_spec):
    command = engine.command(launch_spec("/m.gguf", config={"embeddings": True, "pooling": "cls"}))

    assert "--embeddings" in command.argv
    assert flag_value(command.argv, "--pooling") == "cls"


def test_optional_settings_map_to_their_flags(engine, launch_spec):
    config = {"cache_type_k": "q8_0", "cache_type_v": "q4_0", "flash_attn": "on", "batch_size": 1024,
              "ubatch_size": 256, "gpu_layers": 12, "reranking": True,
              "extra_flags": ["--load-mode=none", "--defrag-thold=0.1", "--rope-scaling=yarn", "--no-warmup"]}

    argv = engine.command(launch_spec("/m.gguf", config=config, gpu_uuids=("GPU-1",))).argv

    assert flag_value(argv, "-ctk") == "q8_0"
    assert flag_value(argv, "-ctv") == "q4_0"
    assert flag_value(argv, "-fa") == "on"
    assert flag_value(argv, "-b") == "1024"
    assert flag_value(argv, "-ub") == "256"
    assert flag_value(argv, "--n-gpu-layers") == "12"
    assert "--reranking" in argv
    assert flag_value(argv, "--load-mode") == "none"
    assert flag_value(argv, "--defrag-thold") == "0.1"
    assert flag_value(argv, "--rope-scaling") == "yarn"
    assert "--no-warmup" in argv


def test_a_draft_model_rides_with_the_same_gpu_offload(engine, launch_spec):
    on_gpu = engine.command(launch_spec("/m.gguf", config={"draft_model": "/models/d.gguf", "draft_max": 8},
                                        gpu_uuids=("GPU-1",))).argv
    assert flag_value(on_gpu, "-md") == "/models/d.gguf" and flag_value(on_gpu, "--spec-draft-n-max") == "8"
    assert flag_value(on_gpu, "-ngld") == flag_value(on_gpu, "--n-gpu-layers")
    on_cpu = engine.command(launch_spec("/m.gguf", config={"draft_model": "/models/d.gguf"})).argv
    assert flag_value(on_cpu, "-ngld") == "0" and "--spec-draft-n-max" not in on_cpu
    assert "-md" not in engine.command(launch_spec("/m.gguf")).argv
    with pytest.raises(InvalidEngineConfig) as caught:
        engine.validate_config({"draft_max": 4, "embeddings": True, "draft_model": "relative.gguf"})
    fields = {p["field"] for p in caught.value.details["problems"]}
    assert fields == {"draft_model", "draft_max"}  # not an absolute .gguf path, so draft_max has no model
    with pytest.raises(InvalidEngineConfig) as caught:
        engine.validate_config({"draft_max": 4})
    assert [p["field"] for p in caught.value.details["problems"]] == ["draft_max"]
    with pytest.raises(InvalidEngineConfig) as caught:
        engine.validate_config({"draft_model": "/models/d.gguf", "embeddings": True})
    assert [p["field"] for p in caught.value.details["problems"]] == ["draft_model"]


def test_invalid_configuration_lists_every_problem(engine):
    with pytest.raises(InvalidEngineConfig) as caught:
        engine.validate_config({"context": "big", "parallel": 0, "cache_type_k": "q2_k", "flash_attn": True,
                                "pooling": "max", "embeddings": "yes"})

    error = caught.value
    assert error.code == "invalid_engine_config"
    fields = {problem["field"] for problem in error.details["problems"]}
    assert fields == {"context", "parallel", "cache_type_k", "flash_attn", "pooling", "embeddings"}


def test_unknown_keys_are_refused_with_the_allowed_ones(engine):
    with pytest.raises(InvalidEngineConfig) as caught:
        engine.validate_config({"context": 1024, "ctx": 2048, "model": "/etc/passwd"})

    problems = caught.value.details["problems"]
    assert {p["field"] for p in problems} == {"ctx", "model"}
    assert "context" in problems[0]["message"] and "extra_flags" in problems[0]["message"]
    assert "context" in caught.value.details["allowed"]


def test_extra_flags_outside_the_allowlist_are_refused(engine):
    with pytest.raises(InvalidEngineConfig) as caught:
        engine.validate_config({"extra_flags": ["--port=9999", "--api-key=x", "--host=0.0.0.0", "-m=/etc/shadow",
                                                "--rope-scaling=wild", "--defrag-thold", "--no-warmup=1",
                                                "--cont-batching"]})

    problems = {p["field"]: p["message"] for p in caught.value.details["problems"]}
    assert set(problems) == {"extra_flags[--port=9999]", "extra_flags[--api-key=x]", "extra_flags[--host=0.0.0.0]",
                             "extra_flags[-m=/etc/shadow]", "extra_flags[--rope-scaling=wild]",
                             "extra_flags[--defrag-thold]", "extra_flags[--no-warmup=1]"}
    assert "not allowed" in problems["extra_flags[--port=9999]"]
    assert "must be one of none, linear, yarn" in problems["extra_flags[--rope-scaling=wild]"]
    assert "needs a value" in problems["extra_flags[--defrag-thold]"]
    assert "takes no value" in problems["extra_flags[--no-warmup=1]"]


def test_cross_field_problems_are_listed_with_the_others(engine):
    with pytest.raises(InvalidEngineConfig) as caught:
        engine.validate_config({"pooling": "mean", "batch_size": 128, "ubatch_size": 512, "parallel": "two"})

    fields = {p["field"] for p in caught.value.details["problems"]}
    assert fields == {"pooling", "ubatch_size", "parallel"}


def test_probe_is_a_one_token_completion_or_one_embedding_or_a_rerank(engine, launch_spec):
    spec = launch_spec("/m.gguf")

    completion = engine.probe(spec, "chat")
    embedding = engine.probe(spec, "embedding")
    rerank = engine.probe(spec, "rerank")

    assert (completion.path, completion.body["prompt"], completion.body["max_tokens"]) == ("/v1/completions", "Hi", 1)
    assert (embedding.path, embedding.body["input"]) == ("/v1/embeddings", "Hi")
    assert rerank.path == "/v1/rerank" and rerank.body["query"] and rerank.body["documents"]
    assert engine.health_path() == "/health"


def test_registry_knows_both_engines_and_refuses_others():
    assert engine_for("llamacpp").kind == "llamacpp"
    assert engine_for("vllm").kind == "vllm"
    with pytest.raises(UnknownEngine):
        engine_for("ollama")
