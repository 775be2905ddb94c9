"""Benchmark: from a deploy request to a ready replica, split into Berth's overhead and the engine's
load, for SmolLM2 and a generated model, through the process and Docker runtimes.

Baseline measured in the same run: the same engine started directly (spawn → /health 200 → one
real request), which is the engine's own load time with nothing of Berth around it. The deploy
reaches the node as every deploy does: a job its agent (holding only its credential) claims through
the node API of a web server the benchmark starts on loopback.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from berth.web import uvicorn_command
from scheduler import enrolment
from scheduler.models import Node
from serving.deployments import service
from serving.engines.installed import llama_server_path
from serving.models import Deployment
from serving.node.client import CLUSTER_SETTINGS, Credential
from tenancy.audit import Actor

ACTOR = Actor(system="bench")


def wait(condition, timeout: float, what: str, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise CommandError(f"{what} did not happen within {timeout:.0f}s")
        time.sleep(interval)


class Command(BaseCommand):
    help = "Time deploy → ready (Berth's overhead vs the engine's load) over several runs per runtime."

    def add_arguments(self, parser):
        parser.add_argument("--runs", type=int, default=5)
        parser.add_argument("--runtimes", default="process,docker", help="Comma-separated: process, docker.")

    def handle(self, *args, runs: int, runtimes: str, **options):
        kinds = [r.strip() for r in runtimes.split(",") if r.strip()]
        if runs < 1 or not kinds or set(kinds) - {"process", "docker"}:
            raise CommandError("--runs must be at least 1 and --runtimes a list of process, docker.")
        binary = llama_server_path()
        if binary is None:
            raise CommandError("llama-server is not built: `manage.py engines build llamacpp`.")
        root = settings.SCHEDULER_MODEL_ROOTS[0]
        root.mkdir(parents=True, exist_ok=True)
        models = self._models(root)
        node_name = f"bench-{os.getpid()}"
        scratch = Path(tempfile.mkdtemp(prefix="berth-bench-"))
        processes = self._agent(node_name, scratch)
        rows = []
        try:
            wait(lambda: Node.objects.filter(name=node_name, last_heartbeat_at__isnull=False).exists(), 60,
                 "the agent's first heartbeat")
            node = Node.objects.get(name=node_name)
            for label, path in models:
                direct = [self._direct(binary, path) for _ in range(runs)]
                rows.append(("direct (baseline)", label, direct, direct, [0.0] * runs))
                for runtime in kinds:
                    totals, loads, overheads = [], [], []
                    for run in range(runs):
                        total, load = self._through_berth(node, label, path, runtime, run)
                        totals.append(total)
                        loads.append(load)
                        overheads.append(total - load)
                    rows.append((runtime, label, totals, loads, overheads))
        finally:
            for process in processes:
                process.send_signal(signal.SIGTERM)
                process.wait(timeout=60)
            shutil.rmtree(scratch, ignore_errors=True)
        self._print(rows, runs)

    def _models(self, root: Path):
        from tests.assets.gguf_models import ModelShape, write_gguf
        from tests.assets.smollm2 import smollm2_path

        smollm2 = root / "bench-smollm2.gguf"
        if not smollm2.exists():
            shutil.copy2(smollm2_path(), smollm2)
        generated = write_gguf(root / "bench-generated.gguf", ModelShape(layers=8, embedding=256, heads=8,
                                                                         kv_heads=2, context=2048))
        return [("SmolLM2-135M Q4_1", smollm2), ("generated 8L e256", generated)]

    def _agent(self, node_name: str, scratch: Path) -> list[subprocess.Popen]:
        """This machine's web server (the node API) and an agent that holds only its own credential,
        as every node's: what a deploy reaches a node through."""
        from tests.assets.llama_server import free_port

        port = free_port()
        server = f"http://127.0.0.1:{port}"
        web = subprocess.Popen(uvicorn_command("127.0.0.1", port), cwd=settings.BASE_DIR, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
        credential = scratch / "credential"
        Credential(server=server, node=node_name, credential=enrolment.issue_credential(
            ACTOR, node_name, address=settings.NODE_ADDRESS)).save(credential)
        env = {key: value for key, value in os.environ.items() if key not in CLUSTER_SETTINGS}
        env.update(BERTH_HEARTBEAT_SECONDS="1", BERTH_DATA_DIR=str(scratch / "agent-data"))
        wait(lambda: _answers(server + "/healthz"), 60, "the web server")
        agent = subprocess.Popen([sys.executable, str(settings.BASE_DIR / "manage.py"), "agent", "--credential-file",
                                  str(credential)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 start_new_session=True)
        return [agent, web]

    def _direct(self, binary: Path, model: Path) -> float:
        """The engine alone: spawn → health → one real request, as the agent's readiness test does."""
        from tests.assets.llama_server import free_port

        port = free_port()
        started = time.perf_counter()
        with tempfile.TemporaryFile() as log:
            process = subprocess.Popen([str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
                                        "-c", "2048"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                url = f"http://127.0.0.1:{port}"
                wait(lambda: _ok(url + "/health"), 120, "the direct engine's health")
                response = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=30)
                response.raise_for_status()
                return time.perf_counter() - started
            finally:
                process.terminate()
                process.wait(timeout=30)

    def _through_berth(self, node, label, path, runtime, run) -> tuple[float, float]:
        name = f"bench-{runtime}-{run}-{os.getpid()}"
        started = time.perf_counter()
        deployment = service.deploy(ACTOR, service.DeployRequest(name=name, model_path=str(path), node=node,
                                                                 runtime=runtime, config={"context": 2048}))

        def settled():
            deployment.refresh_from_db(fields=["state"])
            return deployment.state in ("ready", "failed")

        wait(settled, 180, f"{label} on {runtime} ready")
        total = time.perf_counter() - started
        if deployment.state != "ready":
            raise CommandError(f"{label} failed on {runtime}: {deployment.state_detail}")
        replica = deployment.replica_set.get()
        # The engine's own part: from the runtime starting it to the readiness request answered.
        load = (replica.ready_at - replica.started_at).total_seconds()
        service.stop(ACTOR, deployment)
        wait(lambda: Deployment.objects.filter(pk=deployment.pk, state="stopped").exists(), 60, "stop")
        service.remove(ACTOR, Deployment.objects.get(pk=deployment.pk))
        return total, load

    def _print(self, rows, runs):
        self.stdout.write(f"\n{'path':<18} {'model':<20} {'runs':>4} {'total s':>8} {'engine s':>9} "
                          f"{'Berth ms':>9} {'x direct':>9}")
        direct = {label: statistics.median(totals) for path, label, totals, _, _ in rows if path.startswith("direct")}
        for path, label, totals, loads, overheads in rows:
            total = statistics.median(totals)
            self.stdout.write(f"{path:<18} {label:<20} {runs:>4} {total:>8.2f} {statistics.median(loads):>9.2f} "
                              f"{statistics.median(overheads) * 1000:>9.0f} {total / direct[label]:>9.2f}")
        worst = max(statistics.median(o) for p, _, _, _, o in rows if not p.startswith("direct"))
        verdict = "meets" if worst < 0.3 else "misses"
        self.stdout.write(f"\nBerth's own overhead, worst median: {worst * 1000:.0f} ms — {verdict} the 300 ms target.")


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code < 500
    except httpx.HTTPError:
        return False


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
