"""Benchmark the placement policy: decision time, packing quality against the optimum, and a
day-long multi-tenant trace against other tools' rules. Not a test: prints three tables.

    manage.py bench_policy [--only time|packing|trace] [--passes 20] [--instances 200] [--seed 1]

Packing quality needs OR-Tools (the optional ``bench`` extra): ``pip install -e '.[bench]'``.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
import time

from django.core.management.base import BaseCommand, CommandError

from scheduler.policy.inputs import (
    GIB, AcceleratorInfo, DesiredModel, NodeInfo, Profile, ReplicaInfo, Scaling, Settings, Snapshot,
)
from scheduler.policy.plan import apply, schedule

G = GIB


class Command(BaseCommand):
    help = "Benchmark the placement policy (decision time, packing vs optimum, trace vs other tools' rules)."

    def add_arguments(self, parser):
        parser.add_argument("--only", choices=["time", "packing", "trace"], action="append")
        parser.add_argument("--passes", type=int, default=20)
        parser.add_argument("--instances", type=int, default=200)
        parser.add_argument("--seed", type=int, default=1)

    def handle(self, *args, **options):
        only = set(options["only"] or ["time", "packing", "trace"])
        if "packing" in only:
            try:
                import ortools  # noqa: F401
            except ImportError:
                raise CommandError("Packing quality needs OR-Tools: pip install -e '.[bench]' "
                                   "(or .venv/bin/pip install ortools).")
        if "time" in only:
            self.stdout.write(decision_time(options["passes"], options["seed"]))
        if "packing" in only:
            self.stdout.write(packing_quality(options["instances"], options["seed"]))
        if "trace" in only:
            self.stdout.write(trace_replay(options["seed"]))


# --- 1. decision time ----------------------------------------------------------------------------------

def big_fleet(rnd: random.Random, nodes=1000, gpus=8, models=2000):
    fleet = tuple(NodeInfo(f"node-{n:04d}", engines=frozenset({"vllm", "llamacpp"}), cpu_count=128,
                           memory_bytes=1024 * G, weights=frozenset({f"w{rnd.randrange(models)}" for _ in range(20)}),
                           accelerators=tuple(AcceleratorInfo(f"n{n}g{i}", i, "h100-80g", 76 * G)
                                              for i in range(gpus)))
                  for n in range(nodes))
    catalog = []
    for m in range(models):
        size = rnd.choice([4, 8, 14, 20, 35, 48, 70])
        tp = 1 if size < 70 or rnd.random() < 0.5 else rnd.choice([2, 4])
        low = rnd.choice([0, 1, 1, 1, 2, 3])
        catalog.append(DesiredModel(
            f"model-{m:04d}", (Profile("default", "vllm", tp, size * G // tp if tp > 1 else size * G),),
            Scaling(min=low, max=low + rnd.choice([0, 0, 1, 2])),
            capacity_class=rnd.choice(["", "", "critical", "standard", "opportunistic"]),
            owner=rnd.choice(["", "acme/a", "acme/b", "beta/x", "gamma"]), priority=rnd.randint(1, 100),
            weights_key=f"w{m}", last_requested_at=rnd.choice([None, 0.0]), extra=rnd.choice([0, 0, 1])))
    return fleet, tuple(catalog)


def _age(replicas, rnd, now):
    return tuple(dataclasses.replace(r, id=f"rep-{i:05d}", state="ready", ready_since=now - 3600,
                                     created_at=now - rnd.randint(600, 86400), last_used_at=now - rnd.randint(0, 3000),
                                     load_seconds=30.0, active_requests=rnd.choice([0, 0, 0, 1]))
                 for i, r in enumerate(replicas))


def _pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, math.ceil(q * len(values)) - 1)]


def decision_time(passes: int, seed: int) -> str:
    rnd = random.Random(seed)
    now = 1_000_000.0
    nodes, models = big_fleet(rnd)
    cold = Snapshot(now, nodes, models)
    started = time.perf_counter()
    plan = schedule(cold)
    cold_ms = (time.perf_counter() - started) * 1000
    resident = _age(apply(cold, plan).replicas, rnd, now)
    steady_times, churn_times, work, drain_times, drain_work = [], [], [], [], []
    drains = random.Random(seed + 1)  # its own draws: the churn passes stay those of earlier runs
    for p in range(passes):
        # Churn between passes: some replicas gone (crashed, drained), some wishes changed.
        kept = tuple(r for r in resident if rnd.random() > 0.02)
        changed = tuple(dataclasses.replace(m, extra=rnd.choice([0, 1])) if rnd.random() < 0.05 else m for m in models)
        snap = Snapshot(now + 60 * (p + 1), nodes, changed, kept)
        started = time.perf_counter()
        plan = schedule(snap)
        churn_times.append((time.perf_counter() - started) * 1000)
        work.append((len(plan.launches), len(plan.evictions), len(plan.unschedulable)))
        converged = apply(snap, plan)
        started = time.perf_counter()
        again = schedule(converged)
        steady_times.append((time.perf_counter() - started) * 1000)
        assert again.empty
        resident = _age(converged.replicas, rnd, now)
    # Then 1% of the nodes drain, other ones each pass: their replicas are replaced elsewhere. Apart
    # from the passes above, whose timings its allocations would otherwise disturb.
    for _ in range(passes):
        draining = set(drains.sample(range(len(nodes)), len(nodes) // 100))
        drained = tuple(dataclasses.replace(n, state="draining") if i in draining else n for i, n in enumerate(nodes))
        started = time.perf_counter()
        moving = schedule(dataclasses.replace(converged, nodes=drained))
        drain_times.append((time.perf_counter() - started) * 1000)
        drain_work.append((len(moving.launches), len(moving.moves)))
    replicas = len(resident)
    rows = [
        "Figure 1 — decision time: 1,000 nodes × 8 GPUs, 2,000 models "
        f"({replicas:,} replicas resident), {passes} passes",
        "",
        "| pass | median ms | p99 ms | launches / evictions / unschedulable per pass (median) |",
        "|---|---:|---:|---|",
        f"| full pass with churn (2% replicas lost, 5% scaling changes) | {statistics.median(churn_times):.0f} | "
        f"{_pct(churn_times, 0.99):.0f} | {statistics.median(w[0] for w in work):.0f} / "
        f"{statistics.median(w[1] for w in work):.0f} / {statistics.median(w[2] for w in work):.0f} |",
        f"| full pass, converged (empty plan) | {statistics.median(steady_times):.0f} | {_pct(steady_times, 0.99):.0f} | 0 / 0 / — |",
        f"| 1% of the nodes draining (replacements launched; moves) | {statistics.median(drain_times):.0f} | "
        f"{_pct(drain_times, 0.99):.0f} | {statistics.median(w[0] for w in drain_work):.0f} / "
        f"{statistics.median(w[1] for w in drain_work):.0f} moves / — |",
        f"| cold start (empty fleet, every replica to place), once | {cold_ms:.0f} | — | — |",
        "",
    ]
    return "\n".join(rows)


# --- 2. packing quality ------------------------------------------------------------------------------

def small_instance(rnd: random.Random):
    n_nodes = rnd.randint(1, 3)
    gpus = []
    for n in range(n_nodes):
        size = rnd.choice([24, 48, 80])
        for i in range(rnd.randint(1, 4)):
            gpus.append((f"n{n}", f"n{n}g{i}", size))
    items = [(f"m{m:02d}", rnd.randint(1, 10), rnd.randint(2, max(g[2] for g in gpus)))
             for m in range(rnd.randint(5, 30))]
    return gpus, items


def optimum(gpus, items) -> int:
    from ortools.sat.python import cp_model

    model = cp_model.CpModel()
    x = {(i, g): model.NewBoolVar(f"x{i}_{g}") for i in range(len(items)) for g in range(len(gpus))
         if items[i][2] <= gpus[g][2]}
    for i in range(len(items)):
        model.Add(sum(x[i, g] for g in range(len(gpus)) if (i, g) in x) <= 1)
    for g in range(len(gpus)):
        model.Add(sum(items[i][2] * x[i, g] for i in range(len(items)) if (i, g) in x) <= gpus[g][2])
    model.Maximize(sum(items[i][1] * v for (i, _), v in x.items()))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = 20
    solver.parameters.num_workers = 1
    status = solver.Solve(model)
    if status != cp_model.OPTIMAL:
        raise CommandError("CP-SAT did not prove an optimum within 20 s")
    return round(solver.ObjectiveValue())


def greedy(gpus, items, key) -> int:
    free = {g[1]: g[2] for g in gpus}
    value = 0
    for name, worth, size in sorted(items, key=key):
        fits = [(left, gid) for gid, left in free.items() if left >= size]
        if fits:
            left, gid = min(fits)
            free[gid] -= size
            value += worth
    return value


def policy_value(gpus, items) -> int:
    nodes = {}
    for node, gid, size in gpus:
        nodes.setdefault(node, []).append(AcceleratorInfo(gid, len(nodes[node]), "gpu", size * G))
    snap = Snapshot(0.0, tuple(NodeInfo(n, engines=frozenset({"vllm"}), accelerators=tuple(a)) for n, a in nodes.items()),
                    tuple(DesiredModel(name, (Profile("p", "vllm", 1, size * G),), priority=worth)
                          for name, worth, size in items))
    plan = schedule(snap)
    worth = {name: w for name, w, _ in items}
    return sum(worth[l.model] for l in plan.launches)


def packing_quality(instances: int, seed: int) -> str:
    rnd = random.Random(seed)
    ratios = {"policy": [], "priority, best fit": [], "priority per GiB, best fit": []}
    spent = []
    for _ in range(instances):
        gpus, items = small_instance(rnd)
        best = optimum(gpus, items)
        if best == 0:
            continue
        started = time.perf_counter()
        ratios["policy"].append(policy_value(gpus, items) / best)
        spent.append((time.perf_counter() - started) * 1000)
        ratios["priority, best fit"].append(greedy(gpus, items, lambda it: (-it[1], -it[2], it[0])) / best)
        ratios["priority per GiB, best fit"].append(greedy(gpus, items, lambda it: (-it[1] / it[2], it[0])) / best)
    rows = [f"Figure 2 — packing quality against the CP-SAT optimum: {len(ratios['policy'])} random instances "
            "(≤ 12 GPUs of 24/48/80 GiB, 5–30 models, priority 1–10, 2–80 GiB)", "",
            "| policy | mean ratio | worst ratio | optimal instances |", "|---|---:|---:|---:|"]
    for name, values in ratios.items():
        rows.append(f"| {name} | {statistics.mean(values):.4f} | {min(values):.4f} | "
                    f"{sum(1 for v in values if v >= 1 - 1e-9)} |")
    rows += ["", f"Policy time per instance: median {statistics.median(spent):.1f} ms, max {max(spent):.1f} ms.", ""]
    return "\n".join(rows)


# --- 3. the day-long trace -------------------------------------------------------------------------------

DAY = 86_400.0
MAX_WAIT = 120.0  # a request that cannot start within this is refused


@dataclasses.dataclass
class TraceModel:
    id: str
    size: int  # GiB, one GPU
    rate: float  # requests per second at the daily peak
    critical: bool
    load_s: float


def trace_models(rnd: random.Random, count=40):
    models = []
    for i in range(count):
        size = rnd.choice([4, 8, 8, 14, 14, 20, 35, 48, 70])
        popularity = 1.0 / (i + 1) ** 1.1  # Zipf
        models.append(TraceModel(f"m{i:02d}", size, 0.5 * popularity, critical=i in (3, 11, 25),
                                 load_s=5 + 0.6 * size))
    return models


def trace_requests(rnd: random.Random, models):
    requests = []
    for m in models:
        t = 0.0
        while True:
            # Diurnal: the rate swings between 20% and 100% of the peak; thinned Poisson arrivals.
            t += rnd.expovariate(max(m.rate, 1e-6))
            if t >= DAY:
                break
            if rnd.random() <= 0.2 + 0.8 * (0.5 - 0.5 * math.cos(2 * math.pi * t / DAY)):
                requests.append((t, m.id, rnd.uniform(1, 20)))
    requests.sort()
    return requests


GPUS = [(f"n{n}", f"n{n}g{i}", 80) for n in range(2) for i in range(4)]  # 640 GiB for ~1 TiB of models


class Replay:
    """A fleet on a virtual clock: resident models, when each is ready, when each was last used,
    requests in flight. Subclasses decide what to load and what to evict."""

    name = ""

    def __init__(self, models):
        self.models = {m.id: m for m in models}
        self.free = {gid: size for _, gid, size in GPUS}
        self.where: dict[str, str] = {}
        self.ready_at: dict[str, float] = {}
        self.last_used: dict[str, float] = {}
        self.busy_until: dict[str, float] = {}
        self.stats = {"all": self._zero(), "critical": self._zero()}
        self.pending: list[tuple[float, str, float]] = []  # the admission queue: (arrival, model, duration)
        self.served: set[str] = set()

    @staticmethod
    def _zero():
        return {"requests": 0, "cold": 0, "waited": 0, "waits": [], "refused": 0}

    def place(self, mid) -> bool:
        size = self.models[mid].size
        fits = sorted((left, gid) for gid, left in self.free.items() if left >= size)
        if not fits:
            return False
        gid = fits[0][1]
        self.free[gid] -= size
        self.where[mid] = gid
        return True

    def evict(self, mid):
        gid = self.where.pop(mid)
        self.free[gid] += self.models[mid].size
        self.ready_at.pop(mid, None)
        self.last_used.pop(mid, None)

    def busy(self, mid, now):
        return self.busy_until.get(mid, 0) > now

    def start(self, now):
        pass

    def tick(self, now):
        pass

    def make_room(self, mid, now) -> bool:
        return False

    def _bump(self, mid, key, value=1):
        for bucket in ("all", "critical") if self.models[mid].critical else ("all",):
            if key == "waits":
                self.stats[bucket]["waits"].append(value)
                if value > 0:
                    self.stats[bucket]["waited"] += 1
            else:
                self.stats[bucket][key] += value

    def request(self, now, mid, duration):
        """A request joins the admission queue; it starts as soon as its model is ready, or is
        refused once it has waited ``MAX_WAIT`` (every policy gets the same queue)."""
        self.tick(now)
        self._bump(mid, "requests")
        self.pending.append((now, mid, duration))
        self.drain(now)

    def prepare(self, now, misses):
        """Before the queue is served: a policy may act on the models requests wait for."""

    def drain(self, now):
        misses = sorted({mid for _, mid, _ in self.pending if mid not in self.where})
        if misses:
            self.prepare(now, misses)
        still = []
        for arrival, mid, duration in self.pending:
            model = self.models[mid]
            if mid not in self.where:
                if not (self.place(mid) or self.make_room(mid, now)):
                    if now - arrival >= MAX_WAIT:
                        self._bump(mid, "refused")
                    else:
                        still.append((arrival, mid, duration))
                    continue
                self.ready_at[mid] = now + model.load_s
                self._bump(mid, "cold")
                self.served.add(mid)
            wait = max(0.0, self.ready_at[mid] - arrival)
            if wait > MAX_WAIT:
                self._bump(mid, "refused")
                continue
            self.served.add(mid)
            begin = arrival + wait
            self.last_used[mid] = max(self.last_used.get(mid, 0.0), begin + duration)
            self.busy_until[mid] = max(self.busy_until.get(mid, 0), begin + duration)
            self._bump(mid, "waits", wait)
        self.pending = still

    def finish(self, now):
        """End of the day: what is still queued and past its wait is refused."""
        self.tick(now)
        self.drain(now)
        for arrival, mid, _ in self.pending:
            self._bump(mid, "refused")
        self.pending = []


class Static(Replay):
    """Place at start in popularity order; never evict (GPUStack-style)."""

    name = "static placement, no eviction"

    def start(self, now):
        for mid in sorted(self.models, key=lambda m: -self.models[m].rate):
            if self.place(mid):
                self.ready_at[mid] = now


class CountLRU(Replay):
    """A fixed number of resident models; the least recently used goes first (llama.cpp router,
    Ray Serve multiplexing). When the newcomer still does not fit in memory, more LRU go."""

    name = "count-based LRU (8 resident)"
    limit = 8

    def make_room(self, mid, now):
        order = sorted((m for m in self.where if not self.busy(m, now)), key=lambda m: self.last_used.get(m, 0))
        while order:
            self.evict(order.pop(0))
            if self.place(mid):
                return True
        return False

    def request(self, now, mid, duration):
        if mid not in self.where:
            order = sorted((m for m in self.where if not self.busy(m, now)), key=lambda m: self.last_used.get(m, 0))
            while order and len(self.where) >= self.limit:
                self.evict(order.pop(0))
        super().request(now, mid, duration)


class KeepAlive(Replay):
    """Unload after 5 idle minutes; evict the least recently used idle model when a load does not
    fit (Ollama)."""

    name = "keep-alive TTL 5 min, evict on demand"
    ttl = 300.0

    def tick(self, now):
        for mid in sorted(self.where):
            if not self.busy(mid, now) and now - self.last_used.get(mid, now) >= self.ttl:
                self.evict(mid)

    def make_room(self, mid, now):
        order = sorted((m for m in self.where if not self.busy(m, now)), key=lambda m: self.last_used.get(m, 0))
        while order:
            self.evict(order.pop(0))
            if self.place(mid):
                return True
        return False


class Berth(Replay):
    """The real policy: critical models have a minimum of one; the rest are on-demand with an idle
    timeout; every pass is ``schedule(snapshot)`` applied as the reconcile loop would."""

    name = "Berth policy (defaults: min lifetime 5 min)"
    settings = Settings(eviction_grace_s=10)
    idle_timeout_s = 900  # Berth's default (serving's ModelEntry.DEFAULT_IDLE_SECONDS)

    def __init__(self, models):
        super().__init__(models)
        self.nodes = tuple(NodeInfo(n, engines=frozenset({"vllm"}), accelerators=tuple(
            AcceleratorInfo(gid, i, "gpu", size * G) for i, (nn, gid, size) in enumerate(GPUS) if nn == n))
            for n in sorted({g[0] for g in GPUS}))
        self.replicas: dict[str, ReplicaInfo] = {}
        self.requested: dict[str, float] = {}
        self.holds = ()
        self.next_tick = 0.0
        self.next_retry = 0.0
        self.fresh = False
        self.started = False

    def snapshot(self, now, waiting=()):
        catalog = []
        for i, m in enumerate(sorted(self.models.values(), key=lambda m: m.id)):
            catalog.append(DesiredModel(
                m.id, (Profile("p", "vllm", 1, m.size * G),),
                Scaling(min=1 if m.critical else 0, max=1, idle_timeout_s=self.idle_timeout_s),
                capacity_class="critical" if m.critical else "", priority=max(1, round(m.rate * 1000)),
                last_requested_at=self.requested.get(m.id), waiting=1 if m.id in waiting else 0,
                waiting_since=min((t for t, mid, _ in self.pending if mid == m.id), default=None)))
        replicas = tuple(dataclasses.replace(r, active_requests=1 if self.busy(r.model, now) else 0,
                                             last_used_at=self.last_used.get(r.model, r.created_at),
                                             ready_since=self.ready_at.get(r.model) if self.ready_at.get(r.model, now + 1) <= now
                                             else None)
                         for r in self.replicas.values())
        return Snapshot(now, self.nodes, tuple(catalog), replicas, holds=self.holds,
                        settings=self.settings)

    def reconcile(self, now, waiting=()):
        waiting = set(waiting) | {mid for _, mid, _ in self.pending if mid not in self.where}
        snap = self.snapshot(now, waiting)
        plan = schedule(snap)
        for e in plan.evictions:
            replica = self.replicas.pop(e.replica)
            gid = replica.accelerators[0]
            self.free[gid] += replica.memory_bytes // G
            self.where.pop(replica.model, None)
            self.ready_at.pop(replica.model, None)
        for launch in plan.launches:
            rid = f"r-{launch.model}-{now:.0f}"
            self.replicas[rid] = ReplicaInfo(rid, launch.model, launch.profile, launch.node, launch.accelerators,
                                             launch.memory_bytes, created_at=now, load_seconds=self.models[launch.model].load_s)
            self.free[launch.accelerators[0]] -= launch.memory_bytes // G
            self.where[launch.model] = launch.accelerators[0]
            self.ready_at[launch.model] = now + self.models[launch.model].load_s
            if self.started:
                self._bump(launch.model, "cold")  # every load after the start is a cold start, waited for or not
        self.holds = plan.holds
        self.next_tick = now + 30

    def start(self, now):
        self.reconcile(now)
        self.started = True

    def tick(self, now):
        if now >= self.next_tick:
            self.reconcile(now)

    def request(self, now, mid, duration):
        self.requested[mid] = now
        self.fresh = mid not in self.where
        super().request(now, mid, duration)

    def place(self, mid):
        return False  # only the policy places

    def prepare(self, now, misses):
        # A new miss runs the reconcile loop at once with its request waiting (as the gateway
        # does); requests already queued are retried every few seconds.
        if self.fresh or now >= self.next_retry:
            self.fresh = False
            self.next_retry = now + 5
            self.reconcile(now, misses)

    def make_room(self, mid, now):
        return False  # the policy placed it in ``prepare`` (then it is in ``where``) or it waits


class BerthShortLifetime(Berth):
    name = "Berth policy (min lifetime 60 s)"
    settings = Settings(eviction_grace_s=10, min_lifetime_s=60)


def _ratio(figure: float, baseline: float) -> str:
    return f"{figure / baseline:.2f}" if baseline else ("—" if not figure else "∞ (baseline 0)")


def trace_replay(seed: int) -> str:
    rnd = random.Random(seed)
    models = trace_models(rnd)
    requests = trace_requests(rnd, models)
    total = sum(m.size for m in models)
    rows = [f"Figure 3 — a day-long trace: {len(requests):,} requests to 40 models ({total} GiB in all, "
            f"3 critical) over 8 × 80 GiB GPUs; a request waiting more than {MAX_WAIT:.0f} s is refused", "",
            "| policy | requests | cold starts | waited | p95 wait s | refused | models served | critical: cold / waited / p95 s / refused |",
            "|---|---:|---:|---:|---:|---:|---:|---|"]
    figures = {}
    for kind in (Berth, BerthShortLifetime, Static, CountLRU, KeepAlive):
        replay = kind(models)
        replay.start(0.0)
        for now, mid, duration in requests:
            replay.request(now, mid, duration)
        replay.finish(DAY)
        a, c = replay.stats["all"], replay.stats["critical"]
        p95 = _pct(a["waits"], 0.95) if a["waits"] else 0.0
        cp95 = _pct(c["waits"], 0.95) if c["waits"] else 0.0
        figures[kind] = (a["cold"], p95, a["refused"], c["refused"])
        rows.append(f"| {kind.name} | {a['requests']:,} | {a['cold']:,} | {a['waited']:,} | {p95:.1f} | {a['refused']:,} | "
                    f"{len(replay.served)} / {len(models)} | {c['cold']} / {c['waited']} / {cp95:.1f} / {c['refused']} |")
    rows += ["", f"The target, for {Berth.name}: fewer cold starts and a lower p95 wait than each baseline, no "
                 "critical request refused.", "",
             "| baseline | cold starts: Berth ÷ baseline | p95 wait: Berth ÷ baseline | refused: Berth ÷ baseline | met |",
             "|---|---:|---:|---:|---|"]
    cold, p95, refused, critical = figures[Berth]
    for kind in (Static, CountLRU, KeepAlive):
        b_cold, b_p95, b_refused, _ = figures[kind]
        met = cold < b_cold and p95 < b_p95 and critical == 0
        why = "" if met or b_cold else " (it never loads after the start: nothing is fewer than 0)"
        rows.append(f"| {kind.name} | {_ratio(cold, b_cold)} | {_ratio(p95, b_p95)} | {_ratio(refused, b_refused)} | "
                    f"{'yes' if met else 'no' + why} |")
    rows += [
        "",
        "What the rows mean. Every policy gets the same admission queue: a request whose model is not",
        f"resident waits for room and a load, and is refused only once it has waited {MAX_WAIT:.0f} s (or at the",
        "end of the day). Cold starts count every load after the start, whether a request waited for it or",
        "not. 'models served' is how many of the 40 models answered at least one request.",
        "- static placement loads the most popular models that fit at the start and never changes them: its",
        "  0 cold starts and 0 waits come with refusing every request to the models it did not place.",
        "- count-based LRU and keep-alive refuse little because they evict anything not decoding at once,",
        "  paying for it in cold starts and waits.",
        "- Berth keeps what is used (15 min idle timeout, its default), loads on demand, and makes room only from idle",
        "  replicas (not decoding for 10 s) ready for at least the minimum lifetime, at most 3 victims on one",
        "  place, worth no more than the load unless its requests have waited 30 s. What it refuses are",
        "  requests for models that could not get room within the wait under those rules: mostly the",
        "  48–70 GiB models, which need a whole GPU of replicas that are all idle and old enough (compare",
        "  the row with a 60 s minimum lifetime).",
        "",
    ]
    return "\n".join(rows)
