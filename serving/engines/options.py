"""Declared engine options and the validation every engine shares.

An engine declares its configuration keys as ``Option``s and its allowed extra flags as ``Flag``s;
``validate`` applies the defaults and collects *every* problem before raising, so a user fixing a
form sees all of them at once (``InvalidEngineConfig.details["problems"]``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

from serving.errors import InvalidEngineConfig

Problem = dict[str, str]


@dataclasses.dataclass(frozen=True)
class Option:
    """One configuration key: its type (``int``, ``float``, ``bool``, ``str``), default and bounds."""

    type: type
    default: Any = None
    choices: tuple[Any, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    pattern: str | None = None  # for strings: a full-match regular expression
    also: tuple[str, ...] = ()  # words accepted besides the type (e.g. "all" for a number of layers)
    help: str = ""

    def check(self, value: Any) -> str | None:
        """A problem with ``value``, or None."""
        if isinstance(value, str) and value in self.also:
            return None
        if self.choices is not None:
            if not any(value == choice and type(value) is type(choice) for choice in self.choices):
                return f"must be one of {', '.join(map(str, self.choices))}"
            return None
        if self.type is bool:
            return None if isinstance(value, bool) else "must be true or false"
        if self.type is int and (isinstance(value, bool) or not isinstance(value, int)):
            return "must be a whole number" + (f" or {' or '.join(self.also)}" if self.also else "")
        if self.type is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
            return "must be a number"
        if self.type is str:
            if not isinstance(value, str):
                return "must be a string"
            if self.pattern and not re.fullmatch(self.pattern, value):
                return f"must match {self.pattern}"
        if self.minimum is not None and value < self.minimum:
            return f"must be at least {self.minimum:g}"
        if self.maximum is not None and value > self.maximum:
            return f"must be at most {self.maximum:g}"
        return None


@dataclasses.dataclass(frozen=True)
class Flag:
    """An extra command-line flag a user may add. ``value`` is None for a switch, else a check of
    the value's text that returns a problem or None."""

    value: Callable[[str], str | None] | None = None


def switch() -> Flag:
    return Flag(None)


def number(minimum: float | None = None, maximum: float | None = None, whole: bool = False) -> Flag:
    def check(text: str) -> str | None:
        try:
            value = int(text) if whole else float(text)
        except ValueError:
            return "needs a whole number" if whole else "needs a number"
        if minimum is not None and value < minimum:
            return f"must be at least {minimum:g}"
        if maximum is not None and value > maximum:
            return f"must be at most {maximum:g}"
        return None

    return Flag(check)


def one_of(*choices: str) -> Flag:
    return Flag(lambda text: None if text in choices else f"must be one of {', '.join(choices)}")


def validate(config: Any, options: dict[str, Option], flags: dict[str, Flag],
             extra: Callable[[dict[str, Any], list[Problem]], None] | None = None,
             engine: str = "engine") -> dict[str, Any]:
    """``config`` with defaults applied, or InvalidEngineConfig listing every problem.

    ``extra_flags`` (always allowed) is a list of ``"--flag"`` or ``"--flag=value"`` strings, each
    checked against ``flags``; ``extra`` adds cross-field checks on the cleaned values.
    """
    problems: list[Problem] = []
    if config is None:
        config = {}
    if not isinstance(config, dict):
        raise InvalidEngineConfig(f"The {engine} configuration must be an object.",
                                  details={"problems": [{"field": "", "message": "must be an object"}],
                                           "allowed": sorted([*options, "extra_flags"])})
    allowed = sorted([*options, "extra_flags"])
    cleaned: dict[str, Any] = {}
    for key in config:
        if key not in options and key != "extra_flags":
            problems.append({"field": str(key),
                             "message": f"unknown key; allowed: {', '.join(allowed)}"})
    for key, option in options.items():
        value = config.get(key)
        if value is None:  # absent or null: the default
            value = option.default
        if value is None:
            cleaned[key] = None
            continue
        problem = option.check(value)
        if problem:
            problems.append({"field": key, "message": problem})
            cleaned[key] = None  # cross-field checks skip what is already wrong
        else:
            cleaned[key] = float(value) if option.type is float else value
    cleaned["extra_flags"] = _extra_flags(config.get("extra_flags", []), flags, problems)
    if extra:
        extra(cleaned, problems)
    if problems:
        summary = "; ".join(f"{p['field'] or 'configuration'}: {p['message']}" for p in problems)
        raise InvalidEngineConfig(f"The {engine} configuration is not valid: {summary}.",
                                  details={"problems": problems, "allowed": allowed,
                                           "allowed_flags": sorted(flags)})
    return cleaned


def _extra_flags(raw: Any, flags: dict[str, Flag], problems: list[Problem]) -> list[str]:
    if raw is None:
        return []
    if not isinstance(raw, list) or not all(isinstance(item, str) for item in raw):
        problems.append({"field": "extra_flags", "message": 'must be a list of "--flag" or "--flag=value" strings'})
        return []
    cleaned: list[str] = []
    for item in raw:
        name, has_value, value = item.partition("=")
        field = f"extra_flags[{item}]"
        flag = flags.get(name)
        if flag is None:
            problems.append({"field": field, "message": f"{name} is not allowed; allowed: {', '.join(sorted(flags))}"})
        elif flag.value is None and has_value:
            problems.append({"field": field, "message": f"{name} takes no value"})
        elif flag.value is not None and not has_value:
            problems.append({"field": field, "message": f"{name} needs a value ({name}=VALUE)"})
        elif flag.value is not None and (problem := flag.value(value)):
            problems.append({"field": field, "message": f"{name} {problem}"})
        else:
            cleaned.append(item)
    return cleaned


def flag_argv(extra_flags: list[str]) -> list[str]:
    """``["--a", "--b=1"]`` → ``["--a", "--b", "1"]`` (each already validated)."""
    argv: list[str] = []
    for item in extra_flags:
        name, has_value, value = item.partition("=")
        argv.extend([name, value] if has_value else [name])
    return argv
