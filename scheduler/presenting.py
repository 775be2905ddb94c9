"""Turning estimate results into plain data for the API and the console (one shape for both)."""

from __future__ import annotations

import dataclasses

from scheduler.memory import EstimateResult


def estimate_payload(result: EstimateResult) -> dict:
    shape = result.shape
    return {
        "model": {"name": shape.name, "source": shape.source, "architecture": shape.architecture,
                  "layers": shape.layers, "context_length": shape.context_length, "weight_type": shape.weight_type,
                  "file_bytes": shape.file_bytes, "model_key": shape.model_key},
        "engine": result.engine,
        "config": dataclasses.asdict(result.config),
        "device": result.device,
        "estimate": result.estimate.as_dict(),
        "fit": None if result.fit is None else result.fit.as_dict(),
        "notes": list(result.notes),
    }
