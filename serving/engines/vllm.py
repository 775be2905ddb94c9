"""vLLM (``vllm serve`` or the ``vllm/vllm-openai`` image): configuration, command line, sleep/wake.

vLLM sizes its memory pool as a fraction of the card (``--gpu-memory-utilization``); Berth derives
that fraction from the scheduler's reservation so the pool matches what was reserved:
``ceil(reservation / total × 100) / 100`` (Scheduler I's rule), refused above 0.95 because the rest
of the card is the driver's and the safety margin's.

Sleep and wake follow vLLM's HTTP contract: ``POST /sleep?level=1`` (weights to host memory, KV
cache dropped), ``POST /wake_up``, ``GET /is_sleeping`` → ``{"is_sleeping": bool}``. vLLM serves
them only with ``VLLM_SERVER_DEV_MODE=1``, which the command sets when sleep mode is on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import httpx

from serving.engines import model_files
from serving.engines.base import EngineCommand, LaunchSpec, ProbeRequest, translated
from serving.engines.llamacpp import probe_request
from serving.engines.options import Flag, Option, Problem, flag_argv, number, one_of, switch, validate
from serving.errors import (
    EngineRequestFailed,
    InvalidEngineConfig,
    MemoryFractionRefused,
    SleepNotSupported,
    WakeRefused,
)

IMAGE_REPOSITORY = "vllm/vllm-openai"
DEFAULT_IMAGE_TAG = "v0.11.0"
MAX_MEMORY_FRACTION_PERCENT = 95

OPTIONS: dict[str, Option] = {
    "max_model_len": Option(int, default=None, minimum=16, maximum=1 << 22, help="--max-model-len (default: the model's)"),
    "max_num_seqs": Option(int, default=None, minimum=1, maximum=4096, help="--max-num-seqs"),
    "tensor_parallel_size": Option(int, default=None, minimum=1, maximum=64,
                                   help="--tensor-parallel-size (default: the number of placed GPUs)"),
    "enable_sleep_mode": Option(bool, default=True, help="--enable-sleep-mode (lets Berth sleep and wake it)"),
    "dtype": Option(str, default=None, choices=("auto", "half", "float16", "bfloat16", "float", "float32")),
    "kv_cache_dtype": Option(str, default=None, choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2")),
    "quantization": Option(str, default=None, choices=("awq", "gptq", "fp8", "bitsandbytes", "gguf", "compressed-tensors")),
    "enforce_eager": Option(bool, default=False, help="--enforce-eager (no CUDA graphs: less memory, slower)"),
    "scheduling_policy": Option(str, default=None, choices=("fcfs", "priority"),
                                help="--scheduling-policy: priority serves requests in the order of their clients' "
                                     "workload priority, which the gateway sends as each request's priority"),
    "draft_model": Option(str, default=None, pattern=r"/.+",
                          help="--speculative-config's model: a smaller model of the same vocabulary that drafts "
                               "tokens for this one (a folder)"),
    "draft_max": Option(int, default=None, minimum=1, maximum=64,
                        help="--speculative-config's num_speculative_tokens (default 5; with draft_model)"),
    "cpu_offload_gb": Option(float, default=None, minimum=0, maximum=4096,
                             help="--cpu-offload-gb: GiB of each GPU's weights kept in host memory (slower; "
                                  "the recovery ladder's degraded relaunch uses it)"),
    "image_tag": Option(str, default=None, pattern=r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}",
                        help=f"tag of {IMAGE_REPOSITORY} for the Docker runtime"),
}

EXTRA_FLAGS: dict[str, Flag] = {
    "--enable-prefix-caching": switch(),
    "--no-enable-prefix-caching": switch(),
    "--enable-chunked-prefill": switch(),
    "--no-enable-chunked-prefill": switch(),
    "--disable-log-requests": switch(),
    "--disable-log-stats": switch(),
    "--enable-auto-tool-choice": switch(),
    "--max-num-batched-tokens": number(1, 1 << 22, whole=True),
    "--block-size": one_of("8", "16", "32", "64", "128"),
    "--swap-space": number(0, 1024),
    "--seed": number(0, 2**32 - 1, whole=True),
    "--generation-config": one_of("auto", "vllm"),
    "--tool-call-parser": one_of("hermes", "llama3_json", "mistral", "pythonic", "granite", "internlm", "jamba",
                                 "qwen3_coder", "openai"),
    "--reasoning-parser": one_of("deepseek_r1", "qwen3", "granite", "openai_gptoss", "mistral"),
}


def gpu_memory_fraction(reservation_bytes: int | None, total_bytes: int | None) -> float:
    """``ceil(reservation / total × 100) / 100`` in exact integer arithmetic (a float ceil turns
    0.30 into 0.31), or MemoryFractionRefused when an input is missing or it exceeds 0.95."""
    if not reservation_bytes or not total_bytes or reservation_bytes <= 0 or total_bytes <= 0:
        raise MemoryFractionRefused(
            "vLLM needs the reservation and the card's total memory to size its memory pool.",
            details={"reservation_bytes": reservation_bytes, "gpu_memory_total_bytes": total_bytes})
    percent = -(-reservation_bytes * 100 // total_bytes)
    if percent > MAX_MEMORY_FRACTION_PERCENT:
        raise MemoryFractionRefused(
            f"The reservation is {percent}% of the card; vLLM may take at most {MAX_MEMORY_FRACTION_PERCENT}%.",
            details={"reservation_bytes": reservation_bytes, "gpu_memory_total_bytes": total_bytes,
                     "percent": percent, "maximum_percent": MAX_MEMORY_FRACTION_PERCENT})
    return percent / 100


class VLLM:
    kind = "vllm"
    label = "vLLM"
    options = OPTIONS
    catalog_keys = {"context": "max_model_len", "parallel": "max_num_seqs"}
    default_slots = 256
    default_context = None  # the model's own length
    # Configuration keys (as the engine takes them) → the memory estimator's names for the same thing.
    estimation_keys = {"max_model_len": "max_model_len", "max_num_seqs": "max_num_seqs",
                       "kv_cache_dtype": "kv_cache_dtype", "tensor_parallel_size": "tensor_parallel_size",
                       "enforce_eager": "enforce_eager", "max_num_batched_tokens": "max_num_batched_tokens"}

    def __init__(self, image_tag: str | None = None):
        self.image_tag = image_tag

    def validate_config(self, config: dict[str, Any] | None) -> dict[str, Any]:
        return validate(config, OPTIONS, EXTRA_FLAGS, extra=_cross_checks, engine="vLLM")

    def validate_model(self, path: str, roots=None) -> Path:
        return model_files.validate_model_path(path, roots, kind="any")

    def image(self, config: dict[str, Any]) -> str:
        tag = config.get("image_tag") or self.image_tag or _setting("SERVING_VLLM_IMAGE_TAG", DEFAULT_IMAGE_TAG)
        return f"{IMAGE_REPOSITORY}:{tag}"

    def command(self, spec: LaunchSpec) -> EngineCommand:
        config = self.validate_config(spec.config)
        fraction = gpu_memory_fraction(spec.reservation_bytes, spec.gpu_memory_total_bytes)
        tensor_parallel = config["tensor_parallel_size"] or max(1, len(spec.gpu_uuids))
        if spec.gpu_uuids and tensor_parallel > len(spec.gpu_uuids):
            raise InvalidEngineConfig(
                f"tensor_parallel_size {tensor_parallel} needs as many GPUs; the placement has {len(spec.gpu_uuids)}.",
                details={"problems": [{"field": "tensor_parallel_size",
                                       "message": f"exceeds the {len(spec.gpu_uuids)} placed GPU(s)"}]})
        argv = ["vllm", "serve", spec.model_path, "--served-model-name", spec.served_name,
                "--host", spec.host, "--port", str(spec.port),
                "--gpu-memory-utilization", f"{fraction:.2f}", "--tensor-parallel-size", str(tensor_parallel)]
        if config["max_model_len"] is not None:
            argv += ["--max-model-len", str(config["max_model_len"])]
        if config["max_num_seqs"] is not None:
            argv += ["--max-num-seqs", str(config["max_num_seqs"])]
        for key, flag in (("dtype", "--dtype"), ("kv_cache_dtype", "--kv-cache-dtype"),
                          ("quantization", "--quantization"), ("scheduling_policy", "--scheduling-policy")):
            if config[key] is not None:
                argv += [flag, config[key]]
        if config["draft_model"]:
            speculative = {"model": config["draft_model"], "num_speculative_tokens": config["draft_max"] or 5}
            argv += ["--speculative-config", json.dumps(speculative, separators=(",", ":"))]
        if config["cpu_offload_gb"]:
            argv += ["--cpu-offload-gb", f"{config['cpu_offload_gb']:g}"]
        if config["enforce_eager"]:
            argv.append("--enforce-eager")
        if config["enable_sleep_mode"]:
            argv.append("--enable-sleep-mode")
        argv += flag_argv(config["extra_flags"])
        env = {
            "HF_HUB_OFFLINE": "1",  # only files already present: never a download at start-up
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "CUDA_VISIBLE_DEVICES": ",".join(spec.gpu_uuids),
        }
        if spec.api_key:
            env["VLLM_API_KEY"] = spec.api_key  # vLLM's --api-key default; never on the command line
        if config["enable_sleep_mode"]:
            env["VLLM_SERVER_DEV_MODE"] = "1"  # vLLM serves /sleep, /wake_up and /is_sleeping only then
        return EngineCommand(argv=tuple(argv), env=env, image=self.image(config))

    def estimation_config(self, config: dict[str, Any], gpus: int = 0) -> dict[str, Any]:
        """Sharded over its GPUs by default (tensor parallel)."""
        settings = translated(config, self.estimation_keys)
        if gpus > 1:
            settings.setdefault("tensor_parallel_size", gpus)
        return settings

    def health_path(self) -> str:
        return "/health"

    def probe(self, spec: LaunchSpec, task: str) -> ProbeRequest:
        return probe_request(spec.served_name, task)


def _cross_checks(config: dict[str, Any], problems: list[Problem]) -> None:
    if config.get("enforce_eager") and "--enforce-eager" in (config.get("extra_flags") or []):
        problems.append({"field": "extra_flags", "message": "--enforce-eager is set by enforce_eager"})
    if config.get("draft_max") and not config.get("draft_model"):
        problems.append({"field": "draft_max", "message": "applies only with a draft_model"})


def _setting(name: str, default: str) -> str:
    try:
        from django.conf import settings

        return getattr(settings, name, default)
    except Exception:  # settings not configured (plain Python use)
        return default


# -- sleep and wake: vLLM's HTTP contract


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _call(method: str, base_url: str, path: str, api_key: str | None, timeout: float,
          params: dict[str, Any] | None = None) -> httpx.Response:
    url = base_url.rstrip("/") + path
    try:
        response = httpx.request(method, url, params=params, headers=_headers(api_key), timeout=timeout)
    except httpx.HTTPError as exc:
        raise EngineRequestFailed(f"{method} {path} to the engine failed: {exc}",
                                  details={"url": url, "error": str(exc)}) from exc
    if response.status_code == 404:
        raise SleepNotSupported(f"The engine does not serve {path}: it was not started with sleep mode.",
                                details={"url": url})
    if response.status_code >= 400:
        raise EngineRequestFailed(f"{method} {path} answered {response.status_code}: {response.text[:300]}",
                                  details={"url": url, "status": response.status_code})
    return response


def is_sleeping(base_url: str, api_key: str | None, *, timeout: float = 10) -> bool:
    response = _call("GET", base_url, "/is_sleeping", api_key, timeout)
    try:
        return bool(response.json()["is_sleeping"])
    except (ValueError, KeyError, TypeError) as exc:
        raise EngineRequestFailed(f"/is_sleeping answered {response.text[:200]!r}, not {{\"is_sleeping\": …}}.",
                                  details={"body": response.text[:200]}) from exc


def sleep(base_url: str, api_key: str | None, *, level: int = 1, timeout: float = 120) -> None:
    """Level 1: the weights go to host memory and the KV cache is dropped; the device memory is free
    when this returns. Sleeping is never delayed: freeing memory must stay immediate."""
    if level not in (1, 2):
        raise ValueError("vLLM sleep levels are 1 and 2")
    _call("POST", base_url, "/sleep", api_key, timeout, params={"level": str(level)})


def wake_up(base_url: str, api_key: str | None, *, reservation_bytes: int,
            free_device_bytes: Callable[[], int | None], timeout: float = 300) -> None:
    """Wake the engine, but only when the memory it takes back (its reservation) is free now:
    waking into memory another engine took would fail in vLLM or push the card out of memory.
    ``free_device_bytes`` reads free memory now; None (not measured) is refused, never taken as room."""
    free = free_device_bytes()
    if free is None:
        raise WakeRefused("Free device memory is not known, so waking cannot be proven safe.",
                          details={"reservation_bytes": reservation_bytes, "free_bytes": None})
    if free < reservation_bytes:
        raise WakeRefused(
            f"Waking needs {reservation_bytes / 2**30:.1f} GiB free on the device; {free / 2**30:.1f} GiB is free.",
            details={"reservation_bytes": reservation_bytes, "free_bytes": free,
                     "short_bytes": reservation_bytes - free})
    _call("POST", base_url, "/wake_up", api_key, timeout)
