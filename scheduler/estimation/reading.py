"""One entry point from a path to a model shape, whatever its format."""

from __future__ import annotations

from pathlib import Path

from scheduler.errors import ModelNotFound, UnreadableModel
from scheduler.estimation import gguf_header, safetensors_layout
from scheduler.estimation.shape import ModelShape


def read_model(path: str | Path) -> ModelShape:
    path = Path(path)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if (path / "config.json").exists():
            return safetensors_layout.read_shape(path)
        if len(ggufs) == 1:
            return gguf_header.read_shape(ggufs[0])
        raise UnreadableModel(f"{path.name} holds neither config.json with safetensors nor exactly one .gguf file.",
                              details={"path": str(path)})
    if not path.exists():
        raise ModelNotFound(f"No model at {path}.", details={"path": str(path)})
    if path.suffix == ".gguf" or path.open("rb").read(4) == b"GGUF":
        return gguf_header.read_shape(path)
    if path.suffix == ".safetensors":
        return safetensors_layout.read_shape(path.parent)
    raise UnreadableModel(f"{path.name} is neither a GGUF file nor a safetensors model folder.",
                          details={"path": str(path)})
