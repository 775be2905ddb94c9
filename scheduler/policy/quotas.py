"""Tenant quotas inside placement: limits refuse (naming the scope and figure), guarantees protect,
and what a scope holds beyond its guarantee is borrowed and can be taken back.

Holdings are counted from the replicas the pass sees (each replica's GPUs, GPU memory and the
cores of CPU replicas, summed to its owner and every ancestor), plus what the caller says is held
outside the snapshot (``external``). Scope paths are written ``acme/ml/training``.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from scheduler.policy.inputs import GIB, Profile, ReplicaInfo, ScopeContract

FIGURES = ("gpus", "cores", "gpu_memory_gib")
LABELS = {"gpus": "GPUs", "cores": "CPU cores", "gpu_memory_gib": "GPU memory (GiB)"}


def ancestors(path: str) -> list[str]:
    """``a/b/c`` → ``[a/b/c, a/b, a]`` (nearest first); ``''`` (shared) → ``[]``."""
    if not path:
        return []
    parts = path.split("/")
    return ["/".join(parts[:i]) for i in range(len(parts), 0, -1)]


def need_of(profile: Profile, extra_bytes: int = 0) -> tuple[float, float, float]:
    if profile.on_gpu:
        return (float(profile.gpus), 0.0, (profile.memory_bytes + extra_bytes) * profile.gpus / GIB)
    return (0.0, float(profile.cpu_cores), 0.0)


def replica_need(replica: ReplicaInfo) -> tuple[float, float, float]:
    if replica.accelerators:
        n = len(replica.accelerators)
        return (float(n), 0.0, replica.memory_bytes * n / GIB)
    return (0.0, float(replica.cpu_cores), 0.0)


def _fmt(value: float) -> str:
    return f"{value:g}"


class Quotas:
    def __init__(self, contracts: Iterable[ScopeContract], owners: Mapping[str, str],
                 replicas: Iterable[ReplicaInfo] = (), external: Mapping[str, tuple] | None = None):
        self.contracts = {c.path: c for c in contracts}
        self.owners = owners  # model id → owner path
        self.held: dict[str, list[float]] = {}
        for path, figures in (external or {}).items():
            self._add(path, figures, +1)
        for replica in replicas:
            self.add(replica)

    @property
    def governed(self) -> bool:
        return bool(self.contracts)

    def copy(self) -> "Quotas":
        clone = Quotas.__new__(Quotas)
        clone.contracts, clone.owners = self.contracts, self.owners
        clone.held = {k: list(v) for k, v in self.held.items()}
        return clone

    def _add(self, owner: str, figures, sign: int) -> None:
        if not self.contracts:
            return
        for path in ancestors(owner):
            if path in self.contracts:
                row = self.held.setdefault(path, [0.0, 0.0, 0.0])
                for i in range(3):
                    row[i] += sign * figures[i]

    def add(self, replica: ReplicaInfo) -> None:
        self._add(self.owners.get(replica.model, ""), replica_need(replica), +1)

    def remove(self, replica: ReplicaInfo) -> None:
        self._add(self.owners.get(replica.model, ""), replica_need(replica), -1)

    def refusal(self, owner: str, need: tuple) -> str:
        """'' when every limit on the owner's chain allows ``need``; else the first refusal, named."""
        for path in ancestors(owner):
            contract = self.contracts.get(path)
            if contract is None:
                continue
            held = self.held.get(path, [0.0, 0.0, 0.0])
            for i, (figure, limit) in enumerate(contract.limit.items()):
                if limit is None or not need[i]:
                    continue
                if held[i] + need[i] > limit + 1e-9:
                    name = contract.written or path
                    return (f"{name} is at its {LABELS[figure]} limit ({_fmt(held[i])} of {_fmt(limit)} held; "
                            f"{_fmt(need[i])} more asked)")
        return ""

    def guaranteed(self, owner: str, need: tuple) -> bool:
        """At least one guarantee on the chain, and usage + need within every one of them."""
        found = False
        for path in ancestors(owner):
            contract = self.contracts.get(path)
            if contract is None:
                continue
            held = self.held.get(path, [0.0, 0.0, 0.0])
            for i, (_, guarantee) in enumerate(contract.guarantee.items()):
                if guarantee is None:
                    continue
                found = True
                if held[i] + need[i] > guarantee + 1e-9:
                    return False
        return found

    def has_guarantee(self, owner: str) -> bool:
        return any(self.contracts.get(p) is not None and any(v is not None for _, v in self.contracts[p].guarantee.items())
                   for p in ancestors(owner))

    def borrowed(self, replicas: Iterable[ReplicaInfo]) -> set[str]:
        """Per guaranteed scope, its subtree's replicas oldest first, summed: every replica after
        which the sum exceeds the guarantee in any governed figure is borrowed."""
        result: set[str] = set()
        guaranteed = [c for c in self.contracts.values() if any(v is not None for _, v in c.guarantee.items())]
        if not guaranteed:
            return result
        ordered = sorted(replicas, key=lambda r: (r.created_at, r.id))
        for contract in guaranteed:
            sums = [0.0, 0.0, 0.0]
            for replica in ordered:
                owner = self.owners.get(replica.model, "")
                if contract.path not in ancestors(owner):
                    continue
                figures = replica_need(replica)
                for i in range(3):
                    sums[i] += figures[i]
                if any(g is not None and sums[i] > g + 1e-9 for i, (_, g) in enumerate(contract.guarantee.items())):
                    result.add(replica.id)
        return result
