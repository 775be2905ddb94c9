"""A Hugging Face model folder's shape: weights from the safetensors headers (dtype × shape, no
tensor is loaded), architecture from ``config.json`` (GQA, sliding window, MLA where it says so)."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from scheduler.errors import ModelNotFound, UnreadableModel
from scheduler.estimation.shape import ModelShape

DTYPE_BYTES = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1,
}
_HEADER_LIMIT = 100 * 2**20  # the format's own cap on a header


def read_safetensors_header(path: Path) -> dict:
    try:
        with open(path, "rb") as handle:
            raw = handle.read(8)
            if len(raw) < 8:
                raise UnreadableModel(f"{path.name} is too small to be a safetensors file.")
            (length,) = struct.unpack("<Q", raw)
            if length > _HEADER_LIMIT:
                raise UnreadableModel(f"{path.name}: header of {length} bytes is larger than the format allows.")
            return json.loads(handle.read(length))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UnreadableModel(f"{path.name} has a damaged safetensors header.") from None


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    for before, index in zip(parts, parts[1:]):
        if before in ("layers", "h", "blocks", "layer") and index.isdigit():
            return int(index)
    return None


def read_shape(folder: str | Path) -> ModelShape:
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelNotFound(f"No model folder at {folder}.", details={"path": str(folder)})
    config_path = folder / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise UnreadableModel(f"{folder.name} has no config.json.", details={"path": str(folder)}) from None
    except json.JSONDecodeError as error:
        raise UnreadableModel(f"{folder.name}/config.json is not valid JSON ({error}).") from None
    text = config.get("text_config") or config  # multimodal models nest the language model's config
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UnreadableModel(f"{folder.name} holds no .safetensors files.", details={"path": str(folder)})

    layers = text.get("num_hidden_layers") or text.get("n_layer")
    hidden = text.get("hidden_size") or text.get("n_embd")
    heads = text.get("num_attention_heads") or text.get("n_head")
    missing = [n for n, v in (("num_hidden_layers", layers), ("hidden_size", hidden),
                             ("num_attention_heads", heads)) if not v]
    if missing:
        raise UnreadableModel(f"config.json lacks {', '.join(missing)}.", details={"missing": missing})

    per_layer = [0] * layers
    total = input_bytes = output_bytes = file_bytes = 0
    dtypes: dict[str, int] = {}
    for file in files:
        file_bytes += file.stat().st_size
        for name, info in read_safetensors_header(file).items():
            if name == "__metadata__":
                continue
            if info.get("dtype") not in DTYPE_BYTES:
                raise UnreadableModel(f"{file.name}: tensor {name} has unknown dtype {info.get('dtype')!r}.")
            count = 1
            for dim in info.get("shape", []):
                count *= dim
            size = count * DTYPE_BYTES[info["dtype"]]
            total += size
            dtypes[info["dtype"]] = dtypes.get(info["dtype"], 0) + size
            layer = _layer_of(name)
            if layer is not None and layer < layers:
                per_layer[layer] += size
            elif "embed" in name or name.endswith("wte.weight"):
                input_bytes += size
            else:
                output_bytes += size

    kv = text.get("num_key_value_heads") or heads  # GQA; absent means one KV head per head
    head_dim = text.get("head_dim") or hidden // heads
    window = text.get("sliding_window")
    swa_layers = 0
    layer_types = text.get("layer_types")
    if isinstance(layer_types, list):
        swa_layers = sum(1 for t in layer_types if t == "sliding_attention")
    elif window and text.get("use_sliding_window", True) is not False:
        if text.get("sliding_window_pattern"):  # Gemma 3: every n-th layer is global
            pattern = int(text["sliding_window_pattern"])
            swa_layers = layers - layers // pattern
        elif text.get("max_window_layers") is not None and "use_sliding_window" in text:
            swa_layers = max(0, layers - int(text["max_window_layers"]))  # Qwen2: layers above it slide
        else:
            swa_layers = layers
    if not swa_layers:
        window = None
    mla_rank = text.get("kv_lora_rank")
    dtype_name = str(text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or "bfloat16")
    dtype_bytes = 4.0 if "32" in dtype_name else 2.0
    fingerprint = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]
    return ModelShape(
        source="safetensors", architecture=(config.get("architectures") or [config.get("model_type", "")])[0],
        name=folder.name, layers=layers, embedding=hidden, heads=heads, kv_heads=(kv,) * layers,
        key_length=text.get("qk_nope_head_dim", 0) + text.get("qk_rope_head_dim", 0) if mla_rank else head_dim,
        value_length=text.get("v_head_dim") or head_dim, context_length=text.get("max_position_embeddings"),
        vocab_size=text.get("vocab_size"), feed_forward=text.get("intermediate_size"), weights_bytes=total,
        layer_weights_bytes=tuple(per_layer), input_weights_bytes=input_bytes, output_weights_bytes=output_bytes,
        file_bytes=file_bytes, weight_type=max(dtypes, key=dtypes.get) if dtypes else "",
        sliding_window=window, sliding_window_layers=swa_layers, kv_lora_rank=mla_rank,
        rope_head_dim=text.get("qk_rope_head_dim"), dtype_bytes=dtype_bytes,
        model_key=f"hf:{folder.name}:{total}:{fingerprint}",
    )
