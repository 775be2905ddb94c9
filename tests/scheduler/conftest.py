"""Scheduler fixtures: nodes registered from recorded machines, model roots the estimate may read."""

import pytest

from scheduler.nvml import discover_gpus
from scheduler.services import EngineReport, NodeReport, register_node
from tests.assets.recorded_nvml import RecordedNvml, recorded_smi

GIB = 2**30


@pytest.fixture
def model_root(tmp_path, settings):
    """A directory the estimate form and API may read models from."""
    root = tmp_path
    settings.SCHEDULER_MODEL_ROOTS = [root.resolve()]
    return root


@pytest.fixture
def cpu_node(db):
    return register_node(NodeReport(name="cpu-01", address="127.0.0.1", cpu_count=16, memory_total_bytes=64 * GIB,
                                    memory_available_bytes=60 * GIB,
                                    engines=(EngineReport(kind="llamacpp", version="b1"),)))


@pytest.fixture
def h100_node(db):
    return register_node(NodeReport(name="h100-01", address="127.0.0.1", cpu_count=128,
                                    memory_total_bytes=2048 * GIB, memory_available_bytes=1900 * GIB,
                                    engines=(EngineReport(kind="vllm", version="0.11.0"),),
                                    gpus=discover_gpus(RecordedNvml.load("h100x8"), recorded_smi(None))))


@pytest.fixture
def mig_node(db):
    return register_node(NodeReport(name="a100-01", address="127.0.0.1", memory_total_bytes=1024 * GIB,
                                    gpus=discover_gpus(RecordedNvml.load("a100-mig"), recorded_smi(None))))
