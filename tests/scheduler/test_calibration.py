"""Calibration raising and lowering estimates, and which failures count as out of memory."""

import signal

import pytest

from scheduler.estimation.engines import LlamaCppConfig, estimate_llamacpp
from scheduler.estimation.gguf_header import read_shape
from scheduler.policy.calibration import Observation, calibrate, classify_exit

MIB = 2**20


@pytest.fixture
def shape(gguf_model):
    return read_shape(gguf_model(layers=4, embedding=256, heads=4, kv_heads=2, context=4096))


def key(shape, **config):
    return LlamaCppConfig(**config).calibration_key(shape)


def test_nothing_recorded_leaves_the_estimate_alone(shape):
    estimate = estimate_llamacpp(shape, LlamaCppConfig(ctx_size=2048))
    assert calibrate(estimate, key(shape, ctx_size=2048), []) is estimate


def test_a_load_of_the_same_configuration_replaces_the_figure_with_a_margin(shape):
    estimate = estimate_llamacpp(shape, LlamaCppConfig(ctx_size=2048))
    seen = [Observation(key(shape, ctx_size=2048), estimate.total_bytes, 50 * MIB, "loaded", "r1")]
    calibrated = calibrate(estimate, key(shape, ctx_size=2048), seen, margin=0.05)
    assert calibrated.total_bytes == round(50 * MIB * 1.05)
    assert calibrated.uncalibrated_total_bytes == estimate.total_bytes
    assert calibrated.calibration["rule"] == "measured" and calibrated.calibration["records"] == ["r1"]


@pytest.mark.parametrize("ratio", [1.2, 0.8])
def test_a_neighbouring_configuration_applies_its_ratio_raising_or_lowering(shape, ratio):
    neighbour = estimate_llamacpp(shape, LlamaCppConfig(ctx_size=1024))
    seen = [Observation(key(shape, ctx_size=1024), neighbour.total_bytes, int(neighbour.total_bytes * ratio), "loaded")]
    estimate = estimate_llamacpp(shape, LlamaCppConfig(ctx_size=4096))
    calibrated = calibrate(estimate, key(shape, ctx_size=4096), seen)
    assert calibrated.total_bytes == pytest.approx(estimate.total_bytes * ratio, rel=1e-6)
    assert calibrated.calibration["rule"] == "ratio"


def test_out_of_memory_with_evidence_raises_the_next_estimate(shape):
    estimate = estimate_llamacpp(shape, LlamaCppConfig(ctx_size=2048))
    seen = [Observation(key(shape, ctx_size=2048), estimate.total_bytes, None, "oom", "oom1")]
    raised = calibrate(estimate, key(shape, ctx_size=2048), seen, oom_raise=0.25)
    assert raised.total_bytes == pytest.approx(estimate.total_bytes * 1.25, abs=1)
    assert raised.calibration["rule"] == "oom"


def test_a_successful_load_after_an_oom_wins(shape):
    estimate = estimate_llamacpp(shape, LlamaCppConfig(ctx_size=2048))
    config = key(shape, ctx_size=2048)
    newest_first = [Observation(config, estimate.total_bytes, 40 * MIB, "loaded"),
                    Observation(config, estimate.total_bytes, None, "oom")]
    assert calibrate(estimate, config, newest_first, margin=0).total_bytes == 40 * MIB


OOM_KILLER = ("[12345.678901] Out of memory: Killed process 4242 (llama-server) total-vm:8123456kB, "
              "anon-rss:7812345kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:15632kB oom_score_adj:0")
OOM_KILL_LINE = ("[12345.678800] oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,"
                 "mems_allowed=0,oom_memcg=/system.slice/berth.service,task_memcg=/system.slice/berth.service,"
                 "task=llama-server,pid=4242,uid=0")


def test_kernel_oom_killer_line_naming_the_process_is_evidence():
    verdict = classify_exit(exit_code=-signal.SIGKILL, kernel_log="noise\n" + OOM_KILLER, pid=4242)
    assert verdict.is_oom and verdict.source == "kernel" and "Killed process 4242" in verdict.evidence
    assert classify_exit(exit_code=-9, kernel_log=OOM_KILL_LINE, pid=4242).is_oom


def test_an_oom_kill_of_another_process_is_not_evidence():
    verdict = classify_exit(exit_code=-signal.SIGKILL, kernel_log=OOM_KILLER, pid=999)
    assert not verdict.is_oom and verdict.kind == "killed"


def test_docker_oomkilled_is_evidence():
    verdict = classify_exit(exit_code=137, docker_oom_killed=True)
    assert verdict.is_oom and verdict.source == "docker"


def test_a_plain_sigkill_is_not_out_of_memory():
    assert classify_exit(exit_code=137, docker_oom_killed=False).kind == "killed"
    assert not classify_exit(exit_code=-signal.SIGKILL).is_oom


def test_the_engines_own_allocation_failure_is_evidence():
    log = "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 9216.00 MiB on device 0: cudaMalloc failed: out of memory"
    assert classify_exit(exit_code=1, engine_log=log).is_oom
    assert classify_exit(exit_code=1, engine_log="torch.OutOfMemoryError: CUDA out of memory. Tried").is_oom
    assert classify_exit(exit_code=1, engine_log="segfault").kind == "crashed"
