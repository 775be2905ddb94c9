"""vLLM: command line, environment, the memory fraction rule, and sleep/wake over its HTTP contract.

No GPU here, so vLLM itself cannot run: the sleep/wake calls go to a small local server that
implements vLLM's documented contract (POST /sleep?level=N, POST /wake_up, GET /is_sleeping →
{"is_sleeping": bool}) and records what it was sent.
"""

from __future__ import annotations

import pytest

from serving.engines import vllm
from serving.engines.vllm import VLLM, gpu_memory_fraction
from serving.errors import (EngineRequestFailed, InvalidEngineConfig, MemoryFractionRefused, SleepNotSupported,
                            WakeRefused)
from tests.assets.vllm_contract import ContractServer

GiB = 2**30
H100_TOTAL = 85_520_809_984  # what NVML reports for an H100 80GB HBM3


def flag_value(argv, flag):
    return argv[argv.index(flag) + 1]


@pytest.fixture
def gpu_spec(launch_spec):
    def make(**overrides):
        fields = dict(engine="vllm", model_path="/models/Qwen2.5-7B-Instruct", config={}, gpu_uuids=("GPU-1",),
                      gpu_memory_total_bytes=H100_TOTAL, reservation_bytes=30 * GiB, port=18000)
        fields.update(overrides)
        return launch_spec(fields.pop("model_path"), **fields)

    return make


def test_command_line_serves_the_model_under_its_name_on_the_allocated_address(gpu_spec):
    command = VLLM().command(gpu_spec(config={"max_model_len": 8192, "max_num_seqs": 32}))

    argv = command.argv
    assert argv[:3] == ("vllm", "serve", "/models/Qwen2.5-7B-Instruct")
    assert flag_value(argv, "--served-model-name") == "berth-test"
    assert flag_value(argv, "--host") == "127.0.0.1"
    assert flag_value(argv, "--port") == "18000"
    assert flag_value(argv, "--max-model-len") == "8192"
    assert flag_value(argv, "--max-num-seqs") == "32"
    assert flag_value(argv, "--tensor-parallel-size") == "1"
    assert flag_value(argv, "--gpu-memory-utilization") == "0.38"  # ceil(30 GiB / 79.6 GiB × 100) / 100
    assert "--enable-sleep-mode" in argv  # on by default
    assert command.image == "vllm/vllm-openai:v0.11.0"


def test_environment_is_offline_keyed_and_limited_to_the_placed_gpus(gpu_spec):
    spec = gpu_spec(gpu_uuids=("GPU-a", "GPU-b"), api_key="bre_vllm_key")

    command = VLLM().command(spec)

    assert command.env["HF_HUB_OFFLINE"] == "1"
    assert command.env["TRANSFORMERS_OFFLINE"] == "1"
    assert command.env["VLLM_API_KEY"] == "bre_vllm_key"
    assert command.env["CUDA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"
    assert command.env["VLLM_SERVER_DEV_MODE"] == "1"  # vLLM serves /sleep and /wake_up only then
    assert not any("bre_vllm_key" in arg for arg in command.argv)
    assert flag_value(command.argv, "--tensor-parallel-size") == "2"  # defaults to the placed GPUs


def test_sleep_mode_can_be_turned_off(gpu_spec):
    command = VLLM().command(gpu_spec(config={"enable_sleep_mode": False}))

    assert "--enable-sleep-mode" not in command.argv
    assert "VLLM_SERVER_DEV_MODE" not in command.env


@pytest.mark.parametrize(("reservation", "total", "fraction"), [
    (30 * GiB, H100_TOTAL, 0.38),
    (40 * GiB, 80 * GiB, 0.50),  # exact: no rounding up past the reservation
    (40 * GiB + 1, 80 * GiB, 0.51),  # one byte more rounds up
    (3 * 10**9, 10 * 10**9, 0.30),  # a float ceil would say 0.31
    (95 * GiB, 100 * GiB, 0.95),  # the largest allowed
])
def test_memory_fraction_is_the_reservation_rounded_up_to_a_percent(reservation, total, fraction):
    assert gpu_memory_fraction(reservation, total) == fraction


@pytest.mark.parametrize(("reservation", "total"), [(96 * GiB, 100 * GiB), (None, H100_TOTAL), (30 * GiB, None),
                                                    (0, H100_TOTAL)])
def test_memory_fraction_is_refused_above_95_percent_or_without_inputs(reservation, total):
    with pytest.raises(MemoryFractionRefused) as caught:
        gpu_memory_fraction(reservation, total)
    assert caught.value.code == "gpu_memory_fraction_refused"


def test_command_is_refused_when_the_reservation_is_missing(gpu_spec):
    with pytest.raises(MemoryFractionRefused):
        VLLM().command(gpu_spec(reservation_bytes=None))


def test_tensor_parallel_beyond_the_placement_is_refused(gpu_spec):
    with pytest.raises(InvalidEngineConfig):
        VLLM().command(gpu_spec(config={"tensor_parallel_size": 2}))


def test_configuration_problems_are_all_listed_and_flags_allowlisted():
    with pytest.raises(InvalidEngineConfig) as caught:
        VLLM().validate_config({"max_model_len": -1, "enable_sleep_mode": "yes", "trust_remote_code": True,
                                "image_tag": "latest; rm -rf /",
                                "extra_flags": ["--trust-remote-code", "--enable-prefix-caching", "--block-size=7"]})

    fields = {p["field"] for p in caught.value.details["problems"]}
    assert fields == {"max_model_len", "enable_sleep_mode", "trust_remote_code", "image_tag",
                      "extra_flags[--trust-remote-code]", "extra_flags[--block-size=7]"}


def test_a_validated_configuration_validates_again():
    cleaned = VLLM().validate_config({"max_model_len": 4096})

    assert cleaned["enable_sleep_mode"] is True
    assert VLLM().validate_config(cleaned) == cleaned


def test_allowed_extra_flags_and_image_tag_are_used(gpu_spec):
    command = VLLM().command(gpu_spec(config={"extra_flags": ["--enable-prefix-caching", "--max-num-batched-tokens=8192"],
                                              "image_tag": "v0.10.2", "kv_cache_dtype": "fp8"}))

    assert "--enable-prefix-caching" in command.argv
    assert flag_value(command.argv, "--max-num-batched-tokens") == "8192"
    assert flag_value(command.argv, "--kv-cache-dtype") == "fp8"
    assert command.image == "vllm/vllm-openai:v0.10.2"


# -- sleep and wake against vLLM's HTTP contract


@pytest.fixture
def contract():
    server = ContractServer()
    yield server
    server.close()


def test_sleep_then_wake_follow_the_contract_with_the_bearer_key(contract):
    vllm.sleep(contract.base_url, "bre_key")
    assert vllm.is_sleeping(contract.base_url, "bre_key") is True

    vllm.wake_up(contract.base_url, "bre_key", reservation_bytes=30 * GiB, free_device_bytes=lambda: 40 * GiB)
    assert vllm.is_sleeping(contract.base_url, "bre_key") is False

    assert [(c["method"], c["path"]) for c in contract.calls] == [
        ("POST", "/sleep"), ("GET", "/is_sleeping"), ("POST", "/wake_up"), ("GET", "/is_sleeping")]
    assert contract.calls[0]["query"] == {"level": ["1"]}
    assert {c["authorization"] for c in contract.calls} == {"Bearer bre_key"}


def test_wake_is_refused_when_the_memory_it_takes_back_is_not_free(contract):
    vllm.sleep(contract.base_url, "k")

    with pytest.raises(WakeRefused) as caught:
        vllm.wake_up(contract.base_url, "k", reservation_bytes=30 * GiB, free_device_bytes=lambda: 20 * GiB)

    assert caught.value.code == "insufficient_memory_to_wake"
    assert caught.value.details["short_bytes"] == 10 * GiB
    assert "30.0 GiB" in caught.value.message and "20.0 GiB" in caught.value.message
    assert [c["path"] for c in contract.calls] == ["/sleep"]  # the engine was never asked to wake
    assert contract.sleeping is True


def test_wake_is_refused_when_free_memory_is_unknown(contract):
    with pytest.raises(WakeRefused):
        vllm.wake_up(contract.base_url, "k", reservation_bytes=GiB, free_device_bytes=lambda: None)
    assert contract.calls == []


def test_an_engine_without_sleep_mode_says_so():
    server = ContractServer(sleep_mode=False)
    try:
        with pytest.raises(SleepNotSupported):
            vllm.sleep(server.base_url, "k")
    finally:
        server.close()


def test_an_unreachable_engine_is_a_request_failure(contract):
    url = contract.base_url
    contract.close()
    with pytest.raises(EngineRequestFailed):
        vllm.sleep(url, "k", timeout=2)


def test_a_draft_model_becomes_the_speculative_config(gpu_spec):
    import json

    argv = VLLM().command(gpu_spec(config={"draft_model": "/models/Qwen2.5-0.5B-Instruct", "draft_max": 4})).argv
    assert json.loads(flag_value(argv, "--speculative-config")) == {"model": "/models/Qwen2.5-0.5B-Instruct",
                                                                   "num_speculative_tokens": 4}
    assert "--speculative-config" not in VLLM().command(gpu_spec()).argv
    with pytest.raises(InvalidEngineConfig) as caught:
        VLLM().validate_config({"draft_max": 4})
    assert [p["field"] for p in caught.value.details["problems"]] == ["draft_max"]



def test_priority_scheduling_is_asked_for_by_its_flag(gpu_spec):
    assert flag_value(VLLM().command(gpu_spec(config={"scheduling_policy": "priority"})).argv,
                      "--scheduling-policy") == "priority"
    assert "--scheduling-policy" not in VLLM().command(gpu_spec()).argv  # vLLM's own default: first come
