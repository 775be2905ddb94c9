"""Can a node's engine load this model? For GGUF, the file whole (its tensor data ends within it)
and the architecture in the header against what the installed llama.cpp knows; for safetensors,
``config.json``'s architectures against vLLM's.

llama.cpp's architecture names (``LLM_ARCH_NAMES`` in ``src/llama-arch.cpp``) are read from the
installed ``llama-server`` binary when it is here: they sit in one run of strings between
``llama`` and ``(unknown)``. The linker folds a name that ends another (``qwen2`` inside
``rwkv6qwen2``), so the names below, taken from the binary built from llama-cpp-python 0.3.36
(llama.cpp commit 0c1e570), are always added. tests/serving/test_catalog_servability.py checks
both against a real llama-server loading a supported and an unsupported architecture.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

from django.conf import settings

from berth.errors import BerthError
from scheduler import memory
from scheduler.errors import ModelNotFound, UnreadableModel
from scheduler.estimation.reading import read_model
from serving.catalog import profiles
from serving.catalog.entries import served_path
from serving.engines import build_llamacpp

SOURCE_VERSION = "llama.cpp 0c1e570 (llama-cpp-python 0.3.36)"
KNOWN_LLAMACPP = frozenset("""
afmoe apertus arcee arctic arwkv7 baichuan bailingmoe bailingmoe2 bailingmoe3 bert bitnet bloom chameleon chatglm
codeshell cogvlm cohere2 cohere2moe command-r dbrx deci deepseek deepseek2 deepseek2-ocr deepseek32 deepseek4 dots1
dots3note dream ernie4_5 ernie4_5-moe eurobert exaone exaone-moe exaone4 falcon falcon-h1 gemma gemma-embedding gemma2
gemma3 gemma3n gemma4 gemma4-assistant glm-dsa glm4 glm4moe glm5-next gpt-oss gpt2 gptj gptneox granite granite_swa
granitehybrid granitemoe graniteswitch grok grovemoe hrm_text hunyuan-dense hunyuan-moe hunyuan_vl hy_v3 hy_v4
internlm2 jais jais2 jamba jina-bert-v2 jina-bert-v3 kimi-k3 kimi-linear laguna lfm2 lfm2moe llada llada-moe llama
llama-embed llama4 maincoder mamba mamba2 maple mellum mimo2 minicpm minicpm3 minimax-01 minimax-m2 mistral3 mistral4
modern-bert mpt nanbeige nemotron nemotron_h nemotron_h_moe neo-bert nomic-bert nomic-bert-moe olmo olmo2 olmoe openelm
orion pangu-embedded phi2 phi3 phi4 phimoe plamo plamo2 plamo3 plm pockettts qwen qwen2 qwen2moe qwen2vl qwen3 qwen35
qwen35moe qwen3moe qwen3next qwen3tts qwen3vl qwen3vlmoe qwen4exp refact rnd1 rwkv6 rwkv6qwen2 rwkv7 seed_oss
smallthinker smollm3 spark2_5 stablelm starcoder starcoder2 step35 t5 t5encoder talkie wavtokenizer-dec xverse
""".split())
# vLLM's model classes named in config.json (the common ones; vLLM itself is the final word).
KNOWN_VLLM = frozenset("""
LlamaForCausalLM MistralForCausalLM Qwen2ForCausalLM Qwen3ForCausalLM Qwen3MoeForCausalLM Qwen2MoeForCausalLM
GemmaForCausalLM Gemma2ForCausalLM Gemma3ForCausalLM Phi3ForCausalLM MixtralForCausalLM GPT2LMHeadModel
GPTNeoXForCausalLM FalconForCausalLM DeepseekV2ForCausalLM DeepseekV3ForCausalLM OlmoForCausalLM Olmo2ForCausalLM
GraniteForCausalLM StableLmForCausalLM BertModel XLMRobertaModel GptOssForCausalLM
""".split())


@functools.lru_cache(maxsize=8)
def architectures_in_binary(binary: str) -> frozenset[str]:
    """The architecture names in a llama-server binary (empty when the run of names is not found)."""
    data = Path(binary).read_bytes()
    start = data.find(b"\0llama\0deci\0")
    if start < 0:
        return frozenset()
    end = data.find(b"(unknown)\0", start)
    if end < 0 or end - start > 64 * 1024:
        return frozenset()
    return frozenset(name.decode() for name in data[start + 1:end].split(b"\0") if name)


def llamacpp_architectures() -> frozenset[str]:
    engine = build_llamacpp.installed(Path(settings.ENGINE_CACHE_DIR))
    found = architectures_in_binary(str(engine.path)) if engine is not None else frozenset()
    return found | KNOWN_LLAMACPP


@dataclasses.dataclass(frozen=True)
class Servability:
    servable: bool
    engine: str
    architecture: str
    reason: str
    estimate: dict | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def check(path: str | Path, *, profile: dict | None = None, with_estimate: bool = True) -> Servability:
    """Whether the installed engine can load the model at ``path`` (a GGUF file or a safetensors
    folder), with its memory estimate at the catalog ``profile``'s settings (context, parallel)."""
    path = Path(path)
    if path.is_dir() and (path / "config.json").exists():
        config = json.loads((path / "config.json").read_text())
        names = config.get("architectures") or []
        known = [n for n in names if n in KNOWN_VLLM]
        if not known:
            return Servability(False, "vllm", ", ".join(names) or "?",
                               f"vLLM does not list {', '.join(names) or 'an architecture'} among the models it serves.")
        verdict = Servability(True, "vllm", known[0], "")
    else:
        try:
            shape = read_model(path)
        except (ModelNotFound, UnreadableModel) as error:
            return Servability(False, "llamacpp", "", error.message)
        if shape.data_end_bytes is not None and shape.data_end_bytes > shape.file_bytes:
            # Its header reads, so nothing else would notice: llama.cpp fails on every launch.
            return Servability(False, "llamacpp", shape.architecture,
                               f"{path.name} is cut short: its tensor data ends at byte {shape.data_end_bytes:,} "
                               f"but the file has {shape.file_bytes:,} bytes "
                               f"({shape.data_end_bytes - shape.file_bytes:,} missing); copy or fetch it again.")
        if shape.architecture not in llamacpp_architectures():
            return Servability(False, "llamacpp", shape.architecture,
                               f"The installed llama.cpp ({SOURCE_VERSION}) does not know the architecture "
                               f"{shape.architecture!r}.")
        verdict = Servability(True, "llamacpp", shape.architecture, "")
    if not with_estimate:
        return verdict
    return _with_estimate(verdict, path, profile or {})


def check_entry(entry) -> Servability:
    """``check`` for a catalog model as its first profile serves it (BerthError when it has no
    servable file)."""
    return check(served_path(entry), profile=profiles.first(entry))


def _with_estimate(verdict: Servability, path: Path, profile: dict) -> Servability:
    """The verdict with the estimator's figure for one replica (per GPU for vLLM); a model whose
    weights cannot be read is not servable, and the reason says why."""
    try:
        result = memory.estimate_and_fit(path, verdict.engine, profiles.estimate_config(profile, verdict.engine),
                                         check_root=False)
    except BerthError as error:
        return dataclasses.replace(verdict, servable=False, reason=error.message)
    return dataclasses.replace(verdict, estimate={"total_bytes": result.estimate.total_bytes,
                                                  "breakdown": result.estimate.as_dict()})
