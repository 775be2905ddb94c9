"""A GGUF model's shape from its header, without loading the weights.

``gguf.GGUFReader`` maps the file and turns every metadata array into numpy views: 2.7 s for
SmolLM2's 49k-token vocabulary, too slow for an estimate form that must answer in 100 ms. This
reader walks the header with ``struct``, skips string arrays by their lengths, and uses the
``gguf`` package's own tables (value types, quantisation block sizes) to size the tensors.
Results are cached by path, size and modification time.
"""

from __future__ import annotations

import functools
import hashlib
import mmap
import os
import struct
from pathlib import Path
from typing import Any

import gguf

from scheduler.errors import ModelNotFound, UnreadableModel
from scheduler.estimation.shape import ModelShape

T = gguf.GGUFValueType
_SCALAR = {
    T.UINT8: "<B", T.INT8: "<b", T.UINT16: "<H", T.INT16: "<h", T.UINT32: "<I", T.INT32: "<i",
    T.FLOAT32: "<f", T.BOOL: "<?", T.UINT64: "<Q", T.INT64: "<q", T.FLOAT64: "<d",
}
_SIZE = {kind: struct.calcsize(fmt) for kind, fmt in _SCALAR.items()}
# Arrays we keep (per-layer head counts, window patterns); every other array is skipped.
_KEEP_ARRAY_SUFFIXES = ("attention.head_count_kv", "attention.head_count", "attention.sliding_window_pattern",
                        "feed_forward_length")  # expert_feed_forward_length too


class _Cursor:
    def __init__(self, buffer, offset: int = 0):
        self.buffer = buffer
        self.offset = offset

    def scalar(self, kind) -> Any:
        value = struct.unpack_from(_SCALAR[kind], self.buffer, self.offset)[0]
        self.offset += _SIZE[kind]
        return value

    def string(self) -> str:
        (length,) = struct.unpack_from("<Q", self.buffer, self.offset)
        start = self.offset + 8
        self.offset = start + length
        return bytes(self.buffer[start:self.offset]).decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        unpack, buffer, offset = struct.unpack_from, self.buffer, self.offset
        for _ in range(count):
            offset += 8 + unpack("<Q", buffer, offset)[0]
        self.offset = offset

    def value(self, kind, key: str) -> Any:
        if kind == T.STRING:
            return self.string()
        if kind == T.ARRAY:
            item_kind = T(self.scalar(T.UINT32))
            count = self.scalar(T.UINT64)
            keep = key.endswith(_KEEP_ARRAY_SUFFIXES)
            if item_kind == T.STRING:
                self.skip_strings(count)
                return count  # the length is what we need (the vocabulary's size)
            if item_kind == T.ARRAY:
                raise UnreadableModel("Nested arrays in GGUF metadata are not supported.")
            if keep:
                return [self.scalar(item_kind) for _ in range(count)]
            self.offset += _SIZE[item_kind] * count
            return count  # the length is enough (e.g. the vocabulary size)
        return self.scalar(kind)


def read_metadata(path: Path) -> tuple[dict[str, Any], list[tuple[str, int, int, int, tuple[int, ...]]], int]:
    """(metadata, [(tensor name, element count, type, data offset, dims)], file size). The metadata also
    holds ``_data_start``: where the tensor data begins (the header's end, aligned to
    ``general.alignment``); each tensor's offset counts from there. A header alone (a file cut
    short, the hub's header prefix) reads: whether the data is all there is ``data_end``'s to say."""
    try:
        handle = open(path, "rb")
    except FileNotFoundError:
        raise ModelNotFound(f"No model file at {path}.", details={"path": str(path)}) from None
    except OSError as error:
        raise UnreadableModel(f"Cannot read {path}: {error.strerror}.", details={"path": str(path)}) from None
    with handle:
        size = os.fstat(handle.fileno()).st_size
        if size < 24:
            raise UnreadableModel(f"{path.name} is too small to be a GGUF model.", details={"path": str(path)})
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
            if buffer[:4] != b"GGUF":
                raise UnreadableModel(f"{path.name} is not a GGUF file (no GGUF magic).", details={"path": str(path)})
            cursor = _Cursor(buffer, 4)
            try:
                version = cursor.scalar(T.UINT32)
                if version < 2:
                    raise UnreadableModel(f"GGUF version {version} is too old.", details={"path": str(path)})
                tensor_count = cursor.scalar(T.UINT64)
                kv_count = cursor.scalar(T.UINT64)
                metadata: dict[str, Any] = {}
                for _ in range(kv_count):
                    key = cursor.string()
                    kind = T(cursor.scalar(T.UINT32))
                    metadata[key] = cursor.value(kind, key)
                tensors = []
                for _ in range(tensor_count):
                    name = cursor.string()
                    dims = [cursor.scalar(T.UINT64) for _ in range(cursor.scalar(T.UINT32))]
                    kind = cursor.scalar(T.UINT32)
                    offset = cursor.scalar(T.UINT64)
                    elements = 1
                    for dim in dims:
                        elements *= dim
                    tensors.append((name, elements, kind, offset, tuple(dims)))
                alignment = metadata.get("general.alignment")
                if not isinstance(alignment, int) or alignment <= 0:
                    alignment = gguf.GGUF_DEFAULT_ALIGNMENT
                metadata["_data_start"] = -(-cursor.offset // alignment) * alignment
            except (struct.error, ValueError, IndexError) as error:
                raise UnreadableModel(f"{path.name} has a damaged GGUF header ({error}).",
                                      details={"path": str(path)}) from None
            head = bytes(buffer[: min(size, 1 << 20)])
    metadata["_fingerprint"] = hashlib.sha256(head).hexdigest()[:16]
    return metadata, tensors, size


def tensor_bytes(elements: int, kind: int) -> int:
    try:
        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
    except (ValueError, KeyError):
        raise UnreadableModel(f"Unknown GGUF tensor type {kind}.") from None
    return elements // block * type_size


def _type_name(kind: int) -> str:
    try:
        return gguf.GGMLQuantizationType(kind).name
    except ValueError:
        return str(kind)


def data_end(metadata: dict[str, Any], tensors: list[tuple[str, int, int, int, tuple[int, ...]]]) -> int:
    """The byte at which the tensor data ends: the furthest tensor's offset plus its size, from
    the data's start. A file shorter than this was cut short (a copy or download interrupted):
    its header reads, llama.cpp refuses to load it."""
    return metadata["_data_start"] + max((offset + tensor_bytes(elements, kind)
                                          for _, elements, kind, offset, _ in tensors), default=0)


def read_shape(path: str | Path) -> ModelShape:
    path = Path(path)
    try:
        stat = path.stat()
    except FileNotFoundError:
        raise ModelNotFound(f"No model file at {path}.", details={"path": str(path)}) from None
    return _read_shape_cached(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=256)
def _read_shape_cached(path: str, size: int, mtime_ns: int) -> ModelShape:
    metadata, tensors, size = read_metadata(Path(path))
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise UnreadableModel("The GGUF header names no architecture.", details={"path": path})

    def key(name, default=None):
        return metadata.get(f"{arch}.{name}", default)

    layers = key("block_count")
    embedding = key("embedding_length")
    heads = key("attention.head_count")
    missing = [n for n, v in (("block_count", layers), ("embedding_length", embedding),
                             ("attention.head_count", heads)) if v is None]
    if missing:
        raise UnreadableModel(f"The GGUF header lacks {', '.join(arch + '.' + m for m in missing)}.",
                              details={"path": path, "missing": missing})
    head_list = heads if isinstance(heads, list) else [heads] * layers
    max_heads = max(head_list)
    kv = key("attention.head_count_kv", heads)
    kv_heads = tuple(kv) if isinstance(kv, list) else (kv,) * layers
    key_length = key("attention.key_length") or embedding // max_heads
    value_length = key("attention.value_length") or embedding // max_heads
    vocab = key("vocab_size") or metadata.get("tokenizer.ggml.tokens")
    ff = key("feed_forward_length")
    window = key("attention.sliding_window")
    pattern = key("attention.sliding_window_pattern")
    swa_layers = 0
    if window:
        if isinstance(pattern, list):
            swa_layers = sum(1 for p in pattern if p)
        elif isinstance(pattern, int) and pattern > 1:  # every n-th layer is global (Gemma 3: 6)
            swa_layers = layers - layers // pattern
        else:
            swa_layers = layers  # e.g. Mistral 7B v0.1: every layer slides

    per_layer = [0] * layers
    input_bytes = output_bytes = total = 0
    matrices: dict[tuple[int, str], int] = {}
    layout = []  # (data offset, block index or -1 for the output head or -2, type, bytes, multiplied)
    embeddings = None  # (type, bytes, rows) of token_embd.weight: the output head when none is written
    has_head = False
    for name, elements, kind, offset, dims in tensors:
        size_of = tensor_bytes(elements, kind)
        total += size_of
        index = None
        if name.startswith("blk."):
            index = int(name.split(".")[1])
            if index < layers:
                per_layer[index] += size_of
        elif name.startswith("token_embd"):
            input_bytes += size_of
            if name == "token_embd.weight" and len(dims) == 2:
                embeddings = (_type_name(kind), size_of, dims[1])
        else:
            output_bytes += size_of
            if name == "output.weight":
                index, has_head = -1, True
        # What llama.cpp multiplies by: 2-D weights (3-D stacked experts), not norms or embeddings.
        multiplied = (index is not None and name.endswith(".weight") and len(dims) in (2, 3) and dims[1] % 8 == 0
                      and "norm" not in name)
        if multiplied:
            type_key = (index, _type_name(kind))
            matrices[type_key] = matrices.get(type_key, 0) + size_of
        layout.append((offset, -2 if index is None else index, _type_name(kind), size_of, multiplied))
    if not has_head and embeddings is not None and embeddings[2] % 8 == 0:
        matrices[(-1, embeddings[0])] = matrices.get((-1, embeddings[0]), 0) + embeddings[1]
    file_type = metadata.get("general.file_type")
    try:
        weight_type = gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_") if file_type is not None else ""
    except ValueError:
        weight_type = str(file_type)
    name = metadata.get("general.name") or Path(path).stem
    expert_ff = key("expert_feed_forward_length")
    return ModelShape(
        source="gguf", architecture=arch, name=str(name), layers=layers, embedding=embedding,
        heads=max_heads, kv_heads=kv_heads, key_length=key_length, value_length=value_length,
        context_length=key("context_length"), vocab_size=vocab if isinstance(vocab, int) else None,
        feed_forward=max(ff) if isinstance(ff, list) else ff, weights_bytes=total,
        layer_weights_bytes=tuple(per_layer), input_weights_bytes=input_bytes, output_weights_bytes=output_bytes,
        file_bytes=size, data_end_bytes=data_end(metadata, tensors), weight_type=weight_type,
        sliding_window=window, sliding_window_layers=swa_layers,
        sliding_window_pattern=tuple(bool(p) for p in pattern) if isinstance(pattern, list) else pattern,
        experts=key("expert_count") or 0, experts_used=key("expert_used_count") or 0,
        expert_feed_forward=max(expert_ff) if isinstance(expert_ff, list) else expert_ff,
        matrix_weights=tuple((index, kind, size_of) for (index, kind), size_of in sorted(matrices.items())),
        tensor_layout=tuple(entry[1:] for entry in sorted(layout)),
        kv_lora_rank=key("attention.kv_lora_rank"), rope_head_dim=key("rope.dimension_count"),
        model_key=f"gguf:{Path(path).name}:{size}:{metadata['_fingerprint']}",
    )
