"""``manage.py drill_outages``: traffic through a real gateway while Redis is lost and the database
refuses connections; prints, per phase, the requests answered, refused (by status) and usage
records lost. Needs PostgreSQL and Redis (the configured ones: the drill starts its own Redis and
puts a proxy it can cut in front of the database, so neither shared service is touched). Not part
of the test suite: the figures depend on the machine; the target is zero records lost.

Phases, each ``--seconds`` long, with the fault over its middle third: ``steady`` (the baseline),
``redis lost`` (the drill's Redis killed, then started again empty), ``database refusing`` (every
connection to PostgreSQL cut, then let through again).
"""

from __future__ import annotations

import asyncio
import collections
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import connection

from berth.web import uvicorn_command
from gateway.bench.fixture import berth_fixture, cleanup, free_port, stop, wait_http
from gateway.bench.proxy import Proxy
from gateway.models import UsageRecord
from gateway.usage import retry_parked

BODY = {"model": "bench-model", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}


class Command(BaseCommand):
    help = "Drill: traffic through the gateway while Redis is lost and the database refuses; what was lost."

    def add_arguments(self, parser):
        parser.add_argument("--seconds", type=float, default=12.0, help="Length of each phase.")
        parser.add_argument("--clients", type=int, default=8, help="Concurrent clients.")

    def handle(self, *args, seconds, clients, **options):
        db = connection.settings_dict
        if not db["ENGINE"].endswith("postgresql") or not settings.REDIS_URL:
            raise CommandError("The drill needs PostgreSQL and Redis (DATABASE_URL and REDIS_URL).")
        if seconds < 3 or clients < 1:
            raise CommandError("--seconds is at least 3 and --clients at least 1.")
        root, work = Path(settings.BASE_DIR), Path(settings.DATA_DIR) / "drill"
        work.mkdir(parents=True, exist_ok=True)
        processes: list[subprocess.Popen] = []
        redis_port = free_port()
        redis = self._redis(redis_port)
        proxy = Proxy(db["HOST"] or "127.0.0.1", int(db["PORT"] or 5432))
        made = None
        sent: dict[str, list[tuple[str, int | str]]] = collections.defaultdict(list)
        try:
            stub_port = free_port()
            stub = subprocess.Popen([sys.executable, "-m", "gateway.bench.stub", str(stub_port)], cwd=root)
            processes.append(stub)
            wait_http(f"http://127.0.0.1:{stub_port}/", lambda s: True, 20, stub)
            made = berth_fixture(stub_port)
            port = free_port()
            password = f":{db['PASSWORD']}" if db["PASSWORD"] else ""
            env = dict(os.environ, REDIS_URL=f"redis://127.0.0.1:{redis_port}/0", BERTH_GATEWAY_USAGE_FLUSH_MS="200",
                       DATABASE_URL=f"postgres://{db['USER']}{password}@127.0.0.1:{proxy.port}/{db['NAME']}")
            log = open(work / "gateway.log", "wb")
            gateway = subprocess.Popen(uvicorn_command("127.0.0.1", port, "--no-access-log"), cwd=root, env=env,
                                       stdout=log, stderr=subprocess.STDOUT)
            processes.append(gateway)
            url = f"http://127.0.0.1:{port}"
            wait_http(url + "/v1/models", lambda s: s == 401, 60, gateway)

            def lose_redis():
                redis.kill()
                redis.wait()
                return lambda: processes.append(self._redis(redis_port))

            def refuse_database():
                proxy.refuse()
                return proxy.restore

            for phase, fault in (("steady", None), ("redis lost", lose_redis), ("database refusing", refuse_database)):
                self.stdout.write(f"{phase} …")
                sent[phase] = asyncio.run(_load(url, made["key"], seconds, clients, fault))
            stop(gateway)  # its lifespan's shutdown writes what it still buffers
            parked = retry_parked(f"redis://127.0.0.1:{redis_port}/0")
            self._table(sent, parked)
        finally:
            for process in reversed(processes):
                stop(process)
            stop(redis)
            proxy.close()
            if made is not None:
                cleanup(made)

    def _redis(self, port: int) -> subprocess.Popen:
        process = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                    "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise CommandError("redis-server did not start (is it installed?)")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    return process
            except OSError:
                time.sleep(0.05)
        raise CommandError("redis-server did not answer within 10 s")

    def _table(self, sent: dict[str, list[tuple[str, int | str]]], parked: int) -> None:
        answered = {phase: [rid for rid, status in rows if isinstance(status, int) and 200 <= status < 300]
                    for phase, rows in sent.items()}
        written = set(UsageRecord.objects.filter(request_id__in=[r for ids in answered.values() for r in ids])
                      .values_list("request_id", flat=True))
        base = len(answered["steady"]) or 1
        lines = [f"{'phase':<18} {'sent':>6} {'2xx':>6} {'vs steady':>9} {'refused (status×count)':<28} "
                 f"{'no answer':>9} {'usage lost':>10}"]
        for phase, rows in sent.items():
            refused = collections.Counter(status for _, status in rows if isinstance(status, int) and status >= 300)
            errors = sum(1 for _, status in rows if not isinstance(status, int))
            lost = sum(1 for rid in answered[phase] if rid not in written)
            shown = ", ".join(f"{status}×{count}" for status, count in sorted(refused.items())) or "—"
            lines.append(f"{phase:<18} {len(rows):>6} {len(answered[phase]):>6} {len(answered[phase]) / base:>9.2f} "
                         f"{shown:<28} {errors:>9} {lost:>10}")
        self.stdout.write("\n".join(lines))
        self.stdout.write(f"\nparked usage records written after the drill: {parked}")


async def _load(url: str, key: str, seconds: float, clients: int, fault) -> list[tuple[str, int | str]]:
    """``clients`` concurrent clients for ``seconds``; ``fault()`` starts at a third and returns the
    undo, called at two thirds. Each request: (its id, its status or the error's name)."""
    rows: list[tuple[str, int | str]] = []
    began = time.monotonic()
    deadline = began + seconds
    headers = {"Authorization": f"Bearer {key}"}

    async def faults():
        if fault is None:
            return
        await asyncio.sleep(seconds / 3)
        undo = await asyncio.to_thread(fault)
        await asyncio.sleep(seconds / 3)
        await asyncio.to_thread(undo)

    async with httpx.AsyncClient(timeout=30) as client:
        async def worker():
            while time.monotonic() < deadline:
                request_id = f"drill-{uuid.uuid4().hex[:16]}"
                try:
                    response = await client.post(f"{url}/v1/chat/completions", json=BODY,
                                                 headers={**headers, "X-Request-Id": request_id})
                    rows.append((request_id, response.status_code))
                except httpx.HTTPError as error:
                    rows.append((request_id, type(error).__name__))

        await asyncio.gather(faults(), *(worker() for _ in range(clients)))
    return rows
