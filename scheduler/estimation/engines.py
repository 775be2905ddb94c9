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
# holds beyond weights, KV cache, compute and work buffers, measured with VmHWM on the llama-server
# this project builds after prompts that fill its slots (`manage.py bench_estimates` re-measures
# it): a fixed base (binary, threads, HTTP server), the tokenizer's tables per vocabulary entry,
# per context token what the server keeps of a prompt and its slots, graph metadata per layer.
LLAMACPP_HOST_BASE = 17_970_000
LLAMACPP_HOST_PER_VOCAB = 385
LLAMACPP_HOST_PER_CONTEXT_TOKEN = 262
LLAMACPP_HOST_PER_LAYER = 37 * 1024
# Without flash attention the attention scores' work buffer grows with each micro-batch of a prompt
# (the cache fills) and glibc keeps part of the superseded ones in its heap: on average a quarter
# more, measured (between none and a half of it from shape to shape).
LLAMACPP_CPU_SCORES_RETAINED = 0.25
# x86-64 builds of ggml's CPU backend with AVX2 (this project's portable build has it; AVX-512 is
# off, so Q2_K is not among them) repack the matrices of these weight types into a second,
# interleaved copy at load ("CPU_REPACK" buffers, ggml/src/ggml-cpu/repack.cpp) while the file
# mapping they were read from stays resident.
LLAMACPP_CPU_REPACK_TYPES = frozenset({"Q4_0", "Q4_K", "IQ4_NL", "MXFP4"})
# Sliding windows as llama.cpp's loader applies them (src/models/<arch>.cpp, load_arch_hparams, in
# the release serving.engines.build_llamacpp pins): architecture → (every n-th layer keeps the
# full context unless the header's pattern says otherwise, whether that layer leads its period,
# the window where the header gives none). Every other architecture keeps every layer's full
# cache whatever window its header names: llama, qwen2 and mistral ignore it, phi3 turns its own
# off ("Phi SWA is currently disabled"); exaone4 slides only in its 64-layer model.
_LLAMACPP_SWA = {
    "gemma2": (2, False, 4096), "gemma3": (6, False, None), "cohere2": (4, False, None),
    "cohere2moe": (4, True, None), "gpt-oss": (2, False, None), "olmo2": (4, False, None),
    "afmoe": (4, False, None), "mellum": (4, False, None), "plamo3": (8, False, None),
    "laguna": (4, True, None), "exaone-moe": (4, False, 128), "muse-glimmer": (4, False, None),
    "llama4": (4, False, 8192), "smallthinker": (4, True, 4096),
}
# Architectures whose sliding layers are the header's per-layer flags and nothing else.
_LLAMACPP_SWA_FROM_HEADER = frozenset({"gemma4", "granite_swa", "maple", "mimo2", "step35", "spark2_5", "dots3note"})
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
    swa_full: bool = False  # --swa-full: sliding-window layers keep the whole context (and no checkpoints)
    # Checkpoints of a slot's sliding-window cache the estimate counts: llama-server makes two near
    # the end of each prompt and keeps up to --ctx-checkpoints (32 by default) across requests.
    ctx_checkpoints: int = 2

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
        if not 0 <= self.ctx_checkpoints <= 1024:
            problems["ctx_checkpoints"] = "Must be between 0 and 1024."
        if problems:
            raise InvalidEstimateRequest("The llama.cpp configuration is invalid.", details=problems)

    def calibration_key(self, shape: ModelShape) -> dict[str, Any]:
        """The configuration that matters for memory, with defaults resolved."""
        return {"ctx_size": _llamacpp_context(shape, self), "parallel": self.parallel,
                "cache_type_k": self.cache_type_k, "cache_type_v": self.cache_type_v,
                "n_gpu_layers": _offloaded_layers(shape, self.n_gpu_layers), "ubatch_size": self.ubatch_size,
                "split_gpus": self.split_gpus, "flash_attention": self.flash_attention,
                # Only where they differ from the default, so that earlier records keep matching.
                **({"swa_full": True} if self.swa_full else {}),
                **({"ctx_checkpoints": self.ctx_checkpoints} if self.ctx_checkpoints != 2 else {})}


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


def _pad(cells: int) -> int:
    return -(-cells // 256) * 256  # llama.cpp pads contexts and caches to 256 cells


def llamacpp_context(shape: ModelShape, config: LlamaCppConfig) -> tuple[int, int]:
    """(cells per slot, cells in all) of the KV pool: llama.cpp pads ``-c`` to 256 cells and gives
    each ``--parallel`` slot its share padded to 256 again, so the pool can come out larger than
    asked (4096 over 3 slots: 3 × 1536)."""
    context = _pad(config.ctx_size or shape.context_length or 4096)
    per_slot = max(256, _pad(context // config.parallel))
    return per_slot, per_slot * config.parallel


def _llamacpp_context(shape: ModelShape, config: LlamaCppConfig) -> int:
    return llamacpp_context(shape, config)[1]


def llamacpp_sliding_window(shape: ModelShape) -> tuple[int, tuple[bool, ...]]:
    """(window, per-layer flags: True where the layer attends within the window only) as
    llama.cpp applies them to this header; (0, ()) where every layer keeps the full context."""
    arch, header, pattern = shape.architecture, shape.sliding_window, shape.sliding_window_pattern
    if arch in _LLAMACPP_SWA_FROM_HEADER:
        rule = (0, False, None)
        if not isinstance(pattern, tuple):
            return 0, ()
    elif arch == "exaone4":
        rule = (4, False, 4096) if shape.layers == 64 else None  # only the 32B slides
    else:
        rule = _LLAMACPP_SWA.get(arch)
    if rule is None:
        return 0, ()
    period, dense_first, default = rule
    if arch == "llama4":  # chunked attention of 8192 whatever the header says; a window of 0 turns it off
        window = 0 if header == 0 else 8192
    elif arch == "smallthinker":  # 4096 whatever the header says, where it gives one
        window = 4096 if header else 0
    else:
        window = header if header is not None else (default or 0)
    if not window:
        return 0, ()
    if isinstance(pattern, tuple):
        flags = tuple(bool(pattern[i]) if i < len(pattern) else False for i in range(shape.layers))
    else:
        n = pattern if isinstance(pattern, int) else period
        flags = tuple(n == 0 or (i % n != 0 if dense_first else i % n < n - 1) for i in range(shape.layers))
    return (window, flags) if any(flags) else (0, ())


def _offloaded_layers(shape: ModelShape, n_gpu_layers: int) -> int:
    """Layers on the GPU; ``layers + 1`` means the output head too (llama.cpp's ``-ngl 99``)."""
    if n_gpu_layers < 0:
        return shape.layers + 1
    return min(n_gpu_layers, shape.layers + 1)


def llamacpp_compute_buffer(shape: ModelShape, config: LlamaCppConfig, caches: tuple[int, ...]) -> int:
    """The graph's reserved compute buffer for micro-batches of ``ubatch_size`` tokens over KV
    caches of ``caches`` cells per slot (the full one, and the sliding window's where there is
    one): the widest step of the feed-forward in f32 activations (as llama.cpp's graph allocator
    comes out on such graphs: 3 × (width + embedding) up to a width of twice the embedding, else 4 ×
    the width or 3 × the width + 4 × the embedding; with experts, 3 × the routed experts' widths or
    their outputs, and 4 × the embedding), or without flash attention
    the attention scores of every query head over the fullest cache (f32) where they are wider;
    a mask per cache (f16 with flash attention, else f32); the logits' share per vocabulary entry."""
    embedding, ubatch = shape.embedding, config.ubatch_size
    if shape.experts and shape.experts_used:
        # The routed experts' activations side by side, or their outputs before they are summed.
        width = shape.experts_used * (shape.expert_feed_forward or shape.feed_forward or 4 * embedding)
        widest = max(3 * width, shape.experts_used * embedding) + 4 * embedding
    else:
        width = shape.feed_forward or 4 * embedding
        widest = 3 * width + 3 * embedding if width <= 2 * embedding else max(4 * width, 3 * width + 4 * embedding)
    if not config.flash_attention:
        widest = max(widest, shape.heads * max(caches) + 7 * embedding)
    masks = ubatch * (2 if config.flash_attention else 4) * sum(caches)
    return ubatch * 4 * widest + masks + 24 * (shape.vocab_size or 0)


def llamacpp_mapped_bytes(shape: ModelShape) -> int:
    """What stays mapped of the file on a CPU: llama.cpp keeps the span from the first to the last
    tensor it reads in place and unmaps the rest once loaded — repacked tensors at either end (they
    live in their copy). Between the two, repacked tensors stay mapped beside their copy."""
    if not shape.tensor_layout:
        return shape.weights_bytes
    in_place = [i for i, (_, kind, _, multiplied) in enumerate(shape.tensor_layout)
                if not (multiplied and kind in LLAMACPP_CPU_REPACK_TYPES)]
    if not in_place:
        return 0
    return sum(size for _, _, size, _ in shape.tensor_layout[in_place[0]:in_place[-1] + 1])


def _activation_bytes(kind: str) -> float:
    """Bytes per value a matrix multiplication converts its activations to for weights of ``kind``
    (ggml's vec_dot_type): f16 or bf16 beside 16-bit weights, q8_K beside K-quants, q8_0 beside
    the other block types, none beside f32."""
    if kind in ("F32", "F64"):
        return 0.0
    if kind in ("F16", "BF16"):
        return 2.0
    return 292 / 256 if kind.endswith("_K") else 34 / 32


def llamacpp_work_buffer(shape: ModelShape, config: LlamaCppConfig, caches: tuple[int, ...]) -> int:
    """The work buffer beside the compute buffer (the CPU backend's, one for the whole graph, sized
    by its widest step): the activations of a micro-batch converted for the weights' type, as wide
    as the widest input of a multiplication; without flash attention, the attention scores
    converted to f16 to be multiplied by V, usually wider."""
    embedding = shape.embedding
    if shape.experts and shape.experts_used:
        width = shape.experts_used * (shape.expert_feed_forward or shape.feed_forward or 4 * embedding)
    else:
        width = shape.feed_forward or 4 * embedding
    width = max(width, embedding, shape.heads * shape.value_length)
    kinds = {kind for _, kind, _, multiplied in shape.tensor_layout if multiplied} or {shape.weight_type.upper()}
    converted = config.ubatch_size * width * max(_activation_bytes(kind) for kind in kinds)
    scores = 0 if config.flash_attention else config.ubatch_size * 2 * shape.heads * max(caches)
    return round(max(converted, scores * (1 + LLAMACPP_CPU_SCORES_RETAINED)))


def estimate_llamacpp(shape: ModelShape, config: LlamaCppConfig = LlamaCppConfig()) -> Estimate:
    """llama.cpp: weights (offloaded layers on the GPU, the rest on the CPU, where some weight
    types are repacked into a second copy) + KV cache (one pool of ``--ctx-size`` cells shared
    by the ``--parallel`` slots, not multiplied; sliding-window layers hold the window and a
    micro-batch) + compute buffer + engine overhead (with a sliding window, the checkpoints the
    server keeps of the window's cache)."""
    config.validate()
    per_slot, context = llamacpp_context(shape, config)
    window, sliding = llamacpp_sliding_window(shape)
    swa_per_slot = 0
    if window:
        swa_per_slot = per_slot if config.swa_full else _pad(min(per_slot, window + config.ubatch_size))
    k_bytes, v_bytes = CACHE_TYPE_BYTES[config.cache_type_k], CACHE_TYPE_BYTES[config.cache_type_v]
    kv_heads = shape.kv_heads
    if shape.kv_lora_rank:
        per_layer_token = [shape.kv_bytes_per_token((k_bytes + v_bytes) / 2) / shape.layers] * shape.layers
    else:
        per_layer_token = [kv * (shape.key_length * k_bytes + shape.value_length * v_bytes) for kv in kv_heads]
    cells = [swa_per_slot * config.parallel if sliding and sliding[i] else context for i in range(shape.layers)]
    per_layer_kv = [per_layer_token[i] * cells[i] for i in range(shape.layers)]
    per_token = sum(per_layer_kv) / context  # on average over the context, windows included
    caches = (per_slot, swa_per_slot) if swa_per_slot and not all(sliding) else (swa_per_slot or per_slot,)
    # The server checkpoints a slot's sliding-window cache (the window and the token after it, per
    # sliding layer) near the end of each prompt it processes, keeping them across requests.
    checkpoint = 0
    if window and not config.swa_full and config.ctx_checkpoints:
        checkpoint = round(sum(per_layer_token[i] for i in range(shape.layers) if sliding[i])
                           * min(window + 1, swa_per_slot))
    checkpoints = checkpoint * config.ctx_checkpoints * config.parallel
    offloaded = _offloaded_layers(shape, config.n_gpu_layers)
    gpu_layers = range(shape.layers - min(offloaded, shape.layers), shape.layers)
    compute = llamacpp_compute_buffer(shape, config, caches) + llamacpp_work_buffer(shape, config, caches)
    on_cpu = set(range(shape.layers)) - set(gpu_layers)
    if offloaded <= shape.layers:
        on_cpu.add(-1)  # the output head stays with the CPU layers
    repacked = sum(size for index, kind, size in shape.matrix_weights
                   if index in on_cpu and kind in LLAMACPP_CPU_REPACK_TYPES)
    mapped = llamacpp_mapped_bytes(shape) if offloaded == 0 and repacked else shape.weights_bytes
    inputs = {
        "architecture": shape.architecture, "layers": shape.layers, "embedding": shape.embedding,
        "heads": shape.heads, "kv_heads": max(kv_heads) if kv_heads else 0, "key_length": shape.key_length,
        "value_length": shape.value_length, "vocab_size": shape.vocab_size, "feed_forward": shape.feed_forward,
        "ctx_size": context, "parallel": config.parallel, "ctx_per_slot": per_slot,
        "cache_type_k": config.cache_type_k, "cache_type_v": config.cache_type_v,
        "kv_bytes_per_token": per_token, "weights_bytes": shape.weights_bytes, "file_bytes": shape.file_bytes,
        "n_gpu_layers": offloaded, "ubatch_size": config.ubatch_size, "compute_buffer_bytes": compute,
        "flash_attention": config.flash_attention, "sliding_window": window or None,
        "sliding_layers": sum(sliding), "swa_cells_per_slot": swa_per_slot or None,
        "repacked_bytes": repacked, "weight_type": shape.weight_type,
        "experts": shape.experts or None, "experts_used": shape.experts_used or None,
    }
    host_overhead = (LLAMACPP_HOST_BASE + LLAMACPP_HOST_PER_VOCAB * (shape.vocab_size or 0)
                     + LLAMACPP_HOST_PER_CONTEXT_TOKEN * context + LLAMACPP_HOST_PER_LAYER * shape.layers)
    kv_detail = (f"{shape.layers} layers × {max(kv_heads)} KV heads × ({shape.key_length} + {shape.value_length}) × "
                 f"{config.cache_type_k}/{config.cache_type_v} × {context:,} cells (one pool shared by "
                 f"{config.parallel} slot(s) of {per_slot:,})")
    if swa_per_slot:
        kv_detail += (f"; {sum(sliding)} sliding-window layer(s) hold {swa_per_slot:,} cells per slot "
                      f"(window {window:,} + a micro-batch)" + (", full size (--swa-full)" if config.swa_full else ""))
    elif shape.sliding_window:
        kv_detail += f"; llama.cpp keeps the full context in every layer of {shape.architecture} (its window is unused)"
    attention = "flash attention" if config.flash_attention else (
        f"no flash attention: the scores of {shape.heads} heads over {max(caches):,} cells")
    compute_detail = f"the graph's compute buffer for micro-batches of {config.ubatch_size} tokens ({attention})"
    repacked_types = sorted({kind for _, kind, _ in shape.matrix_weights} & LLAMACPP_CPU_REPACK_TYPES)
    repack_detail = (f"a repacked copy of the {', '.join(repacked_types)} matrices for the CPU's kernels; "
                     "the file mapping stays resident beside it")
    checkpoint_detail = (f"{config.ctx_checkpoints} checkpoint(s) of the sliding-window cache per slot × "
                         f"{config.parallel} slot(s), {checkpoint:,} B each")
    if offloaded == 0:
        weights = mapped
        kv = round(sum(per_layer_kv))
        weights_detail = f"every tensor of the model ({shape.weight_type or 'mixed'}), mapped from the file"
        if mapped < shape.weights_bytes:
            weights_detail += (f", less {shape.weights_bytes - mapped:,} B of repacked tensors at its ends "
                               "(llama.cpp unmaps them once they are copied)")
        parts = [
            Part("weights", weights, weights_detail),
            Part("kv_cache", kv, kv_detail),
            Part("compute", compute, compute_detail + ", touched in full by prompts that fill a micro-batch"),
            Part("overhead", host_overhead, "the llama-server process: base, tokenizer tables, slot bookkeeping"),
        ]
        if repacked:
            parts.insert(1, Part("repacked", repacked, repack_detail))
        if checkpoints:
            parts.append(Part("checkpoints", checkpoints, checkpoint_detail))
        total = weights + repacked + kv + compute + host_overhead + checkpoints
        return Estimate(engine="llamacpp", device="cpu", weights_bytes=weights + repacked, kv_cache_bytes=kv,
                        compute_bytes=compute, overhead_bytes=host_overhead + checkpoints, total_bytes=total,
                        host_bytes=0, kv_bytes_per_token=per_token, context_tokens=context, parts=tuple(parts),
                        inputs=inputs)
    all_gpu_weights = sum(shape.layer_weights_bytes[i] for i in gpu_layers)
    if offloaded > shape.layers:
        all_gpu_weights += shape.output_weights_bytes
    all_gpu_kv = round(sum(per_layer_kv[i] for i in gpu_layers))
    cpu_weights = shape.weights_bytes - all_gpu_weights + repacked
    cpu_kv = round(sum(per_layer_kv)) - all_gpu_kv
    # Split over several GPUs (llama.cpp's default --split-mode layer), the offloaded layers go in
    # contiguous runs, one per GPU, the output head with the last; each GPU also has a compute
    # buffer and a CUDA context of its own. The figure is the fullest GPU's: what each must hold.
    layers_on, gpu_weights, gpu_kv = len(gpu_layers), all_gpu_weights, all_gpu_kv
    if config.split_gpus > 1 and len(gpu_layers) > 1:
        run = math.ceil(len(gpu_layers) / config.split_gpus)
        runs = [list(gpu_layers)[i:i + run] for i in range(0, len(gpu_layers), run)]
        shares = [(sum(shape.layer_weights_bytes[i] for i in part)
                   + (shape.output_weights_bytes if offloaded > shape.layers and part is runs[-1] else 0),
                   round(sum(per_layer_kv[i] for i in part)), len(part)) for part in runs]
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
        Part("compute", compute, compute_detail),
        Part("overhead", LLAMACPP_DEVICE_OVERHEAD, "CUDA context and cuBLAS workspace"),
    )
    # Checkpoints are copies in host memory, whatever device the cache is on.
    return Estimate(engine="llamacpp", device="gpu", weights_bytes=gpu_weights, kv_cache_bytes=gpu_kv,
                    compute_bytes=compute, overhead_bytes=LLAMACPP_DEVICE_OVERHEAD, total_bytes=total,
                    host_bytes=cpu_weights + cpu_kv + host_overhead + checkpoints, kv_bytes_per_token=per_token,
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
