"""The fleet's Prometheus series, computed when /metrics is scraped from the rows the tables show
(catalog, replicas, recovery memory, placement decisions, nodes, accelerators, reservations,
tenancy contracts) and from the cache (last use, the control loop's last pass). One collection per
scrape, a fixed number of queries whatever the fleet's size (none per model or per node); it runs
on the gateway's database threads (``gateway.threads.run_db``), never on the event loop.

Labels are bounded: catalog model names, node names, accelerator classes and indexes, scope paths
and fixed words — never a string a client sent. A figure nobody measured is absent, never 0."""

from __future__ import annotations

import logging
import time
from collections import Counter, defaultdict

from django.core.cache import cache
from django.db.models import Count, Exists, F, OuterRef, Sum, Window
from django.db.models.functions import RowNumber

from berth import backup, health, lease
from scheduler import placement_service
from scheduler.models import Accelerator, MemoryReservation, Node, PlacementDecision, RecoveryState
from scheduler.snapshot import contracts_from_tenancy
from serving import load
from serving.models import DeploymentState as S, ModelEntry, Replica
from serving.control import watchdog
from tenancy.models import Reservation
from tenancy.services.contracts import CAPACITY

log = logging.getLogger(__name__)

Verdict = PlacementDecision.Verdict
WATCHDOG_LEVELS = {watchdog.OK: 0, watchdog.WARNING: 1, watchdog.CRITICAL: 2}


class Family:
    """One metric family written straight to the text format (``prometheus_client``'s families and
    ``generate_latest`` took most of a large fleet's scrape; these are a few tuples and one join)."""

    def __init__(self, name: str, doc: str, labels, kind: str = "gauge"):
        self.name, self.doc, self.labels, self.kind = name, doc, tuple(labels), kind
        self.samples: list[tuple[tuple, float]] = []

    def add_metric(self, values, value) -> None:
        self.samples.append((tuple(values), float(value)))

    def lines(self):
        name = self.name + "_total" if self.kind == "counter" else self.name
        yield f"# HELP {name} {self.doc}"
        yield f"# TYPE {name} {self.kind}"
        for values, value in self.samples:
            if values:
                labels = ",".join(f'{key}="{_escape(v)}"' for key, v in zip(self.labels, values))
                yield f"{name}{{{labels}}} {value!r}"
            else:
                yield f"{name} {value!r}"


def _escape(value) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _gauge(name, doc, labels):
    return Family(name, doc, labels)


def model_families(now: float) -> list:
    entries = list(ModelEntry.objects.order_by("name").values_list("name", "scaling_min", "pinned", "fingerprint"))
    names = [name for name, *_ in entries]
    catalog = ModelEntry.objects.values("name")  # a subquery: 2,000 names as parameters cost more than the reads
    ready = dict(Replica.objects.filter(state=S.READY, deployment__name__in=catalog)
                 .values_list("deployment__name").annotate(n=Count("pk")))
    recovery = {row[0]: row[1:] for row in RecoveryState.objects.filter(model__in=catalog)
                .values_list("model", "consecutive", "parked", "parked_fingerprint")}
    # The newest plan decision per model, as ``scheduler.placement_service.latest_per_model`` picks it,
    # in one windowed scan: its correlated subquery costs a lookup per row (seconds on a big history).
    newest = Window(RowNumber(), partition_by=[F("model")], order_by=[F("created_at").desc(), F("id").desc()])
    latest = dict(PlacementDecision.objects.filter(kind=PlacementDecision.Kind.PLAN, model__in=catalog)
                  .annotate(rank=newest).filter(rank=1).values_list("model", "verdict"))
    preempted = placement_service.tallied(Verdict.PREEMPTED, catalog)  # kept and trimmed: it never goes down
    # Read directly: ``load.last_used`` would start the idle clock of a running model it has not seen.
    keys = {load._used_key(name): name for name in names}
    used = {keys[key]: float(at) for key, at in cache.get_many(list(keys)).items()}

    desired_f = _gauge("berth_model_desired_replicas", "Replicas the model should have now (its scaling "
                       "minimum; a pinned model at least 1).", ["model"])
    ready_f = _gauge("berth_model_ready_replicas", "Replicas ready to serve (0 is published for every "
                     "catalog model).", ["model"])
    failures_f = _gauge("berth_model_start_failures", "Failed launches in a row (the recovery memory).", ["model"])
    parked_f = _gauge("berth_model_parked", "1 when the model is parked (not placed again until retried "
                      "or changed).", ["model"])
    unplaceable_f = _gauge("berth_model_unplaceable", "1 when the latest placement plan could not place it.",
                           ["model"])
    preempted_f = Family("berth_model_preempted", "Times the model gave room to another "
                         "(over all time: the history kept, and what trimming tallied).", ["model"], kind="counter")
    idle_f = _gauge("berth_model_idle_seconds", "Seconds since the model was last asked for (absent when "
                    "not known).", ["model"])
    for name, scaling_min, pinned, fingerprint in entries:
        consecutive, parked_row, parked_print = recovery.get(name, (0, False, ""))
        if name in recovery:
            parked = parked_row and (not fingerprint or parked_print == fingerprint)
        else:
            parked = latest.get(name) == Verdict.PARKED  # a parked verdict with no memory left
        desired_f.add_metric([name], max(scaling_min, 1) if pinned else scaling_min)
        ready_f.add_metric([name], ready.get(name, 0))
        failures_f.add_metric([name], consecutive)
        parked_f.add_metric([name], int(bool(parked)))
        unplaceable_f.add_metric([name], int(latest.get(name) == Verdict.UNSCHEDULABLE))
        preempted_f.add_metric([name], preempted.get(name, 0))
        if name in used:
            idle_f.add_metric([name], max(0.0, now - used[name]))
    return [desired_f, ready_f, failures_f, parked_f, unplaceable_f, preempted_f, idle_f]


SENSORS = (("temperature_c", "berth_accelerator_temperature_celsius", "Temperature as last read."),
           ("power_watts", "berth_accelerator_power_watts", "Power draw as last read."),
           ("utilisation_percent", "berth_accelerator_utilisation_percent", "Utilisation as last read."),
           ("memory_used_bytes", "berth_accelerator_memory_used_bytes", "Memory in use as last read."))


def node_families() -> list:
    state_f = _gauge("berth_node_state", "1 for the node's state, 0 for the others.", ["node", "state"])
    nodes = list(Node.objects.order_by("name").only("pk", "name", "state"))
    for node in nodes:
        for choice in Node.State.values:
            state_f.add_metric([node.name, choice], int(node.state == choice))
    watchdog_f = _gauge("berth_watchdog_level", "The node's memory watchdog: 0 ok, 1 warning, 2 critical (absent "
                        "when not measured).", ["node"])
    for name, level in sorted((watchdog.levels(nodes) or {}).items()):  # None: the cache cannot say, so absent
        if level in WATCHDOG_LEVELS:
            watchdog_f.add_metric([name], WATCHDOG_LEVELS[level])
    total_f = _gauge("berth_node_accelerators", "Accelerators on the node, by class.", ["node", "accelerator_class"])
    free_f = _gauge("berth_node_accelerators_free", "Accelerators that hold no reservation and may be placed "
                    "on (placeable, not known unhealthy), by class.", ["node", "accelerator_class"])
    sensor_f = {field: _gauge(name, doc + " Absent when not measured.", ["node", "accelerator", "accelerator_class"])
                for field, name, doc in SENSORS}
    total, free, measured = Counter(), Counter(), defaultdict(int)
    rows = Accelerator.objects.annotate(held=Exists(MemoryReservation.objects.filter(accelerator=OuterRef("pk")))) \
        .order_by("node__name", "index", "mig_index") \
        .values_list("node__name", "accelerator_class", "name", "index", "mig_index", "placeable", "healthy", "held",
                     *(field for field, _, _ in SENSORS))
    for node, klass, card, index, mig, placeable, healthy, held, *sensors in rows:
        klass = klass or card or "unknown"
        total[node, klass] += 1
        free[node, klass] += int(placeable and healthy is not False and not held)
        where = str(index) if mig is None else f"{index}/{mig}"
        for (field, _, _), value in zip(SENSORS, sensors):
            if value is not None:
                sensor_f[field].add_metric([node, where, klass], value)
        if sensors[-1] is not None:
            measured[node] += sensors[-1]
    for key in total:
        total_f.add_metric(list(key), total[key])
        free_f.add_metric(list(key), free[key])
    reserved_f = _gauge("berth_node_memory_reserved_bytes", "Memory reserved on the node (engines and stand-ins).",
                        ["node"])
    for node, held in MemoryReservation.objects.values_list("node__name").annotate(b=Sum("bytes")).order_by("node__name"):
        reserved_f.add_metric([node], held or 0)
    measured_f = _gauge("berth_node_accelerator_memory_measured_bytes", "Accelerator memory in use on the node as "
                        "measured (absent when none was read).", ["node"])
    for node, used in sorted(measured.items()):
        measured_f.add_metric([node], used)
    return [state_f, watchdog_f, total_f, free_f, reserved_f, measured_f, *sensor_f.values()]


def scope_families() -> list:
    contracts = contracts_from_tenancy()
    held = Reservation.objects.values_list("scope_path").annotate(**{stem: Sum(stem) for stem in CAPACITY})
    holdings_f = _gauge("berth_scope_holdings", "What the scope and everything below it hold now.", ["scope", "resource"])
    guarantee_f = _gauge("berth_scope_guarantee", "The scope's guarantee (absent when unset).", ["scope", "resource"])
    limit_f = _gauge("berth_scope_limit", "The scope's limit (absent when unset).", ["scope", "resource"])
    held = list(held)
    for contract in contracts:
        inside = [row for row in held if row[0] == contract.path or row[0].startswith(contract.path + "/")]
        for i, stem in enumerate(CAPACITY, start=1):
            holdings_f.add_metric([contract.path, stem], float(sum(row[i] or 0 for row in inside)))
            for family, figures in ((guarantee_f, contract.guarantee), (limit_f, contract.limit)):
                value = getattr(figures, stem)
                if value is not None:
                    family.add_metric([contract.path, stem], value)
    return [holdings_f, guarantee_f, limit_f]


def control_families(now: float) -> list:
    last, holder = cache.get(health.LAST_PASS_KEY), cache.get(health.PASS_LOCK_KEY)
    last_f = _gauge("berth_control_last_pass_timestamp_seconds", "When the control loop last finished a pass "
                    "(absent until one has).", [])
    if last is not None:
        last_f.add_metric([], float(last))
    running_f = _gauge("berth_control_pass_running", "1 while a process holds the control loop's pass lock.", [])
    running_f.add_metric([], int(holder is not None))
    # The lease's holder as a label: one series per holder process (host:pid, a process of Berth's own),
    # so a handover shows as the old holder's series going 0 and a new one appearing.
    held = lease.read(lease.CONTROL_LOOP)
    leader_f = _gauge("berth_control_lease_held", "1 while the named process holds the control loop's lease, "
                      "0 once it expired (absent until first taken).", ["holder"])
    age_f = _gauge("berth_control_lease_age_seconds", "How long the lease's holder has held it.", ["holder"])
    if held is not None:
        leader_f.add_metric([held.holder], int(not held.expired))
        age_f.add_metric([held.holder], held.age_s)
    return [last_f, running_f, leader_f, age_f]


def backup_families(now: float) -> list:
    """The newest backup archive's age (``berth.backup.newest``: the archives in BERTH_BACKUP_DIR as
    this machine sees them); absent until one exists."""
    age_f = _gauge("berth_backup_age_seconds", "Seconds since the newest backup archive was made (absent "
                   "until one exists).", [])
    # The same moment as a timestamp, which alerts compare with time() (BerthBackupTooOld).
    made_f = _gauge("berth_backup_last_success_timestamp_seconds", "When the newest backup archive was made "
                    "(absent until one exists).", [])
    found = backup.newest()
    if found is not None:
        age_f.add_metric([], max(0.0, now - found[1].timestamp()))
        made_f.add_metric([], found[1].timestamp())
    return [age_f, made_f]


def collect(now: float | None = None) -> list:
    """Every fleet family, plus ``berth_fleet_metrics_up`` (0 when the rows could not be read: the
    gateway's own series are still answered)."""
    now = time.time() if now is None else now
    started = time.perf_counter()
    up = _gauge("berth_fleet_metrics_up", "1 when the fleet's series were read for this scrape.", [])
    try:
        families = model_families(now) + node_families() + scope_families() + control_families(now) + backup_families(now)
        up.add_metric([], 1)
    except Exception:  # a database or cache outage must not take the gateway's own series with it
        log.exception("fleet metrics could not be read")
        families = []
        up.add_metric([], 0)
    took = _gauge("berth_fleet_metrics_collect_seconds", "How long this scrape's fleet collection took.", [])
    took.add_metric([], time.perf_counter() - started)
    return families + [up, took]


def render(now: float | None = None) -> bytes:
    """The fleet's series in the Prometheus text format (call it on a database thread)."""
    return ("\n".join(line for family in collect(now) for line in family.lines()) + "\n").encode()
