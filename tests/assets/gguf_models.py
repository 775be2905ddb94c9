"""Small real GGUF models, generated for whatever shape a test asks for.

The ``gguf`` package writes a valid file with random weights in a fraction of a second;
llama-server loads and serves it (``llama`` and ``qwen2`` layouts), and every header reader sees
the shape it was given. They are the cheapest real models there are: use them wherever a test
needs a model and does not care what it says.
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


@dataclasses.dataclass(frozen=True)
class ModelShape:
    architecture: str = "llama"
    layers: int = 2
    embedding: int = 64
    heads: int = 4
    kv_heads: int = 2
    feed_forward: int = 128
    context: int = 512
    key_length: int | None = None  # per-head key width; defaults to embedding / heads
    value_length: int | None = None
    weight_type: str = "f16"  # f16 or f32
    name: str = "berth-test-model"

    def __post_init__(self):
        if self.embedding % self.heads:
            raise ValueError("embedding must be a multiple of heads")
        if self.heads % self.kv_heads:
            raise ValueError("heads must be a multiple of kv_heads")

    @property
    def head_dim(self) -> int:
        return self.embedding // self.heads

    @property
    def vocab_size(self) -> int:
        return len(_CONTROL) + 256 + len(_PIECES)


def write_gguf(path: Path, shape: ModelShape = ModelShape(), seed: int = 0) -> Path:
    """Write a GGUF model of ``shape`` to ``path`` and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    dtype = np.float16 if shape.weight_type == "f16" else np.float32
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
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if dtype is np.float16 else gguf.LlamaFileType.ALL_F32)

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

    def tensor(name: str, *dims: int, norm: bool = False) -> None:
        # numpy's shape is GGUF's dims reversed: (rows, columns) = (out, in).
        data = np.ones(dims, dtype=np.float32) if norm else rng.normal(0, 0.02, size=dims).astype(np.float32)
        writer.add_tensor(name, data if norm else data.astype(dtype))

    n_vocab, n_embd = shape.vocab_size, shape.embedding
    tensor("token_embd.weight", n_vocab, n_embd)
    tensor("output_norm.weight", n_embd, norm=True)
    tensor("output.weight", n_vocab, n_embd)
    for i in range(shape.layers):
        block = f"blk.{i}"
        tensor(f"{block}.attn_norm.weight", n_embd, norm=True)
        tensor(f"{block}.attn_q.weight", shape.heads * key_len, n_embd)
        tensor(f"{block}.attn_k.weight", shape.kv_heads * key_len, n_embd)
        tensor(f"{block}.attn_v.weight", shape.kv_heads * value_len, n_embd)
        tensor(f"{block}.attn_output.weight", n_embd, shape.heads * value_len)
        if arch == "qwen2":  # qwen2 adds biases to the projections
            tensor(f"{block}.attn_q.bias", shape.heads * key_len, norm=True)
            tensor(f"{block}.attn_k.bias", shape.kv_heads * key_len, norm=True)
            tensor(f"{block}.attn_v.bias", shape.kv_heads * value_len, norm=True)
        tensor(f"{block}.ffn_norm.weight", n_embd, norm=True)
        tensor(f"{block}.ffn_gate.weight", shape.feed_forward, n_embd)
        tensor(f"{block}.ffn_up.weight", shape.feed_forward, n_embd)
        tensor(f"{block}.ffn_down.weight", n_embd, shape.feed_forward)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
