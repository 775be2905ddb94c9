"""Canary and experiment splits (``ModelSplit``) as the gateway applies them: plain data loaded with
the routing table (``load_table``), so the hot path reads a dict and hashes the client id — no query.

A client always lands on the same variant of a split: the variant is picked by a stable hash of the
split's model name and the client's public id (blake2b, not Python's salted ``hash``), so every
gateway process and every restart agrees. Changing the weights moves only the clients whose hash
falls in the part of the range that changed owner.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib

from gateway.models import ModelSplit
from serving.control import routing


@dataclasses.dataclass(frozen=True)
class Split:
    model_name: str
    scope_path: str  # "" for a fleet-wide split
    variants: tuple[str, ...]
    bounds: tuple[int, ...]  # cumulative weights, same order as variants
    environments: frozenset  # allowed client environments; empty: any

    @property
    def total(self) -> int:
        return self.bounds[-1] if self.bounds else 0

    def applies_to(self, project_path: str) -> bool:
        path = self.scope_path
        return not path or project_path == path or project_path.startswith(path + "/")

    def allows_environment(self, environment: str) -> bool:
        return not self.environments or environment in self.environments

    def choose(self, client_id: str) -> str:
        """The variant this client sees (``model_name`` itself when the split has no variants)."""
        if not self.variants:
            return self.model_name
        digest = hashlib.blake2b(f"{self.model_name}\x00{client_id}".encode(), digest_size=8).digest()
        point = int.from_bytes(digest, "big") % self.total
        return self.variants[bisect.bisect_right(self.bounds, point)]


def applicable(table: routing.RoutingTable, model: str, project_path: str) -> Split | None:
    """The most specific enabled split of ``model`` that covers the caller's project, if any."""
    candidates = table.splits.get(model) if table.splits else None
    if not candidates:
        return None
    for split in candidates:  # most specific first
        if split.applies_to(project_path):
            return split
    return None


def callable_models(table: routing.RoutingTable, project_path: str, environment: str,
                    allows) -> dict[str, routing.ModelRoute]:
    """The names a client of ``project_path`` in ``environment`` may call, with the route each
    answers as: what ``/v1/models`` lists for its key, and the playground for its person. A split's
    own name is listed only where the split covers the caller (it answers as its first variant) —
    another tenant's scoped split stays unseen; ``allows(name)`` is the client's model rule."""
    listed = dict(table.models)
    for name in table.splits:  # a split's own name need not be a model
        if name not in listed:
            split = applicable(table, name, project_path)
            target = table.route(split.variants[0]) if split is not None and split.variants else None
            if target is not None:
                listed[name] = target
    found = {}
    for name, route in listed.items():
        if not allows(name) or not route.admits(project_path):  # another tenant's own model stays unseen
            continue
        split = applicable(table, name, project_path) if table.splits else None
        if split is not None and not split.allows_environment(environment):
            continue
        found[name] = route
    return found


def load_splits() -> dict[str, tuple[Split, ...]]:
    """Every enabled split, by the model name it answers to, most specific scope first. One query."""
    found: dict[str, list[Split]] = {}
    rows = ModelSplit.objects.filter(enabled=True).values_list("model_name", "scope__path", "variants",
                                                                "environments")
    for model_name, scope_path, variants, environments in rows:
        names, bounds, total = [], [], 0
        for variant in variants or ():
            weight = int(variant.get("weight") or 0)
            if weight <= 0 or not variant.get("model"):
                continue
            total += weight
            names.append(variant["model"])
            bounds.append(total)
        found.setdefault(model_name, []).append(
            Split(model_name=model_name, scope_path=scope_path or "", variants=tuple(names), bounds=tuple(bounds),
                  environments=frozenset(environments or ())))
    return {name: tuple(sorted(items, key=lambda s: len(s.scope_path), reverse=True))
            for name, items in found.items()}


def load_table() -> routing.RoutingTable:
    """The routing table with the splits attached (what the gateway's ``RoutingCache`` loads)."""
    table = routing.load_table()
    return dataclasses.replace(table, splits=load_splits())
