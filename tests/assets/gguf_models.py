"""Small real GGUF models, generated for whatever shape a test asks for.

The ``gguf`` package writes a valid file with random weights in a fraction of a second;
llama-server loads and serves it, and every header reader sees the shape it was given. Layouts:
``llama`` (dense, or a Mixtral-style mixture of experts with ``experts``), ``qwen2`` (biased
projections), ``phi3`` (fused QKV and gate+up) and ``gemma3`` (Q/K norms, post-norms, the output
head tied to the token embeddings), each with an optional sliding window and pattern. Weights are
F16/F32, or quantised: Q4_0 and Q8_0 by the ``gguf`` package, Q4_K and Q6_K as random blocks with
small scales, and ``q4_k_m`` mixing them as llama-quantize's Q4_K_M does. They are the cheapest real
models there are: use them wherever a test needs a model and does not care what it says.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np

# A tiny SentencePiece-style vocabulary: control tokens, the 256 byte-fallback tokens (so any
# text tokenizes) and a few word pieces.
_CONTROL = ["<unk>", "<s>", "</s>"]
_PIECES = ["▁", "▁the", "▁a", "▁hello", "▁world", "e", "t", "a", "o", "n", "s", "▁is", "."]

Q = gguf.GGMLQuantizationType
# Weight types by name: (the type of most matrices, the type llama-quantize gives the output head,
# attn_v and ffn_down where Q4_K_M spends more bits, the file type written in the header).
_WEIGHT_TYPES = {
    "f16": (Q.F16, Q.F16, gguf.LlamaFileType.MOSTLY_F16),
    "f32": (Q.F32, Q.F32, gguf.LlamaFileType.ALL_F32),
    "q8_0": (Q.Q8_0, Q.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (Q.Q4_0, Q.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
    "q4_k": (Q.Q4_K, Q.Q4_K, gguf.LlamaFileType.MOSTLY_Q4_K_S),
    "q6_k": (Q.Q6_K, Q.Q6_K, gguf.LlamaFileType.MOSTLY_Q6_K),
    "q4_k_m": (Q.Q4_K, Q.Q6_K, gguf.LlamaFileType.MOSTLY_Q4_K_M),
}
ARCHITECTURES = ("llama", "qwen2", "phi3", "gemma3")


@dataclasses.dataclass(frozen=True)
class ModelShape:
    architecture: str = "llama"  # another name writes the llama layout under that name
    layers: int = 2
    embedding: int = 64
    heads: int = 4
    kv_heads: int = 2
    feed_forward: int = 128  # per expert with ``experts``
    context: int = 512
    key_length: int | None = None  # per-head key width; defaults to embedding / heads
    value_length: int | None = None
    weight_type: str = "f16"  # one of _WEIGHT_TYPES
    name: str = "berth-test-model"
    sliding_window: int | None = None  # written as {arch}.attention.sliding_window
    # {arch}.attention.sliding_window_pattern: every n-th layer global (int) or per-layer flags
    # (True: the layer slides). None: not written (llama.cpp's per-architecture default applies).
    sliding_window_pattern: int | tuple[bool, ...] | None = None
    experts: int = 0  # llama layout: a mixture of experts (router + stacked expert tensors)
    experts_used: int = 2

    def __post_init__(self):
        if self.embedding % self.heads:
            raise ValueError("embedding must be a multiple of heads")
        if self.heads % self.kv_heads:
            raise ValueError("heads must be a multiple of kv_heads")
        if self.weight_type not in _WEIGHT_TYPES:
            raise ValueError(f"weight_type must be one of {', '.join(_WEIGHT_TYPES)}")
        if self.experts and self.architecture != "llama":
            raise ValueError("experts are written in the llama layout only")
        if self.experts and not 0 < self.experts_used <= self.experts:
            raise ValueError("experts_used must be between 1 and experts")

    @property
    def head_dim(self) -> int:
        return self.embedding // self.heads

    @property
    def vocab_size(self) -> int:
        return len(_CONTROL) + 256 + len(_PIECES)


def _random_blocks(rng: np.random.Generator, rows: int, columns: int, qtype) -> np.ndarray:
    """Random K-quant blocks whose values stay small: random quants and sub-block scales, a small
    f16 super-block scale (Q4_K: d, dmin first; Q6_K: d last)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, columns // block, size), dtype=np.uint8)
    scale = np.full((rows, columns // block), 2e-4 if qtype == Q.Q4_K else 2e-5, dtype=np.float16).view(np.uint8)
    if qtype == Q.Q4_K:
        blocks[..., 0:2] = scale.reshape(rows, -1, 2)
        blocks[..., 2:4] = scale.reshape(rows, -1, 2)
    else:
        blocks[..., size - 2:size] = scale.reshape(rows, -1, 2)
    return blocks.reshape(rows, columns // block * size)


def write_gguf(path: Path, shape: ModelShape = ModelShape(), seed: int = 0) -> Path:
    """Write a GGUF model of ``shape`` to ``path`` and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    main_type, more_bits_type, file_type = _WEIGHT_TYPES[shape.weight_type]
    arch = shape.architecture
    key_len = shape.key_length or shape.head_dim
    value_len = shape.value_length or shape.head_dim

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(shape.name)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.embedding)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.feed_forward)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    if shape.key_length is not None:
        writer.add_key_length(key_len)
    if shape.value_length is not None:
        writer.add_value_length(value_len)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(key_len)
    if shape.sliding_window is not None:
        writer.add_sliding_window(shape.sliding_window)
    if shape.sliding_window_pattern is not None:
        writer.add_sliding_window_pattern(shape.sliding_window_pattern)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
    writer.add_file_type(file_type)

    tokens = _CONTROL + [f"<0x{b:02X}>" for b in range(256)] + _PIECES
    types = ([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
             + [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * len(_PIECES))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(_PIECES))])
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)

    def tensor(name: str, *dims: int, norm: bool = False, qtype=None) -> None:
        # numpy's shape is GGUF's dims reversed: (rows, columns) = (out, in); experts stack first.
        qtype = Q.F32 if norm else (qtype or main_type)
        if qtype in (Q.Q4_K, Q.Q6_K):
            *stack, rows, columns = dims
            if columns % 256:
                raise ValueError(f"{name}: {qtype.name} needs rows of a multiple of 256 values, not {columns}")
            blocks = _random_blocks(rng, int(np.prod(stack or [1])) * rows, columns, qtype)
            writer.add_tensor(name, blocks.reshape(*stack, rows, -1), raw_dtype=qtype)
            return
        data = np.ones(dims, dtype=np.float32) if norm else rng.normal(0, 0.02, size=dims).astype(np.float32)
        if qtype in (Q.F32, Q.F16):
            writer.add_tensor(name, data if qtype == Q.F32 else data.astype(np.float16))
        else:
            if dims[-1] % 32:
                raise ValueError(f"{name}: {qtype.name} needs rows of a multiple of 32 values, not {dims[-1]}")
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    def more_bits(layer: int) -> bool:  # llama-quantize's use_more_bits for Q4_K_M
        n = shape.layers
        return layer < n // 8 or layer >= 7 * n // 8 or (layer - n // 8) % 3 == 2

    n_vocab, n_embd, n_ff = shape.vocab_size, shape.embedding, shape.feed_forward
    tensor("token_embd.weight", n_vocab, n_embd)
    tensor("output_norm.weight", n_embd, norm=True)
    if arch != "gemma3":  # gemma3's output head is the token embedding, as in the released models
        tensor("output.weight", n_vocab, n_embd, qtype=more_bits_type)
    for i in range(shape.layers):
        block = f"blk.{i}"
        v_type = more_bits_type if more_bits(i) else main_type
        tensor(f"{block}.attn_norm.weight", n_embd, norm=True)
        if arch == "phi3":
            tensor(f"{block}.attn_qkv.weight", shape.heads * key_len + 2 * shape.kv_heads * key_len, n_embd)
        else:
            tensor(f"{block}.attn_q.weight", shape.heads * key_len, n_embd)
            tensor(f"{block}.attn_k.weight", shape.kv_heads * key_len, n_embd)
            tensor(f"{block}.attn_v.weight", shape.kv_heads * value_len, n_embd, qtype=v_type)
        tensor(f"{block}.attn_output.weight", n_embd, shape.heads * value_len)
        if arch == "qwen2":  # qwen2 adds biases to the projections
            tensor(f"{block}.attn_q.bias", shape.heads * key_len, norm=True)
            tensor(f"{block}.attn_k.bias", shape.kv_heads * key_len, norm=True)
            tensor(f"{block}.attn_v.bias", shape.kv_heads * value_len, norm=True)
        if arch == "gemma3":
            tensor(f"{block}.attn_q_norm.weight", key_len, norm=True)
            tensor(f"{block}.attn_k_norm.weight", key_len, norm=True)
            tensor(f"{block}.post_attention_norm.weight", n_embd, norm=True)
        tensor(f"{block}.ffn_norm.weight", n_embd, norm=True)
        if shape.experts:
            tensor(f"{block}.ffn_gate_inp.weight", shape.experts, n_embd, qtype=Q.F32)  # the router stays F32
            tensor(f"{block}.ffn_gate_exps.weight", shape.experts, n_ff, n_embd)
            tensor(f"{block}.ffn_up_exps.weight", shape.experts, n_ff, n_embd)
            tensor(f"{block}.ffn_down_exps.weight", shape.experts, n_embd, n_ff, qtype=v_type)
        elif arch == "phi3":
            tensor(f"{block}.ffn_up.weight", 2 * n_ff, n_embd)  # gate and up, fused
            tensor(f"{block}.ffn_down.weight", n_embd, n_ff, qtype=v_type)
        else:
            tensor(f"{block}.ffn_gate.weight", n_ff, n_embd)
            tensor(f"{block}.ffn_up.weight", n_ff, n_embd)
            tensor(f"{block}.ffn_down.weight", n_embd, n_ff, qtype=v_type)
        if arch == "gemma3":
            tensor(f"{block}.post_ffw_norm.weight", n_embd, norm=True)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
