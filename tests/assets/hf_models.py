"""Hugging Face-shaped model folders (config.json and one safetensors file) written on the spot:
the estimator reads their shape, and the catalog imports them as vLLM models."""

from __future__ import annotations

import json
import struct

import numpy as np

LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
                "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100,
                "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}


def write_hf_model(folder, config, tensors):
    """A Hugging Face-shaped folder: config.json and one safetensors file with these tensors."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    header, offset, blobs = {}, 0, []
    for name, (dtype, shape) in tensors.items():
        size = int(np.prod(shape)) * {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1}[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
        blobs.append(b"\0" * size)
    raw = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))
    return folder


def llama_like(layers=2, hidden=64, heads=4, kv_heads=2, inter=128, vocab=100, dtype="BF16"):
    tensors = {"model.embed_tokens.weight": (dtype, (vocab, hidden)), "lm_head.weight": (dtype, (vocab, hidden)),
               "model.norm.weight": (dtype, (hidden,))}
    head_dim = hidden // heads
    for i in range(layers):
        p = f"model.layers.{i}"
        tensors |= {f"{p}.self_attn.q_proj.weight": (dtype, (heads * head_dim, hidden)),
                    f"{p}.self_attn.k_proj.weight": (dtype, (kv_heads * head_dim, hidden)),
                    f"{p}.self_attn.v_proj.weight": (dtype, (kv_heads * head_dim, hidden)),
                    f"{p}.self_attn.o_proj.weight": (dtype, (hidden, heads * head_dim)),
                    f"{p}.mlp.up_proj.weight": (dtype, (inter, hidden)),
                    f"{p}.mlp.down_proj.weight": (dtype, (hidden, inter))}
    return tensors
