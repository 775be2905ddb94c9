"""The deploy wizard's engine settings, drawn from each engine's declared options: what the wizard
offers is exactly what the engine validates, and a new option shows up without touching the form.

Each setting is a field named ``<engine>_<key>`` (``llamacpp_gpu_layers``, ``vllm_dtype``). The
catalog's own words (``context``, ``parallel``) are the form's common fields, so an engine key they
map to (vLLM's ``max_model_len``) is not offered twice. A blank field is the engine's default."""

from __future__ import annotations

from typing import Any

from django import forms

from serving.engines.options import Option
from serving.engines.registry import ENGINES, engine_for

ON, OFF = "on", "off"


def field_name(kind: str, key: str) -> str:
    return f"{kind}_{key}"


def offered(kind: str) -> dict[str, Option]:
    """The engine's options the wizard offers as its own fields (not those the common fields set)."""
    engine = engine_for(kind)
    common = set(engine.catalog_keys.values())
    return {key: option for key, option in engine.options.items() if key not in common}


# Words of option keys as people write them ("gpu_layers" → "GPU layers").
WORDS = {"gpu": "GPU", "cpu": "CPU", "gb": "GB", "kv": "KV", "k": "K", "v": "V", "attn": "attention",
         "ubatch": "micro-batch", "dtype": "data type"}


def label(key: str) -> str:
    words = [WORDS.get(word, word) for word in key.split("_")]
    return " ".join(words)[:1].upper() + " ".join(words)[1:]


def _field(option: Option) -> forms.Field:
    label_help = {"required": False, "help_text": option.help}
    if option.type is bool:
        default = ON if option.default else OFF
        return forms.ChoiceField(choices=[("", f"default ({default})"), (ON, ON), (OFF, OFF)], **label_help)
    if option.choices is not None:
        return forms.ChoiceField(choices=[("", "default"), *((str(c), str(c)) for c in option.choices)],
                                 **label_help)
    # Numbers stay text until read: "all" is a number of layers too, and the engine names every problem.
    return forms.CharField(max_length=1024, **label_help)


def fields() -> dict[str, forms.Field]:
    """Every engine's settings, as form fields."""
    made = {}
    for kind in ENGINES:
        for key, option in offered(kind).items():
            field = _field(option)
            field.label = label(key)
            made[field_name(kind, key)] = field
    return made


def _value(option: Option, text: str) -> Any:
    """A field's text as the engine takes it; text that is not the option's type stays text for the
    engine's validation to name (``must be a whole number``)."""
    if option.type is bool:
        return text == ON
    if option.choices is not None:
        return next((c for c in option.choices if str(c) == text), text)
    if option.type in (int, float):
        try:
            return option.type(text)
        except ValueError:
            return text
    return text


def read(kind: str, data: dict[str, Any]) -> dict[str, Any]:
    """The settings ``kind`` was given in the form's cleaned ``data`` (blank ones left out)."""
    config = {}
    for key, option in offered(kind).items():
        text = (data.get(field_name(kind, key)) or "").strip()
        if text:
            config[key] = _value(option, text)
    return config


def initial(kind: str, config: dict[str, Any]) -> dict[str, str]:
    """A configuration (a profile's, in ``kind``'s keys) as the fields' initial text."""
    values = {}
    for key, option in offered(kind).items():
        if config.get(key) is None:
            continue
        value = config[key]
        values[field_name(kind, key)] = (ON if value else OFF) if option.type is bool else str(value)
    return values


def groups(form) -> list[dict[str, Any]]:
    """The settings of each engine as the template shows them: one fieldset per engine, open where
    one of them is set or refused (closed, the defaults speak for themselves)."""
    shown = []
    for kind in ENGINES:
        fields = [form[field_name(kind, key)] for key in offered(kind)]
        shown.append({"kind": kind, "label": engine_for(kind).label, "fields": fields,
                      "open": any(f.errors or f.value() not in (None, "") for f in fields)})
    return shown
