"""Engine rules: how much memory llama.cpp or vLLM takes for a model shape and a launch configuration.

Each rule returns an ``Estimate`` with its breakdown (weights, KV cache, compute buffers, engine
overhead) and the inputs of its formulas, so the console can show what the figure is made of.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

from scheduler.errors import InvalidEstimateRequest
from scheduler.estimation.shape import ModelShape

MIB = 2**20
GIB = 2**30

# Bytes per cached element, by cache type (llama.cpp block types: q8_0 is 34 bytes per 32 values).
CACHE_TYPE_BYTES = {
    "f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q5_1": 24 / 32, "q5_0": 22 / 32,
    "q4_1": 20 / 32, "q4_0": 18 / 32, "iq4_nl": 18 / 32,
}
VLLM_KV_DTYPE_BYTES = {"auto": None, "fp8": 1.0, "fp8_e4m3": 1.0, "fp8_e5m2": 1.0, "bfloat16": 2.0, "float16": 2.0}

# llama.cpp on the CPU (weights mapped from the file, pages resident once read): what a process
# holds beyond weights and KV cache, measured with VmHWM on the llama-server this project builds
# (`manage.py bench_estimates` re-measures it): a fixed base (binary, threads, HTTP server, the
# part of the compute buffer a request touches), the tokenizer's tables per vocabulary entry,
# per-slot bookkeeping per context token and graph metadata per layer.
LLAMACPP_HOST_BASE = int(17.85 * MIB)
LLAMACPP_HOST_PER_VOCAB = 358
LLAMACPP_HOST_PER_CONTEXT_TOKEN = 65
LLAMACPP_HOST_PER_LAYER = 37 * 1024
# On a GPU: the CUDA context, cuBLAS workspace and per-device graph bookkeeping.
LLAMACPP_DEVICE_OVERHEAD = 384 * MIB
# vLLM: memory outside PyTorch's pool (CUDA context, NCCL, allocator slack) and CUDA graphs.
VLLM_NON_TORCH = 1 * GIB
VLLM_CUDA_GRAPHS = 1 * GIB


@dataclasses.dataclass(frozen=True)
class Part:
    name: str
    bytes: int
    detail: str


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Memory a launch needs on the device it is fitted to (``device``: "cpu" or "gpu")."""

    engine: str
    device: str
    weights_bytes: int
    kv_cache_bytes: int
    compute_bytes: int
    overhead_bytes: int
    total_bytes: int
    host_bytes: int = 0  # what stays in host RAM besides (layers not offloaded, the process itself)
    kv_bytes_per_token: float = 0.0
    context_tokens: int = 0
    parts: tuple[Part, ...] = ()
    inputs: dict[str, Any] = dataclasses.field(default_factory=dict)
    notes: tuple[str, ...] = ()
    vllm: dict[str, Any] | None = None  # utilisation, pool and the KV cache the pool leaves
    calibration: dict[str, Any] | None = None  # set when a calibration changed the total
    uncalibrated_total_bytes: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class LlamaCppConfig:
    ctx_size: int | None = None  # None: the model's training context
    parallel: int = 1
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    n_gpu_layers: int = 0  # 0: CPU only; -1 or more than the layers: everything on the GPU
    ubatch_size: int = 512
    flash_attention: bool = True
    split_gpus: int = 1  # GPUs the offloaded layers are split over (llama.cpp's default --split-mode layer)

    # Settings whose loads never calibrate each other: a neighbour's measured ÷ estimated ratio
    # carries over only between loads with the same value. Flash attention changes what the compute
    # buffer holds (without it, the attention scores of a micro-batch over the whole context), so a
    # ratio learnt with it off would inflate — or with it on, shrink — estimates of the other.
    calibration_separate: ClassVar[tuple[str, ...]] = ("flash_attention",)

    def validate(self) -> None:
        problems = {}
        if not 1 <= self.split_gpus <= 16:
            problems["split_gpus"] = "Must be between 1 and 16."
        if self.ctx_size is not None and not 1 <= self.ctx_size <= 10_000_000:
            problems["ctx_size"] = "Must be between 1 and 10,000,000 tokens."
        if not 1 <= self.parallel <= 1024:
            problems["parallel"] = "Must be between 1 and 1024."
        for field in ("cache_type_k", "cache_type_v"):
            if getattr(self, field) not in CACHE_TYPE_BYTES:
                problems[field] = f"One of {', '.join(CACHE_TYPE_BYTES)}."
        if self.n_gpu_layers < -1:
            problems["n_gpu_layers"] = "-1 (all), 0 (none) or a number of layers."
        if not 1 <= self.ubatch_size <= 65536:
            problems["ubatch_size"] = "Must be between 1 and 65,536."
        if problems:
            raise InvalidEstimateRequest("The llama.cpp configuration is invalid.", details=problems)

    def calibration_key(self, shape: ModelShape) -> dict[str, Any]:
        """The configuration that matters for memory, with defaults resolved."""
        return {"ctx_size": _llamacpp_context(shape, self), "parallel": self.parallel,
                "cache_type_k": self.cache_type_k, "cache_type_v": self.cache_type_v,
                "n_gpu_layers": _offloaded_layers(shape, self.n_gpu_layers), "ubatch_size": self.ubatch_size,
                "split_gpus": self.split_gpus, "flash_attention": self.flash_attention}


@dataclasses.dataclass(frozen=True)
class VllmConfig:
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: max(max_model_len, 8192)
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    enforce_eager: bool = False

    calibration_separate: ClassVar[tuple[str, ...]] = ()  # see LlamaCppConfig

    def validate(self) -> None:
        problems = {}
        if self.max_model_len is not None and not 1 <= self.max_model_len <= 10_000_000:
            problems["max_model_len"] = "Must be between 1 and 10,000,000 tokens."
        if not 1 <= self.max_num_seqs <= 4096:
            problems["max_num_seqs"] = "Must be between 1 and 4096."
        if self.kv_cache_dtype not in VLLM_KV_DTYPE_BYTES:
            problems["kv_cache_dtype"] = f"One of {', '.join(VLLM_KV_DTYPE_BYTES)}."
        if self.tensor_parallel_size not in (1, 2, 4, 8, 16):
            problems["tensor_parallel_size"] = "1, 2, 4, 8 or 16."
        if problems:
            raise InvalidEstimateRequest("The vLLM configuration is invalid.", details=problems)

    def calibration_key(self, shape: ModelShape) -> dict[str, Any]:
        return {"max_model_len": self.max_model_len or shape.context_length, "max_num_seqs": self.max_num_seqs,
                "kv_cache_dtype": self.kv_cache_dtype, "tensor_parallel_size": self.tensor_parallel_size,
                "enforce_eager": self.enforce_eager}


def _llamacpp_context(shape: ModelShape, config: LlamaCppConfig) -> int:
    context = config.ctx_size or shape.context_length or 4096
    return math.ceil(context / 256) * 256  # llama.cpp pads the context to 256 cells


def _offloaded_layers(shape: ModelShape, n_gpu_layers: int) -> int:
    """Layers on the GPU; ``layers + 1`` means the output head too (llama.cpp's ``-ngl 99``)."""
    if n_gpu_layers < 0:
        return shape.layers + 1
    return min(n_gpu_layers, shape.layers + 1)


def llamacpp_compute_buffer(shape: ModelShape, config: LlamaCppConfig, context: int) -> int:
    """The graph's reserved compute buffer: the widest step of a full micro-batch (the FFN's
    4 × feed-forward or 3 × (feed-forward + embedding) f32 activations), the attention mask over
    one slot's context (f16), and the logits' share per vocabulary entry."""
    ff = shape.feed_forward or 4 * shape.embedding
    widest = max(4 * ff, 3 * ff + 3 * shape.embedding)
    slot_context = max(1, context // config.parallel)
    mask = config.ubatch_size * 2 * slot_context if config.flash_attention else (
        config.ubatch_size * 4 * slot_context * shape.heads)
    return config.ubatch_size * 4 * widest + mask + 24 * (shape.vocab_size or 0)


def estimate_llamacpp(shape: ModelShape, config: LlamaCppConfig = LlamaCppConfig()) -> Estimate:
    """llama.cpp: weights (offloaded layers on the GPU, the rest on the CPU) + KV cache for
    ``--ctx-size`` (one pool shared by the ``--parallel`` slots, not multiplied) + compute buffer
    + engine overhead."""
    config.validate()
    context = _llamacpp_context(shape, config)
    k_bytes, v_bytes = CACHE_TYPE_BYTES[config.cache_type_k], CACHE_TYPE_BYTES[config.cache_type_v]
    kv_heads = shape.kv_heads
    if shape.kv_lora_rank:
        per_token = shape.kv_bytes_per_token((k_bytes + v_bytes) / 2, context)
        per_layer_token = [per_token / shape.layers] * shape.layers
    else:
        share = 1.0
        if shape.sliding_window and shape.sliding_window_layers:
            share = shape.kv_bytes_per_token(1.0, context) / shape.kv_bytes_per_token(1.0)
        per_layer_token = [kv * (shape.key_length * k_bytes + shape.value_length * v_bytes) * share for kv in kv_heads]
        per_token = sum(per_layer_token)
    offloaded = _offloaded_layers(shape, config.n_gpu_layers)
    gpu_layers = range(shape.layers - min(offloaded, shape.layers), shape.layers)
    compute = llamacpp_compute_buffer(shape, config, context)
    inputs = {
        "architecture": shape.architecture, "layers": shape.layers, "embedding": shape.embedding,
        "heads": shape.heads, "kv_heads": max(kv_heads) if kv_heads else 0, "key_length": shape.key_length,
        "value_length": shape.value_length, "vocab_size": shape.vocab_size, "feed_forward": shape.feed_forward,
        "ctx_size": context, "parallel": config.parallel, "ctx_per_slot": context // config.parallel,
        "cache_type_k": config.cache_type_k, "cache_type_v": config.cache_type_v,
        "kv_bytes_per_token": per_token, "weights_bytes": shape.weights_bytes, "file_bytes": shape.file_bytes,
        "n_gpu_layers": offloaded, "ubatch_size": config.ubatch_size, "compute_buffer_bytes": compute,
        "sliding_window": shape.sliding_window, "weight_type": shape.weight_type,
    }
    host_overhead = (LLAMACPP_HOST_BASE + LLAMACPP_HOST_PER_VOCAB * (shape.vocab_size or 0)
                     + LLAMACPP_HOST_PER_CONTEXT_TOKEN * context + LLAMACPP_HOST_PER_LAYER * shape.layers)
    kv_detail = (f"{shape.layers} layers × {max(kv_heads)} KV heads × ({shape.key_length} + {shape.value_length}) × "
                 f"{config.cache_type_k}/{config.cache_type_v} = {per_token:,.0f} B per token × {context:,} tokens "
                 f"(one pool shared by {config.parallel} slot(s))")
    if offloaded == 0:
        weights = shape.weights_bytes
        kv = round(per_token * context)
        parts = (
            Part("weights", weights, f"every tensor of the model ({shape.weight_type or 'mixed'}), mapped from the file"),
            Part("kv_cache", kv, kv_detail),
            Part("compute", 0, f"the CPU compute buffer ({compute / MIB:,.1f} MiB reserved) is touched as prompts "
                               "need it; its usual share is in the overhead"),
            Part("overhead", host_overhead, "the llama-server process: base, tokenizer tables, slot bookkeeping"),
        )
        total = weights + kv + host_overhead
        return Estimate(engine="llamacpp", device="cpu", weights_bytes=weights, kv_cache_bytes=kv, compute_bytes=0,
                        overhead_bytes=host_overhead, total_bytes=total, host_bytes=0, kv_bytes_per_token=per_token,
                        context_tokens=context, parts=parts, inputs=inputs)
    all_gpu_weights = sum(shape.layer_weights_bytes[i] for i in gpu_layers)
    if offloaded > shape.layers:
        all_gpu_weights += shape.output_weights_bytes
    all_gpu_kv = round(sum(per_layer_token[i] for i in gpu_layers) * context)
    cpu_weights = shape.weights_bytes - all_gpu_weights
    cpu_kv = round(per_token * context) - all_gpu_kv
    # Split over several GPUs (llama.cpp's default --split-mode layer), the offloaded layers go in
    # contiguous runs, one per GPU, the output head with the last; each GPU also has a compute
    # buffer and a CUDA context of its own. The figure is the fullest GPU's: what each must hold.
    layers_on, gpu_weights, gpu_kv = len(gpu_layers), all_gpu_weights, all_gpu_kv
    if config.split_gpus > 1 and len(gpu_layers) > 1:
        run = math.ceil(len(gpu_layers) / config.split_gpus)
        runs = [list(gpu_layers)[i:i + run] for i in range(0, len(gpu_layers), run)]
        shares = [(sum(shape.layer_weights_bytes[i] for i in part)
                   + (shape.output_weights_bytes if offloaded > shape.layers and part is runs[-1] else 0),
                   round(sum(per_layer_token[i] for i in part) * context), len(part)) for part in runs]
        gpu_weights, gpu_kv, layers_on = max(shares, key=lambda share: share[0] + share[1])
        inputs["split_gpus"] = config.split_gpus
    total = gpu_weights + gpu_kv + compute + LLAMACPP_DEVICE_OVERHEAD
    notes = ()
    if offloaded <= shape.layers:
        notes = (f"{shape.layers - len(gpu_layers)} layer(s) stay on the CPU: slower, and they need host memory.",)
    where = f" on the fullest of {config.split_gpus} GPUs" if layers_on < len(gpu_layers) else " on the GPU"
    parts = (
        Part("weights", gpu_weights, f"{layers_on} of {shape.layers} layers"
                                     + (" and the output head" if offloaded > shape.layers else "") + where),
        Part("kv_cache", gpu_kv, kv_detail + f", for the {layers_on} offloaded layers" + where),
        Part("compute", compute, f"the graph's compute buffer for micro-batches of {config.ubatch_size} tokens"),
        Part("overhead", LLAMACPP_DEVICE_OVERHEAD, "CUDA context and cuBLAS workspace"),
    )
    return Estimate(engine="llamacpp", device="gpu", weights_bytes=gpu_weights, kv_cache_bytes=gpu_kv,
                    compute_bytes=compute, overhead_bytes=LLAMACPP_DEVICE_OVERHEAD, total_bytes=total,
                    host_bytes=cpu_weights + cpu_kv + host_overhead, kv_bytes_per_token=per_token,
                    context_tokens=context, parts=parts, inputs=inputs, notes=notes)


def vllm_utilisation(reservation_bytes: int, memory_total_bytes: int) -> float:
    """vLLM's ``--gpu-memory-utilization`` for a reservation: the card's share, rounded up to 1 %."""
    if memory_total_bytes <= 0:
        raise InvalidEstimateRequest("The card's memory total must be known to size vLLM's pool.")
    return math.ceil(reservation_bytes * 100 / memory_total_bytes) / 100


def estimate_vllm(shape: ModelShape, config: VllmConfig = VllmConfig(),
                  memory_total_bytes: int | None = None) -> Estimate:
    """vLLM: weights + KV for ``max_model_len × max_num_seqs`` (the worst case) + activations of
    the profiling batch + CUDA graphs + memory outside PyTorch, per GPU of the tensor-parallel group.

    vLLM's pool is ``--gpu-memory-utilization`` of the card; with ``memory_total_bytes`` the
    estimate says which utilisation matches the reservation and how many tokens of KV cache the
    pool then leaves.
    """
    config.validate()
    tp = config.tensor_parallel_size
    max_len = config.max_model_len or shape.context_length or 4096
    kv_dtype = VLLM_KV_DTYPE_BYTES[config.kv_cache_dtype] or shape.dtype_bytes
    per_token = shape.kv_bytes_per_token(kv_dtype, max_len) / tp
    weights = math.ceil(shape.weights_bytes / tp)
    kv = math.ceil(per_token * max_len * config.max_num_seqs)
    batched = config.max_num_batched_tokens or max(max_len, 8192)
    ff = shape.feed_forward or 4 * shape.embedding
    # The profiling forward pass: the widest activations of one layer for the whole batch (f16)
    # plus the sampler's logits (f32) for every sequence.
    activation = math.ceil(batched * (2 * ff / tp + 4 * shape.embedding) * shape.dtype_bytes
                           + config.max_num_seqs * (shape.vocab_size or 0) * 4)
    graphs = 0 if config.enforce_eager else VLLM_CUDA_GRAPHS
    overhead = VLLM_NON_TORCH + graphs
    total = weights + kv + activation + overhead
    inputs = {
        "architecture": shape.architecture, "layers": shape.layers, "kv_heads": max(shape.kv_heads),
        "key_length": shape.key_length, "value_length": shape.value_length, "kv_lora_rank": shape.kv_lora_rank,
        "sliding_window": shape.sliding_window, "max_model_len": max_len, "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": batched, "kv_cache_dtype": config.kv_cache_dtype, "kv_dtype_bytes": kv_dtype,
        "tensor_parallel_size": tp, "kv_bytes_per_token": per_token, "weights_bytes": shape.weights_bytes,
        "enforce_eager": config.enforce_eager,
    }
    parts = (
        Part("weights", weights, f"safetensors/GGUF tensors{f' ÷ {tp} GPUs' if tp > 1 else ''}"),
        Part("kv_cache", kv, f"{per_token:,.0f} B per token × max_model_len {max_len:,} × max_num_seqs "
                             f"{config.max_num_seqs} (every sequence at full length)"),
        Part("compute", activation, f"activations of a {batched:,}-token profiling batch and the sampler's logits"),
        Part("overhead", overhead, "memory outside PyTorch's pool" + ("" if config.enforce_eager else " and CUDA graphs")),
    )
    vllm = None
    notes: tuple[str, ...] = ()
    if memory_total_bytes:
        utilisation = vllm_utilisation(total, memory_total_bytes)
        pool = math.floor(utilisation * memory_total_bytes)
        kv_room = max(0, pool - weights - activation - overhead)
        kv_tokens = int(kv_room // per_token) if per_token else 0
        vllm = {"gpu_memory_utilization": utilisation, "pool_bytes": pool, "kv_cache_bytes": kv_room,
                "kv_cache_tokens": kv_tokens, "full_length_sequences": kv_tokens // max_len if max_len else 0,
                "memory_total_bytes": memory_total_bytes}
        if utilisation > 1:
            notes = (f"The reservation is {utilisation:.0%} of the card: it does not fit on one GPU.",)
        else:
            notes = (f"--gpu-memory-utilization {utilisation:.2f} leaves {kv_room / GIB:,.2f} GiB of KV cache: "
                     f"{kv_tokens:,} tokens ({kv_tokens // max_len} sequences at max_model_len).",)
    return Estimate(engine="vllm", device="gpu", weights_bytes=weights, kv_cache_bytes=kv, compute_bytes=activation,
                    overhead_bytes=overhead, total_bytes=total, kv_bytes_per_token=per_token, context_tokens=max_len,
                    parts=parts, inputs=inputs, notes=notes, vllm=vllm)
