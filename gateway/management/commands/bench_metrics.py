"""Benchmark /metrics's scrape time on a large fleet. Not a test: prints a table.

    manage.py bench_metrics [--nodes 1000] [--gpus 8] [--models 2000] [--scrapes 5]

The fleet (nodes, their GPUs with sensors and reservations, catalog models with deployments,
replicas, recovery rows, placement decisions, scopes with contracts and holdings) is written inside
one transaction that is rolled back at the end: nothing stays behind, whatever happens. Beside the
fleet scrape it times, in the same run, the gateway-only page (``gateway.metrics.render``) and the
fleet scrape before the rows exist, as baselines. Target: the full scrape under 1 s.
"""

from __future__ import annotations

import random
import statistics
import time
import uuid
from decimal import Decimal

from django.core.cache import cache
from django.core.management.base import BaseCommand
from django.db import transaction

from gateway import fleet_metrics, metrics
from scheduler.models import Accelerator, MemoryReservation, Node, PlacementDecision, RecoveryState
from serving import load
from serving.models import Deployment, ModelEntry, Replica
from tenancy.models import Contract, Reservation, Scope

GIB = 1 << 30


def timed(fn, scrapes: int) -> tuple[float, float, int]:
    """(median s, worst s, bytes) of ``scrapes`` calls."""
    took, size = [], 0
    for _ in range(scrapes):
        started = time.perf_counter()
        size = len(fn())
        took.append(time.perf_counter() - started)
    return statistics.median(took), max(took), size


class Command(BaseCommand):
    help = "Benchmark /metrics on a scratch fleet (1,000 nodes x 8 GPUs, 2,000 models), rolled back after."

    def add_arguments(self, parser):
        parser.add_argument("--nodes", type=int, default=1000)
        parser.add_argument("--gpus", type=int, default=8)
        parser.add_argument("--models", type=int, default=2000)
        parser.add_argument("--scrapes", type=int, default=5)
        parser.add_argument("--seed", type=int, default=1)

    def handle(self, *args, **options):
        scrapes = options["scrapes"]
        rows: list[tuple[str, tuple]] = [("gateway only (metrics.render)", timed(metrics.render, scrapes)),
                                         ("fleet, before the scratch rows", timed(fleet_metrics.render, scrapes))]
        used_keys = []
        with transaction.atomic():
            built = time.perf_counter()
            prefix, used_keys = self.build(options)
            built = time.perf_counter() - built
            full = lambda: metrics.render() + fleet_metrics.render()  # what /metrics answers
            rows.append(("fleet, scratch rows (fleet_metrics.render)", timed(fleet_metrics.render, scrapes)))
            rows.append(("full /metrics body (gateway + fleet)", timed(full, scrapes)))
            transaction.set_rollback(True)  # the scratch rows go, whatever was measured
        cache.delete_many(used_keys)
        self.stdout.write(f"scratch fleet: {options['nodes']} nodes x {options['gpus']} GPUs, {options['models']} "
                          f"models (prefix {prefix}), written in {built:.1f} s and rolled back")
        self.stdout.write(f"{'scrape':<46} {'median':>9} {'worst':>9} {'bytes':>10}")
        for name, (median, worst, size) in rows:
            self.stdout.write(f"{name:<46} {median * 1000:>7.1f}ms {worst * 1000:>7.1f}ms {size:>10}")
        verdict = "under" if rows[3][1][0] < 1 else "OVER"
        self.stdout.write(f"target: full scrape under 1 s: {verdict} ({rows[3][1][0]:.3f} s median)")

    def build(self, options) -> tuple[str, list[str]]:
        rnd = random.Random(options["seed"])
        prefix = "bench-" + uuid.uuid4().hex[:8]
        nodes = Node.objects.bulk_create(
            Node(name=f"{prefix}-n{i}", address="127.0.0.1",
                 state=rnd.choices(Node.State.values, weights=(90, 4, 3, 3))[0]) for i in range(options["nodes"]))
        accelerators = Accelerator.objects.bulk_create(
            Accelerator(node=node, index=g, uuid=f"{prefix}-{node.name}-g{g}",
                        accelerator_class=rnd.choice(("H100 80GB", "A100 40GB", "L4")),
                        temperature_c=rnd.choice((None, rnd.uniform(30, 80))),
                        power_watts=rnd.choice((None, rnd.uniform(50, 700))),
                        utilisation_percent=rnd.choice((None, rnd.uniform(0, 100))),
                        memory_used_bytes=rnd.choice((None, rnd.randint(0, 80) * GIB)))
            for node in nodes for g in range(options["gpus"]))
        entries = ModelEntry.objects.bulk_create(
            ModelEntry(name=f"{prefix}-m{i}", source_kind="local", format="gguf", scaling_min=rnd.choice((0, 0, 1, 2)),
                       fingerprint=f"fp{i}") for i in range(options["models"]))
        deployments = Deployment.objects.bulk_create(
            Deployment(name=e.name, model_path="/m.gguf", node=rnd.choice(nodes), state="ready")
            for e in entries if e.scaling_min)
        replicas = Replica.objects.bulk_create(
            Replica(deployment=d, node=d.node, port=20000 + i % 40000, state=rnd.choice(("ready", "ready", "loading")))
            for i, d in enumerate(deployments))
        MemoryReservation.objects.bulk_create(
            MemoryReservation(node=a.node, accelerator=a, holder=f"{prefix}-r{i}", bytes=rnd.randint(1, 70) * GIB)
            for i, a in enumerate(rnd.sample(accelerators, min(len(accelerators), len(replicas)))))
        RecoveryState.objects.bulk_create(
            RecoveryState(model=e.name, kind="crash", consecutive=rnd.randint(1, 6), parked=rnd.random() < 0.3,
                          parked_fingerprint=e.fingerprint) for e in rnd.sample(entries, len(entries) // 10))
        verdicts = PlacementDecision.Verdict
        PlacementDecision.objects.bulk_create(
            PlacementDecision(model=e.name, kind=PlacementDecision.Kind.PLAN, inputs_digest="d", fingerprint="f",
                              verdict=rnd.choice((verdicts.PLACED, verdicts.PLACED, verdicts.UNSCHEDULABLE,
                                                  verdicts.PREEMPTED, verdicts.HELD)))
            for e in entries for _ in range(3))
        orgs = Scope.objects.bulk_create(Scope(kind="org", slug=f"{prefix}-o{i}", name="Org", path=f"{prefix}-o{i}")
                                         for i in range(50))
        Contract.objects.bulk_create(Contract(scope=org, gpus_guarantee=Decimal(8), gpus_limit=Decimal(32),
                                              gpu_memory_gib_limit=Decimal(2000)) for org in orgs)
        Reservation.objects.bulk_create(
            Reservation(scope=org, scope_path=org.path, holder=f"{prefix}-h{i}", gpus=Decimal(1),
                        gpu_memory_gib=Decimal(40)) for i, org in enumerate(orgs * 20))
        used = {e.name: time.time() - rnd.randint(0, 3600) for e in entries[::2]}
        load.note_used(used)
        return prefix, [load._used_key(name) for name in used]
