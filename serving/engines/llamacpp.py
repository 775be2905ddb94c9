"""llama.cpp's ``llama-server``: configuration, command line and readiness probe.

Berth owns the flags that decide where and how the engine is reachable (model, host, port, alias,
key, threads, metrics); a deployment's configuration sets the rest from a closed list, and extra
flags only from an allowlist, so a configuration cannot point the engine at another file or port.
"""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path
from typing import Any

from serving.engines import llamacpp_image, model_files
from serving.engines.base import EngineCommand, LaunchSpec, ProbeRequest, translated
from serving.engines.installed import llama_server_path
from serving.engines.options import Flag, Option, Problem, flag_argv, number, one_of, switch, validate

CACHE_TYPES = ("f16", "q8_0", "q4_0")
POOLING = ("mean", "cls", "last", "none")
ALL_LAYERS = "999"  # llama.cpp offloads min(n, layers): 999 is "every layer"

OPTIONS: dict[str, Option] = {
    "context": Option(int, default=4096, minimum=16, maximum=1 << 21, help="-c: context size in tokens (all slots together)"),
    "parallel": Option(int, default=1, minimum=1, maximum=256, help="--parallel: concurrent sequences (slots)"),
    "gpu_layers": Option(int, default=None, minimum=0, maximum=999, also=("all",),
                         help="--n-gpu-layers (or \"all\"); default 0 without a GPU placement, all with one"),
    "cache_type_k": Option(str, default=None, choices=CACHE_TYPES, help="-ctk: KV cache type for K"),
    "cache_type_v": Option(str, default=None, choices=CACHE_TYPES, help="-ctv: KV cache type for V"),
    "embeddings": Option(bool, default=False, help="--embeddings: serve /v1/embeddings only"),
    "pooling": Option(str, default=None, choices=POOLING, help="--pooling for embeddings"),
    "reranking": Option(bool, default=False, help="--reranking: serve /v1/rerank"),
    "flash_attn": Option(str, default=None, choices=("on", "off", "auto"), help="-fa"),
    "batch_size": Option(int, default=None, minimum=1, maximum=1 << 16, help="-b: logical batch size"),
    "ubatch_size": Option(int, default=None, minimum=1, maximum=1 << 16, help="-ub: physical batch size"),
    "draft_model": Option(str, default=None, pattern=r"/.+\.gguf",
                          help="-md: a GGUF draft model for speculative decoding (the same vocabulary); it shares "
                               "the context and the GPU offload of the model"),
    "draft_max": Option(int, default=None, minimum=1, maximum=64,
                        help="--spec-draft-n-max: tokens drafted per step (with draft_model)"),
}

EXTRA_FLAGS: dict[str, Flag] = {
    # This llama.cpp release replaced --mlock/--no-mmap with --load-mode.
    "--load-mode": one_of("auto", "none", "mmap", "mlock", "mmap+mlock", "dio"),
    "--cont-batching": switch(),
    "--no-cont-batching": switch(),
    "--no-kv-offload": switch(),
    "--swa-full": switch(),
    "--jinja": switch(),
    "--no-warmup": switch(),
    "--defrag-thold": number(-1, 1),
    "--rope-scaling": one_of("none", "linear", "yarn"),
    "--rope-scale": number(0.0001, 1024),
    "--rope-freq-base": number(0.0001),
    "--rope-freq-scale": number(0.0001, 1024),
    "--yarn-orig-ctx": number(0, 1 << 21, whole=True),
    "--threads-batch": number(1, 1024, whole=True),
    "--keep": number(-1, 1 << 21, whole=True),
    "--n-predict": number(-1, 1 << 21, whole=True),
    "--seed": number(-1, 2**32 - 1, whole=True),
    "--temp": number(0, 10),
    "--no-context-shift": switch(),
    "--top-k": number(0, 1 << 20, whole=True),
    "--top-p": number(0, 1),
    "--min-p": number(0, 1),
    "--repeat-penalty": number(0, 10),
    "--slot-prompt-similarity": number(0, 1),
}


@functools.lru_cache(maxsize=8)
def _help_text(binary: str) -> str | None:
    try:
        proc = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout + proc.stderr


def supports_flag(binary: str, flag: str) -> bool:
    """Does this llama-server know ``flag``? Unknown (no runnable binary here, e.g. a Docker-only
    node): assume the pinned build, which does."""
    text = _help_text(binary)
    if text is None:
        return True
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


class LlamaCpp:
    kind = "llamacpp"
    label = "llama.cpp"
    options = OPTIONS
    catalog_keys = {"context": "context", "parallel": "parallel"}
    default_slots = 1
    default_context = 4096
    # Configuration keys (as the engine takes them) → the memory estimator's names for the same thing.
    estimation_keys = {"context": "ctx_size", "ctx_size": "ctx_size", "parallel": "parallel", "gpu_layers": "n_gpu_layers",
                       "n_gpu_layers": "n_gpu_layers", "cache_type_k": "cache_type_k", "cache_type_v": "cache_type_v",
                       "ubatch_size": "ubatch_size", "flash_attn": "flash_attention",
                       "flash_attention": "flash_attention"}

    def __init__(self, binary: str | Path | None = None, image: str | None = None):
        self._binary = str(binary) if binary else None
        self.image = image or llamacpp_image.IMAGE

    @property
    def binary(self) -> str:
        if self._binary:
            return self._binary
        path = llama_server_path()
        return str(path) if path else "llama-server"

    def validate_config(self, config: dict[str, Any] | None) -> dict[str, Any]:
        def checks(cleaned: dict[str, Any], problems: list[Problem]) -> None:
            _cross_checks(cleaned, problems)
            # The allowlist names flags of the pinned release; a different binary may lack one.
            for item in cleaned["extra_flags"]:
                name = item.partition("=")[0]
                if not supports_flag(self.binary, name):
                    problems.append({"field": f"extra_flags[{item}]",
                                     "message": f"{name} is not known to this llama-server"})

        return validate(config, OPTIONS, EXTRA_FLAGS, extra=checks, engine="llama.cpp")

    def validate_model(self, path: str, roots=None) -> Path:
        return model_files.validate_model_path(path, roots, kind="gguf")

    def command(self, spec: LaunchSpec) -> EngineCommand:
        config = self.validate_config(spec.config)
        binary = self.binary
        if config["gpu_layers"] == "all":
            gpu_layers = ALL_LAYERS
        elif config["gpu_layers"] is not None:
            gpu_layers = str(config["gpu_layers"])
        else:
            gpu_layers = ALL_LAYERS if spec.gpu_uuids else "0"
        argv = [binary, "-m", spec.model_path, "--host", spec.host, "--port", str(spec.port),
                "--alias", spec.served_name, "-c", str(config["context"]), "--parallel", str(config["parallel"]),
                "--n-gpu-layers", gpu_layers, "--metrics"]
        if spec.cores:
            argv += ["-t", str(spec.cores)]
        if supports_flag(binary, "--no-webui"):
            argv.append("--no-webui")  # an engine is an API behind the gateway, not a chat page
        # Bounded to what the estimate counts (scheduler.estimation.engines, LlamaCppConfig): no
        # prompt cache in host memory (up to 8 GiB by default, grown request by request) and two
        # sliding-window checkpoints per slot (32 by default). Extra flags come later and win.
        if supports_flag(binary, "--cache-ram"):
            argv += ["--cache-ram", "0"]
        if supports_flag(binary, "--ctx-checkpoints"):
            argv += ["--ctx-checkpoints", "2"]
        if config["embeddings"]:
            argv += ["--embeddings", "--pooling", config["pooling"] or "mean"]
        if config["reranking"]:
            argv.append("--reranking")
        if config["draft_model"]:
            argv += ["-md", config["draft_model"], "-ngld", gpu_layers]
            if config["draft_max"]:
                argv += ["--spec-draft-n-max", str(config["draft_max"])]
        for key, flag in (("cache_type_k", "-ctk"), ("cache_type_v", "-ctv"), ("flash_attn", "-fa"),
                          ("batch_size", "-b"), ("ubatch_size", "-ub")):
            if config[key] is not None:
                argv += [flag, str(config[key])]
        argv += flag_argv(config["extra_flags"])
        env = {}
        if spec.api_key:
            env["LLAMA_API_KEY"] = spec.api_key  # argv is readable by every local user; the environment is not
        # Only the placed devices are visible; none at all for a CPU placement (a CUDA build would
        # otherwise take memory on a GPU the scheduler did not give it).
        env["CUDA_VISIBLE_DEVICES"] = ",".join(spec.gpu_uuids)
        return EngineCommand(argv=tuple(argv), env=env, image=self.image)

    def estimation_config(self, config: dict[str, Any], gpus: int = 0) -> dict[str, Any]:
        """Every layer offloaded by default on a GPU placement, split over several GPUs."""
        settings = translated(config, self.estimation_keys)
        if isinstance(settings.get("n_gpu_layers"), str):
            settings["n_gpu_layers"] = -1 if settings["n_gpu_layers"] == "all" else int(settings["n_gpu_layers"])
        if isinstance(settings.get("flash_attention"), str):
            settings["flash_attention"] = settings["flash_attention"] != "off"  # "auto" may use it: estimate as if so
        if gpus:
            settings.setdefault("n_gpu_layers", -1)
            if gpus > 1:
                settings["split_gpus"] = gpus
        return settings

    def health_path(self) -> str:
        return "/health"

    def probe(self, spec: LaunchSpec, task: str) -> ProbeRequest:
        return probe_request(spec.served_name, task)


def probe_request(served_name: str, task: str) -> ProbeRequest:
    """The one real request that proves an OpenAI-compatible engine serves ``task``."""
    if task == "embedding":
        return ProbeRequest("/v1/embeddings", {"model": served_name, "input": "Hi"})
    if task == "rerank":
        return ProbeRequest("/v1/rerank", {"model": served_name, "query": "Hi", "documents": ["Hi", "Bye"]})
    if task in ("chat", "completion"):
        return ProbeRequest("/v1/completions", {"model": served_name, "prompt": "Hi", "max_tokens": 1})
    raise ValueError(f"unknown task {task!r}; expected chat, completion, embedding or rerank")


def _cross_checks(config: dict[str, Any], problems: list[Problem]) -> None:
    if config["pooling"] is not None and not config["embeddings"]:
        problems.append({"field": "pooling", "message": "applies only with embeddings: true"})
    if config["embeddings"] and config["reranking"]:
        problems.append({"field": "reranking", "message": "cannot be combined with embeddings (a reranker pools by rank)"})
    if config["batch_size"] and config["ubatch_size"] and config["ubatch_size"] > config["batch_size"]:
        problems.append({"field": "ubatch_size", "message": "must not exceed batch_size"})
    if config["draft_max"] and not config["draft_model"]:
        problems.append({"field": "draft_max", "message": "applies only with a draft_model"})
    if config["draft_model"] and (config["embeddings"] or config["reranking"]):
        problems.append({"field": "draft_model", "message": "speculative decoding is for generation, not embeddings "
                                                            "or reranking"})
    if config["context"] and config["parallel"] and config["context"] < config["parallel"] * 16:
        problems.append({"field": "context", "message": "leaves fewer than 16 tokens per parallel slot"})
