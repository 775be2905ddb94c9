"""``manage.py bench_console [--requests 15] [--models 200] [--nodes 50] [--usage 10000] [--target 300]``:
console's pages answer on a busy installation. Not a test: prints a table.

Every console page that answers a GET is found in the URL conf (forms that only take a POST, the live
stream, and Explore, which asks the model hub, are left out; a page behind an id gets a real one), and
each is asked ``--requests`` times through Django's test client, signed in as an administrator (a
superuser) and as a member of one project, the page and (where it has one) its HTMX fragment. It is
measured twice in the same run: first in a world with one of each (one model, deployment, node and
usage row, the organisation tree) as the baseline, then once the world has grown to ``--models``
catalog models (files, deployments and replicas in every state, placement decisions, parked models),
``--nodes`` nodes with GPUs and telemetry, and ``--usage`` usage rows over the last day. The table
gives each page's median and p95, its SQL queries per request in both worlds (a count that grows with
the rows is a query per row), and the median's ratio to the baseline and to the 300 ms target.

Everything is written inside one transaction that is rolled back at the end, on whatever database
``DATABASE_URL`` names (the embedded SQLite by default): nothing stays behind, whatever happens. The
pages write no cache keys; any that a page did write and that did not exist before are deleted.
Exits with status 1 (after a FAIL line) when a page's median is over the target.
"""

from __future__ import annotations

import logging
import math
import random
import statistics
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.cache import cache
from django.core.management.base import BaseCommand, CommandError
from django.db import connection, transaction
from django.test import Client
from django.test.utils import CaptureQueriesContext, override_settings
from django.urls import URLPattern, URLResolver, get_resolver
from django.utils import timezone

from gateway.models import ModelSplit, UsageRecord
from scheduler.models import (Accelerator, AcceleratorSample, MemoryReservation, Node, NodeSample, PlacementDecision,
                              RecoveryState)
from scheduler.services import EngineReport, NodeReport, register_node
from serving.models import Deployment, DeploymentEvent, FetchJob, ModelEntry, ModelFile, Replica
from tenancy.audit import Actor
from tenancy.models import ApprovalRequest, AuditEvent, Membership, Role, Scope, ServiceClient
from tenancy.services import approvals, clients, contracts, tree

TARGET_MS = 300.0
GIB = 1 << 30
# Not console pages (as tests/test_console_walk.py's walk has it), and pages left out on purpose.
NOT_CONSOLE = ("api/", "admin/", "static", "healthz", "readyz", "login/", "logout/")
LEFT_OUT = {"models/explore/": "asks the model hub"}
STATES = ("ready", "ready", "ready", "sleeping", "loading", "starting", "queued", "planned", "stopping", "stopped",
          "failed")
ENDPOINTS = ("chat/completions", "chat/completions", "completions", "embeddings")


class Rollback(Exception):
    pass


@dataclass(frozen=True)
class Page:
    route: str  # as the URL conf writes it
    url: str  # with a real id
    fragment: bool  # asked as htmx asks for the page's fragment

    @property
    def name(self) -> str:
        return "/" + self.route.replace("<uuid:public_id>", "<id>") + (" (fragment)" if self.fragment else "")


@dataclass
class Measure:
    status: int
    queries: int
    median: float  # ms
    p95: float


def console_routes():
    """(route, view class) of every console URL pattern, as ``tests/test_console_walk.py`` walks them."""
    def walk(patterns, prefix=""):
        for pattern in patterns:
            if isinstance(pattern, URLResolver):
                yield from walk(pattern.url_patterns, prefix + str(pattern.pattern))
            elif isinstance(pattern, URLPattern):
                yield prefix + str(pattern.pattern), getattr(pattern.callback, "view_class", None)
    return [(route, view) for route, view in walk(get_resolver().url_patterns) if not route.startswith(NOT_CONSOLE)]


def pages(ids: dict) -> tuple[list[Page], list[tuple[str, str]]]:
    """The GET pages, ids put in from ``ids`` (view's model -> public id); and those skipped, with why."""
    found, skipped = [], []
    for route, view in console_routes():
        if route in LEFT_OUT:
            skipped.append((route, LEFT_OUT[route]))
            continue
        if view is None:
            skipped.append((route, "a function view (the live stream)"))
            continue
        if "get" not in view.http_method_names or not hasattr(view, "get"):
            continue  # a form's action: POST only
        url = route
        if "<uuid:public_id>" in url:
            public_id = ids.get(getattr(view, "model", None))
            if public_id is None:
                skipped.append((route, f"no {getattr(view, 'model', None)} in the world"))
                continue
            url = url.replace("<uuid:public_id>", str(public_id))
        if "<" in url:
            skipped.append((route, "a part of its URL the benchmark cannot fill"))
            continue
        found.append(Page(route, "/" + url, False))
        if getattr(view, "fragment_template_name", ""):
            found.append(Page(route, "/" + url, True))
    return found, skipped


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(len(ordered) * share) - 1)]


class CacheWrites:
    """Notes the keys the pages write that were not there before, to delete them afterwards."""

    def __init__(self):
        self.new: set[str] = set()
        self._saved = {}

    def __enter__(self):
        for name in ("set", "add", "set_many", "incr", "get_or_set"):
            original = getattr(cache, name)
            self._saved[name] = original

            def wrapper(*args, _original=original, _name=name, **kwargs):
                keys = list(args[0]) if _name == "set_many" else [args[0]]
                self.new.update(key for key in keys if not cache.has_key(key))
                return _original(*args, **kwargs)
            setattr(cache, name, wrapper)
        return self

    def __exit__(self, *exc):
        for name in self._saved:
            delattr(cache, name)  # back to the class's methods
        if self.new:
            cache.delete_many(list(self.new))


class Command(BaseCommand):
    help = ("Time every console page (median, p95, queries) with 200 models, 50 nodes and 10,000 usage rows "
            "against a one-of-each baseline, as an administrator and a project member; all written inside "
            "one transaction that is rolled back. Exits 1 when a page's median is over 300 ms.")

    def add_arguments(self, parser):
        parser.add_argument("--requests", type=int, default=15, help="Timed requests per page (default 15).")
        parser.add_argument("--models", type=int, default=200)
        parser.add_argument("--nodes", type=int, default=50)
        parser.add_argument("--usage", type=int, default=10_000, help="Usage rows over the last day.")
        parser.add_argument("--seed", type=int, default=1)
        parser.add_argument("--target", type=float, default=TARGET_MS, help="The median a page must stay under (ms).")

    def handle(self, *args, requests: int, models: int, nodes: int, usage: int, seed: int, target: float,
               **options):
        if requests < 1 or models < 1 or nodes < 1 or usage < 1:
            raise CommandError("--requests, --models, --nodes and --usage must each be at least 1.")
        self.rnd, self.target = random.Random(seed), target
        self.prefix = "bench-" + uuid.uuid4().hex[:6]
        # The member's refusals (403: staff-only pages) are expected: not worth a log line each.
        refusals = logging.getLogger("django.request")
        level = refusals.level
        refusals.setLevel(logging.ERROR)
        # The test client's host; the settings' own hosts stay allowed.
        try:
            with override_settings(ALLOWED_HOSTS=[*settings.ALLOWED_HOSTS, "testserver"]), CacheWrites() as writes:
                with transaction.atomic():
                    results = self.measure(requests, models, nodes, usage)
                    raise Rollback
        except Rollback:
            pass
        finally:
            refusals.setLevel(level)
        failed = self.report(results, requests, models, nodes, usage, writes.new)
        if failed:
            raise CommandError(f"FAIL: {len(failed)} page(s) over {target:.0f} ms at the median: "
                               + ", ".join(failed))

    # --- measuring ------------------------------------------------------------------------------

    def measure(self, requests, models, nodes, usage) -> dict:
        self.world()
        self.add_nodes(0, 1)
        self.add_models(0, 1)
        self.add_usage(0, 1)
        self.place(0, 1)
        found, self.skipped = pages(self.ids())
        browsers = {}
        for who, user in (("admin", self.admin), ("member", self.member)):
            browser = Client()
            browser.force_login(user)
            browsers[who] = browser
        anonymous = Client()
        results = {"baseline": self.run_pages(found, browsers, anonymous, requests)}
        built = time.perf_counter()
        self.add_nodes(1, nodes)
        self.add_models(1, models)
        self.place(1, models)
        self.add_usage(1, usage)
        self.add_audit(500)
        if connection.vendor == "postgresql":  # the planner's statistics, as a live database has them
            with connection.cursor() as cursor:
                cursor.execute("ANALYZE")
        self.built_seconds = time.perf_counter() - built
        results["full"] = self.run_pages(found, browsers, anonymous, requests)
        results["pages"] = found
        return results

    def run_pages(self, found, browsers, anonymous, requests) -> dict:
        out = {("/login/", "anyone"): self.ask(anonymous, "/login/", False, requests)}
        for page in found:
            for who, browser in browsers.items():
                out[(page.name, who)] = self.ask(browser, page.url, page.fragment, requests)
        return out

    @staticmethod
    def ask(browser, url, fragment, requests) -> Measure:
        headers = {"HX-Request": "true", "HX-Current-URL": "http://testserver" + url} if fragment else {}

        def get():
            response = browser.get(url, headers=headers)
            if getattr(response, "streaming", False):
                b"".join(response.streaming_content)
            return response

        get()  # warm: what a process caches once (content types, templates, the session's first touch)
        with CaptureQueriesContext(connection) as captured:  # counted apart: capturing costs time
            status = get().status_code
        # Now: the next request's start empties the log this count is read from.
        queries = len(captured)
        took = []
        for _ in range(requests):
            started = time.perf_counter()
            get()
            took.append((time.perf_counter() - started) * 1000)
        return Measure(status, queries, statistics.median(took), percentile(took, 0.95))

    # --- the world ------------------------------------------------------------------------------

    def world(self):
        """An organisation of 3 teams x 3 projects, its people (an owner, members, viewers), clients and
        keys, contracts and an approval waiting; an administrator (superuser) apart from it."""
        system = Actor(system="bench")
        users = get_user_model().objects
        p = self.prefix
        self.admin = users.create_user(f"{p}-admin", f"{p}-admin@example.org", is_staff=True, is_superuser=True)
        self.owner = users.create_user(f"{p}-owner", f"{p}-owner@example.org")
        self.member = users.create_user(f"{p}-member", f"{p}-member@example.org")
        self.org = tree.create_scope(system, "org", p, f"Bench {p}")
        Membership.objects.create(user=self.owner, scope=self.org, role=Role.OWNER)
        self.projects = []
        for t in range(3):
            team = tree.create_scope(system, "team", f"team{t}", f"Team {t}", self.org)
            for j in range(3):
                self.projects.append(tree.create_scope(system, "project", f"project{j}", f"Project {j}", team))
        self.project = self.projects[0]
        Membership.objects.create(user=self.member, scope=self.project, role=Role.MEMBER)
        for i in range(12):  # people spread over the tree
            person = users.create_user(f"{p}-person{i}", f"{p}-person{i}@example.org")
            Membership.objects.create(user=person, scope=self.projects[i % len(self.projects)],
                                      role=(Role.MEMBER, Role.VIEWER, Role.ADMIN)[i % 3])
        owner = Actor(user=self.owner)
        contracts.set_contract(owner, self.org, gpus_limit=64, rpm_limit=10_000)
        contracts.set_contract(owner, self.project, gpus_limit=4, rpm_limit=1_000)
        self.credentials = []
        for project in self.projects:
            for c in range(2):
                client = clients.create_client(owner, project, f"client{c}", all_models=True)
                for k in range(2 if project is self.project else 1):
                    self.credentials.append(clients.create_credential(owner, client, name=f"key{k}")[0])
        self.client = ServiceClient.objects.filter(project=self.project).order_by("pk").first()
        evidence = contracts.raise_limit_evidence(self.project, gpus_limit=8)
        self.approval = approvals.request_approval(owner, "contract.raise_limit", self.project, self.project,
                                                   evidence, "more GPUs for the benchmark")
        ModelSplit.objects.create(model_name=f"{p}-split", scope=self.project,
                                  variants=[{"model": f"{p}-model0", "weight": 1}])
        self.nodes, self.entries, self.deployments = [], [], []

    def ids(self) -> dict:
        job = FetchJob.objects.filter(owner=self.project).order_by("pk").first()
        return {ModelEntry: self.entries[0].public_id, Deployment: self.deployments[0].public_id,
                Node: self.nodes[0].public_id, Scope: self.project.public_id, ServiceClient: self.client.public_id,
                ApprovalRequest: self.approval.public_id, FetchJob: job.public_id}

    def add_nodes(self, start, stop):
        """Nodes through ``register_node`` (as an agent's report), four GPUs each with telemetry, and
        an hour of samples a minute apart."""
        rnd, now = self.rnd, timezone.now()
        made = [register_node(NodeReport(
            name=f"{self.prefix}-node{i}", address="127.0.0.1", cpu_count=64, memory_total_bytes=512 * GIB,
            memory_available_bytes=rnd.randint(64, 500) * GIB, agent_version="bench", cpu_load_1m=rnd.uniform(0, 30),
            engines=(EngineReport(kind="llamacpp", version="b1"), EngineReport(kind="vllm", version="0.9"))))
            for i in range(start, stop)]
        for index, node in enumerate(made):
            node.last_heartbeat_at = now
            # The first node of the world stays ready: the node page's id is its.
            node.state = "ready" if start == index == 0 else rnd.choices(Node.State.values, weights=(90, 4, 3, 3))[0]
        Node.objects.bulk_update(made, ["last_heartbeat_at", "state"])
        gpus = Accelerator.objects.bulk_create(
            Accelerator(node=node, index=g, uuid=f"GPU-{node.name}-{g}", name="NVIDIA H100 80GB HBM3",
                        accelerator_class="H100-80GB", memory_total_bytes=80 * GIB,
                        memory_used_bytes=rnd.randint(0, 80) * GIB, utilisation_percent=rnd.uniform(0, 100),
                        temperature_c=rnd.uniform(30, 80), power_watts=rnd.uniform(60, 700), power_limit_watts=700,
                        throttle_reasons=[], healthy=True)
            for node in made for g in range(4))
        NodeSample.objects.bulk_create(
            NodeSample(node=node, taken_at=now - timedelta(minutes=m), cpu_load_1m=rnd.uniform(0, 30),
                       memory_available_bytes=rnd.randint(64, 500) * GIB) for node in made for m in range(60))
        AcceleratorSample.objects.bulk_create(
            (AcceleratorSample(accelerator=gpu, taken_at=now - timedelta(minutes=m),
                               memory_used_bytes=rnd.randint(0, 80) * GIB, utilisation_percent=rnd.uniform(0, 100),
                               temperature_c=rnd.uniform(30, 80), power_watts=rnd.uniform(60, 700))
             for gpu in gpus for m in range(60)), batch_size=2000)
        self.nodes += made
        self.gpus = getattr(self, "gpus", []) + gpus

    def add_models(self, start, stop):
        """Catalog models owned across the projects (the first by the member's), two profiles and one
        to three files each; two in five deployed, one replica each in one of every state."""
        rnd, p = self.rnd, self.prefix
        entries = ModelEntry.objects.bulk_create(
            ModelEntry(name=f"{p}-model{i}", owner=self.projects[i % len(self.projects)], source_kind="hub",
                       source_repo=f"bench/model-{i}", source_revision="0" * 40, format="gguf",
                       task=("chat", "chat", "embedding")[i % 3], quantisation="Q4_K_M", architecture="llama",
                       scaling_min=rnd.choice((0, 0, 1)), scaling_max=2, fingerprint=f"fp{i}",
                       profiles=[{"name": "cpu", "engine": "llamacpp", "file": f"model-{i}.Q4_K_M.gguf",
                                  "context": 4096},
                                 {"name": "gpu", "engine": "llamacpp", "file": f"model-{i}.Q4_K_M.gguf",
                                  "context": 8192, "gpu_layers": 999}])
            for i in range(start, stop))
        ModelFile.objects.bulk_create(
            ModelFile(model=entry, repo_path=f"model-{i}.part{f}.gguf", path=f"/var/bench/{p}/model-{i}.part{f}.gguf",
                      size=rnd.randint(1, 40) * GIB, sha256="0" * 64, verified=True)
            for i, entry in zip(range(start, stop), entries) for f in range(1 + i % 3))
        FetchJob.objects.bulk_create(
            FetchJob(repo=f"bench/model-{i}", owner=entry.owner, model=entry, commit="0" * 40,
                     status=("done", "done", "failed", "running")[i % 4], files=[], error="")
            for i, entry in zip(range(start, stop), entries) if i % 5 == 0)
        deployed = [(i, entry) for i, entry in zip(range(start, stop), entries) if i % 5 in (0, 2)]
        deployments = Deployment.objects.bulk_create(
            Deployment(name=entry.name, model_path=f"/var/bench/{p}/model-{i}.part0.gguf",
                       node=self.nodes[i % len(self.nodes)], owner=entry.owner, state=STATES[i % len(STATES)],
                       created_by=self.owner, memory_reserved_bytes=rnd.randint(1, 40) * GIB)
            for i, entry in deployed)
        replicas = Replica.objects.bulk_create(
            Replica(deployment=d, node=d.node, port=20000 + i, state=d.state,
                    memory_reserved_bytes=d.memory_reserved_bytes) for (i, _), d in zip(deployed, deployments))
        DeploymentEvent.objects.bulk_create(
            DeploymentEvent(deployment=d, replica=r, from_state=a, to_state=b, message=f"{a} to {b}")
            for d, r in zip(deployments, replicas) for a, b in (("", "planned"), ("planned", "starting"),
                                                                ("starting", d.state)))
        MemoryReservation.objects.bulk_create(
            MemoryReservation(node=r.node, holder=f"{p}-replica-{r.pk}", bytes=r.memory_reserved_bytes)
            for r in replicas if r.state in ("ready", "sleeping", "loading", "starting"))
        self.entries += entries
        self.deployments += deployments

    def place(self, start, stop):
        """Three placement decisions a model; one model in ten crashed, a third of those parked."""
        rnd, now = self.rnd, timezone.now()
        verdicts = PlacementDecision.Verdict
        entries = self.entries[start:stop]
        PlacementDecision.objects.bulk_create(
            PlacementDecision(model=e.name, owner=e.owner, kind=PlacementDecision.Kind.PLAN, inputs_digest="d" * 32,
                              fingerprint="f" * 32, node=self.nodes[n % len(self.nodes)].name,
                              verdict=rnd.choice((verdicts.PLACED, verdicts.PLACED, verdicts.UNSCHEDULABLE)),
                              reason_codes=["no_fit"], detail="bench")
            for n, e in enumerate(entries) for _ in range(3))
        RecoveryState.objects.bulk_create(
            RecoveryState(model=e.name, kind="crash", consecutive=rnd.randint(1, 6), parked=n % 3 == 0,
                          parked_at=now if n % 3 == 0 else None, last_failure_at=now, last_error="bench crash")
            for n, e in enumerate(entries) if (start + n) % 10 == 3)

    def add_usage(self, start, stop):
        """Usage rows over the last day, spread over the keys and models (one in twenty refused)."""
        rnd, now = self.rnd, timezone.now()
        rows = []
        for i in range(start, stop):
            credential = self.credentials[i % len(self.credentials)]
            entry = self.entries[i % min(len(self.entries), 40)]
            began = now - timedelta(seconds=rnd.uniform(0, 86_400) if i else 2)
            total = rnd.uniform(20, 3000)
            refused = i % 20 == 19
            rows.append(UsageRecord(
                request_id=f"{self.prefix}-r{i}", started_at=began, finished_at=began + timedelta(milliseconds=total),
                endpoint=ENDPOINTS[i % len(ENDPOINTS)], stream=i % 3 == 0, model_asked=entry.name,
                model_served=entry.name, status=429 if refused else 200, error_code="rate_limited" if refused else "",
                queue_ms=rnd.uniform(0, 20), ttft_ms=rnd.uniform(10, 400), total_ms=total,
                prompt_tokens=rnd.randint(5, 2000), completion_tokens=0 if refused else rnd.randint(1, 800),
                cost=Decimal("0.0001"), credential=credential, key_prefix=credential.prefix,
                client=credential.client, project=credential.client.project,
                scope_path=credential.client.project.path))
        UsageRecord.objects.bulk_create(rows, batch_size=2000)

    def add_audit(self, count):
        """What a busy organisation's log holds besides what building the world wrote."""
        actors = (self.owner, self.member, self.admin)
        AuditEvent.objects.bulk_create(
            AuditEvent(actor_user=actors[i % 3], actor=actors[i % 3].username, action="client.update",
                       object_type="tenancy.serviceclient", object_id=str(self.client.public_id),
                       object_repr=self.client.name, scope=self.projects[i % len(self.projects)],
                       scope_path=self.projects[i % len(self.projects)].path, details={"n": i})
            for i in range(count))

    # --- the table ------------------------------------------------------------------------------

    def report(self, results, requests, models, nodes, usage, cache_keys) -> list[str]:
        base, full = results["baseline"], results["full"]
        floor = full[("/login/", "anyone")].median
        self.stdout.write(
            f"{connection.vendor}: baseline world of one model, node and usage row; then {models} models, {nodes} "
            f"nodes x 4 GPUs, {usage} usage rows (added in {self.built_seconds:.1f} s); all rolled back. "
            f"{requests} timed requests per page and persona.")
        head = (f"{'page':<50} {'as':<6} {'st':>3} {'median':>8} {'p95':>8} {'q':>4} {'q base':>6} {'base':>8} "
                f"{'x base':>7} {'x login':>7} {'x target':>8}")
        self.stdout.write(head)
        self.stdout.write("-" * len(head))
        over, grown = [], []
        for key, measure in full.items():
            name, who = key
            before = base[key]
            ratio = measure.median / before.median
            self.stdout.write(
                f"{name[:50]:<50} {who:<6} {measure.status:>3} {measure.median:>6.1f}ms {measure.p95:>6.1f}ms "
                f"{measure.queries:>4} {before.queries:>6} {before.median:>6.1f}ms {ratio:>7.2f} "
                f"{measure.median / floor:>7.1f} {measure.median / self.target:>8.2f}")
            if measure.median > self.target:
                over.append(f"{name} as {who} ({measure.median:.0f} ms)")
            if measure.queries > before.queries:
                grown.append(f"{name} as {who} ({before.queries} -> {measure.queries})")
        for route, why in self.skipped:
            self.stdout.write(f"skipped /{route}: {why}")
        self.stdout.write("x base: the median against the same page in the one-of-each world; x login: against "
                          "/login/ (no query of Berth's rows), in the full world.")
        if cache_keys:
            self.stdout.write(f"cache keys the pages wrote, deleted: {', '.join(sorted(cache_keys))}")
        if grown:  # a query per row would add hundreds here; one or two is a list that became non-empty
            self.stdout.write("queries that grew with the rows: " + "; ".join(grown))
        worst = max(full.items(), key=lambda item: item[1].median)
        if not over:
            self.stdout.write(f"PASS: every page under {self.target:.0f} ms at the median (slowest "
                              f"{worst[0][0]} as {worst[0][1]}, {worst[1].median:.1f} ms).")
        return over
