"""What an estimate needs to know about a model, whatever file format it came from."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelShape:
    source: str  # "gguf" or "safetensors"
    architecture: str
    name: str
    layers: int
    embedding: int
    heads: int
    kv_heads: tuple[int, ...]  # per layer (GQA; some models vary it by layer)
    key_length: int
    value_length: int
    context_length: int | None
    vocab_size: int | None
    feed_forward: int | None
    weights_bytes: int  # every tensor
    layer_weights_bytes: tuple[int, ...]  # per block
    input_weights_bytes: int  # token embeddings (llama.cpp keeps them on the CPU)
    output_weights_bytes: int  # norm + output head (offloaded with the last layer)
    file_bytes: int
    weight_type: str = ""  # "Q4_1", "F16", "BF16", ...
    sliding_window: int | None = None
    sliding_window_layers: int = 0  # how many layers attend only within the window
    # The pattern as the GGUF header gives it (every n-th layer global, or per-layer flags: True
    # slides); None when absent, where llama.cpp applies its per-architecture default.
    sliding_window_pattern: int | tuple[bool, ...] | None = None
    experts: int = 0  # mixture of experts: experts per MoE layer (every one of them is in the weights)
    experts_used: int = 0  # routed per token
    expert_feed_forward: int | None = None  # per expert, where the header gives it apart
    # GGUF: the weight matrices a CPU backend may repack for its kernels (multiplied, 2-D or stacked
    # experts, rows a multiple of 8): (block index, or -1 for the output head; GGML type; bytes),
    # summed by block and type. A head tied to the token embeddings is listed as the head.
    matrix_weights: tuple[tuple[int, str, int], ...] = ()
    # GGUF: every tensor in the order of the file's data: (block index, -1 for the output head, -2
    # for the rest; GGML type; bytes; whether it is one of the matrices above).
    tensor_layout: tuple[tuple[int, str, int, bool], ...] = ()
    kv_lora_rank: int | None = None  # MLA (DeepSeek V2/V3): the cache holds a compressed latent
    rope_head_dim: int | None = None
    dtype_bytes: float = 2.0  # of the unquantised weights/activations (vLLM "auto" KV dtype)
    model_key: str = ""  # identifies the model files for calibration
    # GGUF: where the last tensor's data ends; beyond ``file_bytes`` the file was cut short (None: not known)
    data_end_bytes: int | None = None

    def kv_bytes_per_token(self, cache_bytes: float, context: int | None = None) -> float:
        """Bytes of K and V cache per token of context, across layers.

        Standard attention: Σ layers × KV heads × (key length + value length) × bytes of the
        cache type. Sliding-window layers hold at most ``sliding_window`` tokens, so for a given
        context they count in proportion. MLA caches one latent of ``kv_lora_rank + rope dim``.
        """
        if self.kv_lora_rank:
            return self.layers * (self.kv_lora_rank + (self.rope_head_dim or 0)) * cache_bytes
        per_layer = [kv * (self.key_length + self.value_length) * cache_bytes for kv in self.kv_heads]
        if not self.sliding_window or not self.sliding_window_layers or not context:
            return sum(per_layer)
        full = self.layers - self.sliding_window_layers
        average = sum(per_layer) / self.layers
        window_share = min(1.0, self.sliding_window / context)
        return average * (full + self.sliding_window_layers * window_share)
