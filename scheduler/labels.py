"""Node labels, written as Kubernetes writes them: what an admin sets on a node and what a catalog
profile's node selector asks for (``zone=a``, ``berth.example/pool=gpu-large``).

A key is an optional prefix (a DNS subdomain of at most 253 characters) and a slash, then a name
of at most 63 characters: letters, digits, ``-``, ``_`` and ``.``, beginning and ending with a
letter or digit. A value is empty or a name of the same form. One set of rules for both sides, so
a selector can only ask for a label a node can carry.
"""

from __future__ import annotations

import re
from typing import Any

NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
PREFIX = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
MAX_LABELS = 64


def key_problem(key: Any) -> str:
    """Why ``key`` is no label key, or ''."""
    if not isinstance(key, str) or not key:
        return "A label key is a non-empty text."
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not PREFIX.match(prefix)):
        return (f"{key!r}: the prefix before '/' is a DNS subdomain (lower-case letters, digits, '-' and '.'), "
                f"at most 253 characters.")
    if not NAME.match(name):
        return (f"{key!r}: a label name is 1-63 letters, digits, '-', '_' or '.', beginning and ending with a "
                f"letter or digit.")
    return ""


def value_problem(key: str, value: Any) -> str:
    """Why ``value`` is no value of the label ``key``, or ''."""
    if not isinstance(value, str):
        return f"{key}: a label value is a text (not {value!r})."
    if value and not NAME.match(value):
        return (f"{key}={value}: a label value is empty or 1-63 letters, digits, '-', '_' or '.', beginning and "
                f"ending with a letter or digit.")
    return ""


def problems(labels: Any) -> list[str]:
    """Every problem with ``labels`` ({key: value}); none when they are labels."""
    if not isinstance(labels, dict):
        return ["Labels are an object of key: value texts, e.g. {\"zone\": \"a\"}."]
    if len(labels) > MAX_LABELS:
        return [f"At most {MAX_LABELS} labels, not {len(labels)}."]
    found = []
    for key, value in labels.items():
        found.append(key_problem(key) or value_problem(key, value))
    return [p for p in found if p]


def written(labels: dict[str, str]) -> str:
    """How labels read in a sentence: ``zone=a, gpu=h100``."""
    return ", ".join(f"{k}={v}" for k, v in sorted(labels.items()))
