"""Where one replica goes: filters with reasons a person can read, then an order among the rest.

Filters per node (and accelerator): node state, engine installed and ready, label selectors,
accelerator class, MIG rules, free memory / accelerators / cores (what replicas reserve, not
guesses), disk only when the node lacks the weights, and spread: never a second replica of a model
on a physical GPU that already runs one (a MIG instance counts as its parent card — two instances of
one card share its failures — so two replicas there add no availability; they would only share its
compute and crowd out other models). CPU replicas have no card and only the order below spreads
them. Order: spread replicas of one model across
nodes (a preference, dropped only when it is the sole obstacle because it is only an order), nodes
holding the weights first, then bin-packing for GPU profiles (least memory left over on the chosen
accelerators — best fit — then fewest accelerators that still fit) or fewest replicas for CPU profiles, then the node's name.

:class:`Fleet` is the mutable working copy of the inventory a pass (or a dry run) plays on;
``copy()`` is what preemption and headroom dry-run on.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Iterable

from scheduler.policy.inputs import GIB, DesiredModel, NodeInfo, Profile, ReplicaInfo


def gib(value: int | float) -> str:
    return f"{value / GIB:,.1f} GiB"


@dataclasses.dataclass(frozen=True)
class Spot:
    node: str
    accelerators: tuple[str, ...]
    memory_bytes: int
    cpu_cores: int
    key: tuple = ()


class Fleet:
    """Free memory per accelerator, RAM and cores per node, replicas per node and model."""

    def __init__(self, nodes: Iterable[NodeInfo], replicas: Iterable[ReplicaInfo] = ()):
        self.nodes: dict[str, NodeInfo] = {n.name: n for n in sorted(nodes, key=lambda n: n.name)}
        self.acc_node: dict[str, str] = {}
        self.acc_info = {}
        self.free_acc: dict[str, int] = {}
        self.mig_used: set[str] = set()
        self.free_ram: dict[str, int | None] = {}
        self.free_cores: dict[str, int | None] = {}
        for node in self.nodes.values():
            self.free_ram[node.name] = node.memory_bytes
            self.free_cores[node.name] = node.cpu_count
            for acc in node.accelerators:
                self.acc_node[acc.id] = node.name
                self.acc_info[acc.id] = acc
                if acc.memory_bytes is not None:
                    self.free_acc[acc.id] = acc.memory_bytes
        self.on_node: dict[tuple[str, str], int] = {}
        self.count_on_node: dict[str, int] = {}
        self.model_nodes: dict[str, dict[str, int]] = {}  # model → node → replicas there
        self.model_cards: dict[str, dict[str, int]] = {}  # model → physical GPU → replicas there
        # The models whose map in model_nodes a copy may change; None: all (this fleet made them).
        self._owned: set[str] | None = None
        self.replicas: dict[str, ReplicaInfo] = {}
        self._index: _Index | None = None
        self._shared: dict = {}  # per node set, shared by copies: shapes, weights → nodes
        for replica in replicas:
            self.add(replica)

    def copy(self) -> "Fleet":
        clone = Fleet.__new__(Fleet)
        clone.nodes, clone.acc_node, clone.acc_info = self.nodes, self.acc_node, self.acc_info
        clone.free_acc = dict(self.free_acc)
        clone.mig_used = set(self.mig_used)
        clone.free_ram, clone.free_cores = dict(self.free_ram), dict(self.free_cores)
        clone.on_node, clone.count_on_node = dict(self.on_node), dict(self.count_on_node)
        # Copy on write: a copy shares the per-model maps until it changes one (dry runs copy often
        # and change little).
        clone.model_nodes = dict(self.model_nodes)
        clone.model_cards = dict(self.model_cards)
        clone._owned = set()
        clone.replicas = dict(self.replicas)
        clone._shared = self._shared
        clone._index = self.index().copy()  # built once on the original, then copied with it
        clone._index.fleet = clone
        return clone

    # --- the index of free room (built on first use, then kept up to date) -----------------------

    def index(self) -> "_Index":
        if self._index is None:
            self._index = _Index(self)
        return self._index

    def shape(self, name: str) -> tuple:
        """What about a node never changes in a pass: equal shapes with equal free room are
        interchangeable for placement (but for their names, the last tie-break)."""
        shapes = self._shared.setdefault("shapes", {})
        found = shapes.get(name)
        if found is None:
            node = self.nodes[name]
            found = (node.state, tuple(sorted(node.engines)), tuple(sorted(node.engines_installing)),
                     tuple(sorted(node.labels.items())), node.cpu_count, node.memory_bytes, node.disk_free_bytes,
                     tuple(sorted((a.accelerator_class, a.mig, a.placeable, a.memory_bytes is None,
                                   a.unplaceable_reason) for a in node.accelerators)))
            shapes[name] = found
        return found

    def weight_nodes(self, key: str) -> tuple[str, ...]:
        if not key:
            return ()
        table = self._shared.get("weights")
        if table is None:
            table = {}
            for node in self.nodes.values():
                for w in node.weights:
                    table.setdefault(w, []).append(node.name)
            self._shared["weights"] = table
        return tuple(table.get(key, ()))

    def node_state(self, name: str) -> tuple:
        """The free room of a node (what a placement there would see), in a comparable form."""
        node = self.nodes[name]
        frees = []
        for acc in node.accelerators:
            if acc.placeable and acc.id in self.free_acc and acc.id not in self.mig_used:
                frees.append((self.free_acc[acc.id], acc.accelerator_class, acc.mig))
        frees.sort()
        return (tuple(frees), self.free_ram.get(name), self.free_cores.get(name), self.count_on_node.get(name, 0))

    def card_of(self, acc_id: str) -> str:
        """The physical GPU of an accelerator (a MIG instance's parent card; a whole GPU itself)."""
        info = self.acc_info.get(acc_id)
        return info.card_id if info is not None else acc_id

    def cards_used(self, model_id: str) -> dict[str, int]:
        """The physical GPUs that run a replica of the model (card → replicas), not to be changed."""
        return self.model_cards.get(model_id, {})

    def _own(self, table: dict, model_id: str) -> dict:
        """The model's map in ``table``, copied first when a copy still shares it (copy on write)."""
        per = table.get(model_id)
        if per is None:
            per = table[model_id] = {}
        elif self._owned is not None and model_id not in self._owned:
            per = table[model_id] = dict(per)
        return per

    def _apply(self, replica: ReplicaInfo, sign: int) -> None:
        node = replica.node
        if replica.accelerators:
            for acc in replica.accelerators:
                if acc in self.free_acc:
                    self.free_acc[acc] -= sign * replica.memory_bytes
                if self.acc_info.get(acc) is not None and self.acc_info[acc].mig:
                    (self.mig_used.add if sign > 0 else self.mig_used.discard)(acc)
        elif self.free_ram.get(node) is not None:
            self.free_ram[node] -= sign * replica.memory_bytes
        if replica.cpu_cores and self.free_cores.get(node) is not None:
            self.free_cores[node] -= sign * replica.cpu_cores
        key = (node, replica.model)
        self.on_node[key] = self.on_node.get(key, 0) + sign
        self.count_on_node[node] = self.count_on_node.get(node, 0) + sign
        per = self._own(self.model_nodes, replica.model)
        per[node] = per.get(node, 0) + sign
        if per[node] <= 0:
            del per[node]
        if replica.accelerators:
            cards = self._own(self.model_cards, replica.model)
            for card in {self.card_of(a) for a in replica.accelerators}:
                cards[card] = cards.get(card, 0) + sign
                if cards[card] <= 0:
                    del cards[card]
        elif self._owned is not None and replica.model not in self._owned:
            self._own(self.model_cards, replica.model)  # both maps are owned together from here
        if self._owned is not None:
            self._owned.add(replica.model)
        if self._index is not None and node in self.nodes:
            self._index.update(node)

    def add(self, replica: ReplicaInfo) -> None:
        self.replicas[replica.id] = replica
        self._apply(replica, +1)

    def remove(self, replica_id: str) -> ReplicaInfo:
        replica = self.replicas.pop(replica_id)
        self._apply(replica, -1)
        return replica

    def total_free_bytes(self) -> int:
        return sum(v for v in self.free_acc.values() if v > 0) + sum(v for v in self.free_ram.values() if v and v > 0)


class _Index:
    """Nodes grouped by (shape, free room): members of a group are interchangeable but for their
    names, so a placement looks at one member per group. ``levels`` lists, sorted, each distinct
    free accelerator size of each group, so best fit walks up from the size a replica needs and
    stops as soon as nothing further up can fit better. Updated node by node as the working copy
    changes; copied with it."""

    def __init__(self, fleet: Fleet | None):
        if fleet is None:
            return
        self.fleet = fleet
        self.node_gid: dict[str, int] = {}
        self.groups: dict[int, list[str]] = {}  # gid → member names, sorted
        self.gid_of: dict[tuple, int] = {}
        self.sig_of: dict[int, tuple] = {}
        self.levels: list[tuple[int, int]] = []  # (free bytes, gid)
        self.next_gid = 0
        for name in fleet.nodes:  # sorted by name: members lists stay sorted by appending
            self._join(name, self._sig(name), sorted_append=True)

    def copy(self) -> "_Index":
        clone = _Index(None)
        clone.fleet = None  # set by the fleet that owns it
        clone.node_gid = dict(self.node_gid)
        clone.groups = {g: list(m) for g, m in self.groups.items()}
        clone.gid_of, clone.sig_of = dict(self.gid_of), dict(self.sig_of)
        clone.levels = list(self.levels)
        clone.next_gid = self.next_gid
        return clone

    def _sig(self, name: str) -> tuple:
        return (self.fleet.shape(name), self.fleet.node_state(name))

    def _join(self, name: str, sig: tuple, sorted_append: bool = False) -> None:
        gid = self.gid_of.get(sig)
        if gid is None:
            gid = self.next_gid
            self.next_gid += 1
            self.gid_of[sig], self.sig_of[gid] = gid, sig
            self.groups[gid] = [name]
            for free in sorted({f for f, _, _ in sig[1][0]}):
                bisect.insort(self.levels, (free, gid))
        elif sorted_append:
            self.groups[gid].append(name)
        else:
            bisect.insort(self.groups[gid], name)
        self.node_gid[name] = gid

    def _leave(self, name: str) -> None:
        gid = self.node_gid.pop(name)
        members = self.groups[gid]
        members.pop(bisect.bisect_left(members, name))
        if not members:
            sig = self.sig_of.pop(gid)
            del self.groups[gid], self.gid_of[sig]
            for free in {f for f, _, _ in sig[1][0]}:
                i = bisect.bisect_left(self.levels, (free, gid))
                del self.levels[i]

    def update(self, name: str) -> None:
        sig = self._sig(name)
        gid = self.node_gid.get(name)
        if gid is not None and self.sig_of[gid] == sig:
            return
        if gid is not None:
            self._leave(name)
        self._join(name, sig)

    def representative(self, gid: int, skip) -> str | None:
        for name in self.groups[gid]:
            if name not in skip:
                return name
        return None


# --- filters -------------------------------------------------------------------------------------

def static_reason(node: NodeInfo, profile: Profile) -> str:
    """Why this node can never take this profile as it stands (state, engine, labels, class), or ''."""
    if node.state != "ready":
        return f"{node.name} is {node.state}: no new work goes there"
    if profile.engine not in node.engines:
        if profile.engine in node.engines_installing:
            return f"{node.name} is still installing {profile.engine}"
        return f"{node.name} has no {profile.engine} engine ready"
    for label, value in sorted(profile.node_selector.items()):
        if node.labels.get(label) != value:
            return f"{node.name} lacks the label {label}={value}"
    if profile.on_gpu:
        usable = _class_accelerators(node, profile)
        if not usable and profile.gpus > 1 and any(a.mig and a.placeable for a in node.accelerators):
            return (f"{node.name} has only MIG instances, which cannot take shards of a {profile.gpus}-way "
                    f"tensor-parallel replica (needs {profile.gpus} whole accelerators on one node)")
        if not usable:
            return f"{node.name} has no placeable accelerator of class {profile.class_text}"
        if len(usable) < profile.gpus:
            return (f"{node.name} has {len(usable)} placeable accelerator(s) of class {profile.class_text}, "
                    f"needs {profile.gpus} on one node")
    return ""


def class_matches(wanted: tuple[str, ...], actual: str) -> bool:
    """Whether an accelerator of class ``actual`` is one of ``wanted`` (any when none is wanted).
    A wanted class names a family as well as one class: discovery names cards ``h100-80g`` and
    their MIG instances ``h100-80g-mig-3g.40gb``, so ``h100`` takes every H100 and ``h100-80g`` the
    80 GB ones (and their instances, where the profile accepts MIG). Case does not matter."""
    if not wanted:
        return True
    actual = (actual or "").lower()
    for w in wanted:
        w = w.lower()
        if actual == w or actual.startswith(w + "-"):
            return True
    return False


def _class_accelerators(node: NodeInfo, profile: Profile):
    found = []
    for acc in node.accelerators:
        if not acc.placeable or acc.memory_bytes is None:
            continue
        if not class_matches(profile.classes, acc.accelerator_class):
            continue
        if acc.mig and (profile.gpus != 1 or not profile.allow_mig):
            continue  # a MIG instance takes one single-accelerator replica, never a tensor-parallel shard
        found.append(acc)
    return found


def accelerator_reasons(node: NodeInfo, profile: Profile) -> list[str]:
    """Per accelerator that was filtered out statically, why (for explain)."""
    reasons = []
    for acc in node.accelerators:
        where = f"{node.name} #{acc.index}{' (MIG)' if acc.mig else ''}"
        if not acc.placeable:
            reasons.append(f"{where}: {acc.unplaceable_reason or 'not placeable'}")
        elif acc.memory_bytes is None:
            reasons.append(f"{where}: memory total never measured")
        elif not class_matches(profile.classes, acc.accelerator_class):
            reasons.append(f"{where}: class {acc.accelerator_class or 'unknown'}, needs {profile.class_text}")
        elif acc.mig and profile.gpus != 1:
            reasons.append(f"{where}: a MIG instance cannot take a shard of a {profile.gpus}-way tensor-parallel replica")
        elif acc.mig and not profile.allow_mig:
            reasons.append(f"{where}: the profile does not run on MIG instances")
    return reasons


def _profile_sig(profile: Profile) -> tuple:
    """What the static filters read of a profile: profiles alike in these share cached results."""
    return (profile.engine, tuple(sorted(profile.node_selector.items())), profile.classes, profile.gpus,
            profile.allow_mig)


class Placer:
    """Places replicas on a :class:`Fleet`; static filter results are cached per pass (per node
    and profile signature, so two models with alike profiles share them)."""

    def __init__(self):
        self._static: dict[tuple, str] = {}
        self._usable_ids: dict[tuple, list] = {}
        self.detailed_checks = 0  # how many (node, profile) dynamic checks were made (for the benchmark)
        # (model, node) pairs refused only by the spread rule (the node fits otherwise): how a
        # model's unplaced replicas are told apart from those that fit nowhere at all.
        self.spread_refusals: set[tuple[str, str]] = set()

    def static_for(self, node: NodeInfo, profile: Profile) -> str:
        key = (node.name, _profile_sig(profile))
        reason = self._static.get(key)
        if reason is None:
            reason = static_reason(node, profile)
            self._static[key] = reason
            if not reason and profile.on_gpu:
                self._usable_ids[key] = [a.id for a in _class_accelerators(node, profile)]
        return reason

    _static_for = static_for

    def forget_spread(self, model_id: str) -> None:
        self.spread_refusals = {pair for pair in self.spread_refusals if pair[0] != model_id}

    def usable(self, node: NodeInfo, profile: Profile) -> list:
        """The accelerator ids of ``node`` this (GPU) profile may use; [] when the node is filtered out."""
        if self.static_for(node, profile):
            return []
        return self._usable_ids.get((node.name, _profile_sig(profile)), [])

    def dynamic_reason(self, fleet: Fleet, node: NodeInfo, model: DesiredModel, profile: Profile,
                       extra_bytes: int = 0) -> tuple[str, Spot | None]:
        self.detailed_checks += 1
        name = node.name
        need = profile.memory_bytes + extra_bytes
        if profile.cpu_cores:
            free_cores = fleet.free_cores.get(name)
            if free_cores is not None and free_cores < profile.cpu_cores:
                return (f"{name} has {node.cpu_count} CPUs with {max(free_cores, 0)} free, needs {profile.cpu_cores}",
                        None)
        holds = bool(model.weights_key) and model.weights_key in node.weights
        if profile.min_disk_bytes and not holds and node.disk_free_bytes is not None \
                and node.disk_free_bytes < profile.min_disk_bytes:
            return (f"{name} has {gib(node.disk_free_bytes)} of disk free, needs {gib(profile.min_disk_bytes)} "
                    f"to fetch the weights", None)
        spread = fleet.on_node.get((name, model.id), 0)
        if profile.on_gpu:
            free_acc, mig_used, info = fleet.free_acc, fleet.mig_used, fleet.acc_info
            fitting = [(free_acc[a], info[a].index, a) for a in self._usable_ids[(name, _profile_sig(profile))]
                       if free_acc[a] >= need and a not in mig_used]
            if len(fitting) < profile.gpus:
                return (f"{name} has {len(fitting)} accelerator(s) with {gib(need)} free, needs {profile.gpus}", None)
            if spread:
                # No second replica on a card that runs one (the module's docstring says why).
                cards = fleet.cards_used(model.id)
                apart = [f for f in fitting if info[f[2]].card_id not in cards]
                if len(apart) < profile.gpus:
                    self.spread_refusals.add((model.id, name))
                    taken = sorted({info[a].index for _, _, a in fitting if info[a].card_id in cards})
                    return (f"{name}: the accelerators that fit (#{', #'.join(map(str, taken))}) already run a "
                            f"replica of {model.id}, and a second one on the same GPU would add no availability",
                            None)
                fitting = apart
            fitting.sort()
            chosen = fitting[:profile.gpus]
            left = sum(f for f, _, _ in chosen) - need * profile.gpus
            key = (spread, not holds, left, len(fitting), name)
            return "", Spot(name, tuple(a for _, _, a in chosen), need, profile.cpu_cores, key)
        free_ram = fleet.free_ram.get(name)
        if free_ram is not None and free_ram < need:
            return f"{name} has {gib(max(free_ram, 0))} of memory free, needs {gib(need)}", None
        key = (spread, not holds, fleet.count_on_node.get(name, 0), name)
        return "", Spot(name, (), need, profile.cpu_cores, key)

    def _spot_at(self, fleet: Fleet, name: str, model: DesiredModel, profile: Profile, extra_bytes: int):
        node = fleet.nodes[name]
        if self.static_for(node, profile):
            return None
        return self.dynamic_reason(fleet, node, model, profile, extra_bytes)[1]

    def best_spot(self, fleet: Fleet, model: DesiredModel, profile: Profile, extra_bytes: int = 0,
                  reasons: list | None = None) -> Spot | None:
        """The best spot by the order (spread, weights held, best fit, name), or None.

        With ``reasons`` every node is checked and each rejection is recorded (explain, and the
        reason a model is unschedulable). Without, the fleet's index is used: the few nodes where
        the model already runs or whose disk holds its weights are checked one by one, the rest
        one node per group of interchangeable nodes, walking up from the free size needed and
        stopping once nothing further up can fit better — the same answer as checking every node.
        """
        if reasons is not None:
            return self._scan(fleet, model, profile, extra_bytes, reasons)
        index = fleet.index()
        special = set(fleet.model_nodes.get(model.id, ())) | set(fleet.weight_nodes(model.weights_key))
        best = None
        for name in sorted(special):
            if name not in fleet.nodes:
                continue
            spot = self._spot_at(fleet, name, model, profile, extra_bytes)
            if spot is not None and (best is None or spot.key < best.key):
                best = spot
        if best is not None and best.key[0] == 0 and not best.key[1]:
            return best  # holds the weights, none of its replicas there: nothing else comes first
        general = None
        if profile.on_gpu:
            need = profile.memory_bytes + extra_bytes
            levels, seen = index.levels, set()
            i = bisect.bisect_left(levels, (need, -1))
            while i < len(levels):
                free, gid = levels[i]
                i += 1
                if general is not None and profile.gpus * (free - need) > general.key[2]:
                    break
                if gid in seen:
                    continue
                seen.add(gid)
                name = index.representative(gid, special)
                if name is None:
                    continue
                spot = self._spot_at(fleet, name, model, profile, extra_bytes)
                if spot is not None and (general is None or spot.key < general.key):
                    general = spot
        else:
            for gid in sorted(index.groups):
                name = index.representative(gid, special)
                if name is None:
                    continue
                spot = self._spot_at(fleet, name, model, profile, extra_bytes)
                if spot is not None and (general is None or spot.key < general.key):
                    general = spot
        if general is not None and (best is None or general.key < best.key):
            return general
        return best

    def _scan(self, fleet: Fleet, model: DesiredModel, profile: Profile, extra_bytes: int, reasons: list):
        best = None
        for node in fleet.nodes.values():
            reason = self.static_for(node, profile)
            if reason:
                reasons.append((profile.name, node.name, reason))
                continue
            reason, spot = self.dynamic_reason(fleet, node, model, profile, extra_bytes)
            if spot is None:
                reasons.append((profile.name, node.name, reason))
                continue
            if best is None or spot.key < best.key:
                best = spot
        return best


def constraint_refusal(fleet: Fleet, profile: Profile, placer: Placer) -> tuple[str, str] | None:
    """When a profile's own constraints (a node selector, an accelerator class) are what keeps it
    off every node, the refusal that names them — (sentence, code) — else None. Only ready nodes
    with the profile's engine count: a cordoned node with the label is not where it can go."""
    able = [n for n in fleet.nodes.values() if n.state == "ready" and profile.engine in n.engines]
    if not able:
        return None
    selector = dict(profile.node_selector)
    if selector:
        labelled = [n for n in able if all(n.labels.get(k) == v for k, v in selector.items())]
        if not labelled:
            missing = [f"{k}={v}" for k, v in sorted(selector.items())
                       if not any(n.labels.get(k) == v for n in able)]
            if missing:
                return (f"profile {profile.name} needs label {', '.join(missing)}; no ready node with the "
                        f"{profile.engine} engine has {'it' if len(missing) == 1 else 'them'}", "node-selector")
            every = ", ".join(f"{k}={v}" for k, v in sorted(selector.items()))
            return (f"profile {profile.name} needs labels {every}; no ready node with the {profile.engine} engine "
                    f"has them all", "node-selector")
        able = labelled
    if profile.on_gpu and profile.classes:
        if not any(not placer.static_for(n, profile) for n in able):
            if not any(class_matches(profile.classes, a.accelerator_class) for n in able for a in n.accelerators):
                return (f"profile {profile.name} needs accelerator class {profile.class_text}; no ready node"
                        f"{' with its labels' if selector else ''} has one", "accelerator-class")
            return None  # there are such accelerators, but not placeable or not as many: the nodes' reasons say
        return (f"profile {profile.name} needs accelerator class {profile.class_text}; no node has one free",
                "no-fit")
    return None


def ordered_profiles(model: DesiredModel) -> list[Profile]:
    """By priority (the operator wins), then measured tokens/s per accelerator or core, measured
    before unmeasured, then catalog order."""
    def per_unit(p: Profile) -> float:
        units = p.gpus if p.on_gpu else max(p.cpu_cores, 1)
        return p.tokens_per_s / units

    indexed = list(enumerate(model.profiles))
    indexed.sort(key=lambda item: (-item[1].priority, item[1].tokens_per_s is None,
                                   -(per_unit(item[1]) if item[1].tokens_per_s is not None else 0), item[0]))
    return [p for _, p in indexed]


def draft_bytes(model: DesiredModel) -> int:
    return model.draft.memory_bytes if model.draft is not None else 0
