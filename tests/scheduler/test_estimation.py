"""Estimation from real generated GGUF headers and safetensors folders, with the engines' rules."""

import struct
import time

import pytest

from scheduler.errors import InvalidEstimateRequest, ModelNotFound, UnreadableModel
from scheduler.estimation import gguf_header, safetensors_layout
from scheduler.estimation.engines import (
    LlamaCppConfig, VllmConfig, estimate_llamacpp, estimate_vllm, vllm_utilisation,
)
from scheduler.estimation.reading import read_model
from tests.assets.hf_models import llama_like, write_hf_model

GIB = 2**30


@pytest.mark.parametrize("shape", [
    dict(layers=2, embedding=64, heads=4, kv_heads=2),
    dict(layers=8, embedding=512, heads=8, kv_heads=8, context=4096),
    dict(layers=12, embedding=384, heads=6, kv_heads=1, feed_forward=1024, context=8192),
    dict(architecture="qwen2", layers=6, embedding=256, heads=8, kv_heads=2, context=2048),
    dict(layers=4, embedding=256, heads=4, kv_heads=2, key_length=96, value_length=32),
    dict(layers=3, embedding=128, heads=2, kv_heads=2, weight_type="f32"),
])
def test_gguf_header_gives_the_shape_it_was_written_with(gguf_model, shape):
    path = gguf_model("m.gguf", **shape)
    read = gguf_header.read_shape(path)
    head_dim = shape["embedding"] // shape["heads"]
    assert read.architecture == shape.get("architecture", "llama")
    assert (read.layers, read.embedding, read.heads) == (shape["layers"], shape["embedding"], shape["heads"])
    assert read.kv_heads == (shape["kv_heads"],) * shape["layers"]
    assert read.key_length == shape.get("key_length", head_dim)
    assert read.value_length == shape.get("value_length", head_dim)
    assert read.context_length == shape.get("context", 512)
    assert read.vocab_size == 272
    # Every tensor byte is accounted for: the data section is the file minus the header.
    assert 0 < path.stat().st_size - read.weights_bytes < 64 * 1024
    assert sum(read.layer_weights_bytes) + read.input_weights_bytes + read.output_weights_bytes == read.weights_bytes


@pytest.mark.parametrize("layers, kv_heads, key, value, cache, expected_per_token", [
    (2, 2, 16, 16, "f16", 2 * 2 * 32 * 2),
    (8, 4, 64, 64, "f16", 8 * 4 * 128 * 2),
    (8, 4, 64, 64, "q8_0", 8 * 4 * 128 * 34 / 32),
    (8, 4, 64, 64, "q4_0", 8 * 4 * 128 * 18 / 32),
    (4, 2, 96, 32, "f16", 4 * 2 * 128 * 2),
])
def test_kv_cache_per_token_is_layers_times_kv_heads_times_key_plus_value_times_cache_bytes(
        gguf_model, layers, kv_heads, key, value, cache, expected_per_token):
    shape = gguf_header.read_shape(gguf_model("kv.gguf", layers=layers, embedding=64, heads=4, kv_heads=kv_heads,
                                              key_length=key, value_length=value))
    estimate = estimate_llamacpp(shape, LlamaCppConfig(ctx_size=1024, cache_type_k=cache, cache_type_v=cache))
    assert estimate.kv_bytes_per_token == pytest.approx(expected_per_token)
    assert estimate.kv_cache_bytes == round(expected_per_token * 1024)


def test_llamacpp_context_pool_is_shared_by_parallel_slots_not_multiplied(gguf_model):
    shape = gguf_header.read_shape(gguf_model(layers=4, embedding=256, heads=4, kv_heads=2, context=8192))
    one = estimate_llamacpp(shape, LlamaCppConfig(ctx_size=4096, parallel=1))
    four = estimate_llamacpp(shape, LlamaCppConfig(ctx_size=4096, parallel=4))
    assert one.kv_cache_bytes == four.kv_cache_bytes
    assert four.inputs["ctx_per_slot"] == 1024


def test_breakdown_adds_up_and_names_its_inputs(smollm2_model):
    shape = read_model(smollm2_model)
    estimate = estimate_llamacpp(shape, LlamaCppConfig(ctx_size=2048))
    assert estimate.total_bytes == sum(p.bytes for p in estimate.parts)
    assert [p.name for p in estimate.parts] == ["weights", "kv_cache", "compute", "overhead"]
    assert estimate.inputs["layers"] == 30 and estimate.inputs["kv_heads"] == 3 and estimate.inputs["vocab_size"] == 49152
    assert estimate.kv_cache_bytes == 30 * 3 * 128 * 2 * 2048  # 45 MiB, what llama.cpp itself allocates


def test_context_defaults_to_the_models_and_is_padded_to_256(gguf_model):
    shape = gguf_header.read_shape(gguf_model(context=1000))
    assert estimate_llamacpp(shape, LlamaCppConfig()).context_tokens == 1024
    assert estimate_llamacpp(shape, LlamaCppConfig(ctx_size=300)).context_tokens == 512


def test_offloading_puts_the_offloaded_layers_on_the_gpu_and_the_rest_on_the_host(gguf_model):
    shape = gguf_header.read_shape(gguf_model(layers=8, embedding=256, heads=4, kv_heads=2))
    cpu = estimate_llamacpp(shape, LlamaCppConfig(ctx_size=2048))
    full = estimate_llamacpp(shape, LlamaCppConfig(ctx_size=2048, n_gpu_layers=-1))
    half = estimate_llamacpp(shape, LlamaCppConfig(ctx_size=2048, n_gpu_layers=4))
    assert cpu.device == "cpu" and full.device == "gpu"
    assert full.weights_bytes == sum(shape.layer_weights_bytes) + shape.output_weights_bytes
    assert half.weights_bytes == sum(shape.layer_weights_bytes[4:])
    assert half.kv_cache_bytes == full.kv_cache_bytes // 2
    assert half.host_bytes > full.host_bytes and half.notes


def test_layers_split_over_gpus_are_estimated_for_the_fullest_gpu(gguf_model):
    shape = gguf_header.read_shape(gguf_model(layers=8, embedding=256, heads=4, kv_heads=2))
    one = estimate_llamacpp(shape, LlamaCppConfig(ctx_size=2048, n_gpu_layers=-1))
    two = estimate_llamacpp(shape, LlamaCppConfig(ctx_size=2048, n_gpu_layers=-1, split_gpus=2))
    three = estimate_llamacpp(shape, LlamaCppConfig(ctx_size=2048, n_gpu_layers=-1, split_gpus=3))
    # Two runs of four layers; the second carries the output head too, so it is the fullest.
    assert two.weights_bytes == sum(shape.layer_weights_bytes[4:]) + shape.output_weights_bytes
    assert two.kv_cache_bytes == one.kv_cache_bytes // 2
    assert two.compute_bytes == one.compute_bytes and two.overhead_bytes == one.overhead_bytes  # on each GPU
    assert three.total_bytes < two.total_bytes < one.total_bytes
    assert "fullest of 2 GPUs" in two.parts[0].detail and two.inputs["split_gpus"] == 2
    assert two.host_bytes == one.host_bytes  # nothing more on the host
    with pytest.raises(InvalidEstimateRequest):
        estimate_llamacpp(shape, LlamaCppConfig(split_gpus=0))


def test_gguf_header_of_a_real_model_is_read_well_within_100ms(smollm2_model):
    gguf_header._read_shape_cached.cache_clear()
    started = time.perf_counter()
    shape = gguf_header.read_shape(smollm2_model)
    elapsed = time.perf_counter() - started
    assert shape.layers == 30 and shape.weight_type == "Q4_1"
    assert elapsed < 0.5  # a generous bound for a shared machine; the benchmark prints the real figure


def test_not_a_gguf_file_is_refused_with_a_code(tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"NOPE" + b"\0" * 100)
    with pytest.raises(UnreadableModel, match="not a GGUF file"):
        gguf_header.read_shape(bogus)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1, 5) + b"\x05\0\0\0")
    with pytest.raises(UnreadableModel) as failure:
        gguf_header.read_shape(truncated)
    assert failure.value.code == "unreadable_model"
    with pytest.raises(ModelNotFound):
        gguf_header.read_shape(tmp_path / "absent.gguf")


def test_invalid_configuration_lists_every_problem(gguf_model):
    shape = gguf_header.read_shape(gguf_model())
    with pytest.raises(InvalidEstimateRequest) as failure:
        estimate_llamacpp(shape, LlamaCppConfig(ctx_size=0, parallel=0, cache_type_k="q3_weird"))
    assert set(failure.value.details) == {"ctx_size", "parallel", "cache_type_k"}


# --- safetensors / Hugging Face layout --------------------------------------------------------

def test_safetensors_weights_come_from_headers_and_shape_from_config(tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100,
              "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}
    folder = write_hf_model(tmp_path / "tiny-llama", config, llama_like())
    shape = read_model(folder)
    expected = (100 * 64 * 2 + 64) * 2 + 2 * (64 * 64 * 2 + 32 * 64 * 2 + 128 * 64 * 2) * 2
    assert shape.weights_bytes == expected
    assert shape.kv_heads == (2, 2) and shape.key_length == 16 and shape.context_length == 4096
    assert shape.kv_bytes_per_token(2) == 2 * 2 * 32 * 2


def test_sliding_window_layers_hold_only_the_window(tmp_path):
    config = {"architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 6, "hidden_size": 64,
              "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 128,
              "vocab_size": 100, "max_position_embeddings": 32768, "sliding_window": 1024,
              "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}
    shape = read_model(write_hf_model(tmp_path / "gemma", config, llama_like(layers=6)))
    full = shape.kv_bytes_per_token(2)
    at_32k = shape.kv_bytes_per_token(2, 32768)
    assert shape.sliding_window_layers == 5
    assert at_32k == pytest.approx(full / 6 * (1 + 5 * 1024 / 32768))


def test_mla_caches_one_latent_per_layer(tmp_path):
    config = {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
              "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 128, "vocab_size": 100,
              "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
              "max_position_embeddings": 163840}
    shape = read_model(write_hf_model(tmp_path / "mla", config, llama_like()))
    assert shape.kv_bytes_per_token(2) == 2 * (512 + 64) * 2


def test_safetensors_folder_without_config_is_refused(tmp_path):
    folder = tmp_path / "noconfig"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b"{}")
    with pytest.raises(UnreadableModel):
        safetensors_layout.read_shape(folder)


# --- vLLM -------------------------------------------------------------------------------------

@pytest.mark.parametrize("reservation_gib, total_gib, expected", [
    (40, 80, 0.50), (40.1, 80, 0.51), (71.99, 80, 0.90), (79.2, 80, 0.99), (8, 79.6, 0.11)])
def test_vllm_utilisation_is_the_reservation_share_rounded_up_to_a_percent(reservation_gib, total_gib, expected):
    assert vllm_utilisation(int(reservation_gib * GIB), int(total_gib * GIB)) == expected


def test_vllm_kv_is_max_model_len_times_max_num_seqs_and_the_pool_leaves_tokens(tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100,
              "max_position_embeddings": 4096}
    shape = read_model(write_hf_model(tmp_path / "m", config, llama_like()))
    estimate = estimate_vllm(shape, VllmConfig(max_model_len=2048, max_num_seqs=8), memory_total_bytes=80 * GIB)
    per_token = 2 * 2 * 32 * 2
    assert estimate.kv_cache_bytes == per_token * 2048 * 8
    vllm = estimate.vllm
    assert vllm["gpu_memory_utilization"] == vllm_utilisation(estimate.total_bytes, 80 * GIB)
    assert vllm["pool_bytes"] >= estimate.total_bytes
    # The pool holds at least the worst case it was sized for.
    assert vllm["kv_cache_tokens"] >= 2048 * 8
    assert "leaves" in estimate.notes[0]
    fp8 = estimate_vllm(shape, VllmConfig(max_model_len=2048, max_num_seqs=8, kv_cache_dtype="fp8"))
    assert fp8.kv_cache_bytes == estimate.kv_cache_bytes // 2
    split = estimate_vllm(shape, VllmConfig(max_model_len=2048, max_num_seqs=8, tensor_parallel_size=2))
    assert split.kv_cache_bytes == estimate.kv_cache_bytes // 2


def test_the_gguf_data_extent_is_read_and_a_file_cut_short_still_reads_its_header(gguf_model, tmp_path):
    path = gguf_model("whole.gguf")
    whole = gguf_header.read_shape(path)
    assert whole.data_end_bytes == whole.file_bytes == path.stat().st_size  # the last tensor ends the file
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-3])
    short = gguf_header.read_shape(cut)  # a hand deploy still gets its estimate (and the engine its say)
    assert (short.data_end_bytes, short.file_bytes) == (whole.data_end_bytes, whole.file_bytes - 3)
    assert short.weights_bytes == whole.weights_bytes
