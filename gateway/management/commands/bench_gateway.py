"""``manage.py bench_gateway [--litellm]``: what the gateway adds, against a fast stub engine.

Starts the stub engine (``gateway.bench.stub``) and one Berth web process (uvicorn, one worker,
``berth.asgi``) with a real key, rate limits and a budget on every level, usage records and the
access log on. Measures, direct to the stub and through each gateway, twice: sequential latency
(median and p99 added), streaming time to first chunk added, and requests/s with 32 concurrent
clients. ``--litellm`` installs LiteLLM's proxy into its own virtualenv (``var/bench/litellm-venv``)
and measures it the same way (one worker, master key, no database). Prints a table with ratios.
Not part of the test suite: figures depend on the machine.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import connection

from gateway.bench.fixture import berth_fixture, cleanup, free_port, stop, wait_http

BODY = {"model": "bench-model", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}


async def _measure(base: str, key: str | None, sequential: int, streamed: int, seconds: float) -> dict:
    import aiohttp
    import orjson

    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    body = orjson.dumps(BODY)
    stream_body = orjson.dumps({**BODY, "stream": True})
    url = f"{base}/v1/chat/completions"
    connector = aiohttp.TCPConnector(limit=64)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def one() -> int:
            async with session.post(url, data=body, headers=headers) as response:
                await response.read()
                return response.status

        for _ in range(50):  # warm: connections, caches, the JIT-less interpreter's first paths
            status = await one()
        if status != 200:
            raise CommandError(f"{url} answered {status}")
        latencies = []
        for _ in range(sequential):
            began = time.perf_counter()
            await one()
            latencies.append((time.perf_counter() - began) * 1000)
        firsts = []
        for _ in range(streamed):
            began = time.perf_counter()
            async with session.post(url, data=stream_body, headers=headers) as response:
                await response.content.readany()
                firsts.append((time.perf_counter() - began) * 1000)
                await response.read()
        done = 0
        failed = 0
        deadline = time.perf_counter() + seconds

        async def worker():
            nonlocal done, failed
            while time.perf_counter() < deadline:
                if await one() == 200:
                    done += 1
                else:
                    failed += 1

        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(32)))
        elapsed = time.perf_counter() - began
    latencies.sort()
    return {"p50": statistics.median(latencies), "p99": latencies[int(len(latencies) * 0.99) - 1],
            "ttfc": statistics.median(firsts), "rps": done / elapsed, "failed": failed}


class Command(BaseCommand):
    help = "Benchmark the gateway (and optionally LiteLLM's proxy) against a stub engine."

    def add_arguments(self, parser):
        parser.add_argument("--litellm", action="store_true", help="Also measure LiteLLM's proxy (installs it).")
        parser.add_argument("--sequential", type=int, default=1000)
        parser.add_argument("--streamed", type=int, default=300)
        parser.add_argument("--seconds", type=float, default=8.0)
        parser.add_argument("--rounds", type=int, default=2)

    def handle(self, *args, **options):
        root = Path(settings.BASE_DIR)
        work = Path(settings.DATA_DIR) / "bench"
        work.mkdir(parents=True, exist_ok=True)
        processes = []
        made = None
        try:
            stub_port = free_port()
            stub = subprocess.Popen([sys.executable, "-m", "gateway.bench.stub", str(stub_port)], cwd=root)
            processes.append(stub)
            stub_url = f"http://127.0.0.1:{stub_port}"
            wait_http(stub_url + "/", lambda s: True, 20, stub)

            made = berth_fixture(stub_port)
            berth_port = free_port()
            db = connection.settings_dict
            env = dict(os.environ, BERTH_GATEWAY_USAGE_FLUSH_MS="1000")
            if db["ENGINE"].endswith("postgresql"):
                env["DATABASE_URL"] = (f"postgres://{db['USER']}{':' + db['PASSWORD'] if db['PASSWORD'] else ''}"
                                       f"@{db['HOST']}:{db['PORT']}/{db['NAME']}")
            log = open(work / "berth-gateway.log", "wb")
            berth = subprocess.Popen([sys.executable, "-m", "uvicorn", "berth.asgi:application", "--host", "127.0.0.1",
                                      "--port", str(berth_port), "--workers", "1", "--loop", "uvloop", "--http",
                                      "httptools", "--no-access-log", "--lifespan", "on"],
                                     cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
            processes.append(berth)
            berth_url = f"http://127.0.0.1:{berth_port}"
            wait_http(berth_url + "/v1/models", lambda s: s == 401, 60, berth)

            targets = [("direct", stub_url, None), ("berth", berth_url, made["key"])]
            if options["litellm"]:
                litellm_url, litellm_process = self._litellm(work, stub_url)
                processes.append(litellm_process)
                targets.append(("litellm", litellm_url, "sk-bench-master-key"))

            results: dict[str, list[dict]] = {name: [] for name, _, _ in targets}
            for round_ in range(options["rounds"]):
                for name, url, key in targets:
                    self.stdout.write(f"round {round_ + 1}: {name} …")
                    results[name].append(asyncio.run(_measure(url, key, options["sequential"], options["streamed"],
                                                              options["seconds"])))
            self._table(results)
        finally:
            for process in reversed(processes):
                stop(process)
            if made is not None:
                cleanup(made)

    # -- LiteLLM's side ----------------------------------------------------------------------------

    def _litellm(self, work: Path, stub_url: str):
        venv = work / "litellm-venv"
        binary = venv / "bin" / "litellm"
        if not binary.exists():
            self.stdout.write("installing LiteLLM's proxy into its own virtualenv …")
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "litellm[proxy]"], check=True, timeout=900)
        config = work / "litellm.yaml"
        config.write_text("model_list:\n  - model_name: bench-model\n    litellm_params:\n"
                          f"      model: openai/bench-model\n      api_base: {stub_url}/v1\n      api_key: stub\n"
                          "general_settings:\n  master_key: sk-bench-master-key\n")
        port = free_port()
        env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
        env.update(LITELLM_MASTER_KEY="sk-bench-master-key", LITELLM_LOG="ERROR")
        log = open(work / "litellm.log", "wb")
        process = subprocess.Popen([str(binary), "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
                                    "--num_workers", "1"], env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health/liveliness", lambda s: s == 200, 180, process)
        return url, process

    def _table(self, results: dict[str, list[dict]]) -> None:
        direct = results["direct"]
        lines = [f"{'target':<8} {'round':>5} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8} {'+p99 ms':>8} "
                 f"{'ttfc ms':>8} {'+ttfc':>7} {'rps@32':>8} {'failed':>6}"]
        summary = {}
        for name, rounds in results.items():
            for index, figures in enumerate(rounds):
                base = direct[index]
                added = (figures["p50"] - base["p50"], figures["p99"] - base["p99"], figures["ttfc"] - base["ttfc"])
                lines.append(f"{name:<8} {index + 1:>5} {figures['p50']:>8.2f} {figures['p99']:>8.2f} "
                             f"{added[0]:>8.2f} {added[1]:>8.2f} {figures['ttfc']:>8.2f} {added[2]:>7.2f} "
                             f"{figures['rps']:>8.0f} {figures['failed']:>6}")
                summary.setdefault(name, []).append((added[0], figures["rps"]))
        self.stdout.write("\n".join(lines))
        if "litellm" in summary:
            berth_added = statistics.median(a for a, _ in summary["berth"])
            berth_rps = statistics.median(r for _, r in summary["berth"])
            lite_added = statistics.median(a for a, _ in summary["litellm"])
            lite_rps = statistics.median(r for _, r in summary["litellm"])
            self.stdout.write(f"\nadded median latency: Berth {berth_added:.2f} ms vs LiteLLM {lite_added:.2f} ms "
                              f"(Berth/LiteLLM = {berth_added / lite_added:.2f}; target ≤ 0.10)")
            self.stdout.write(f"requests/s at 32 clients: Berth {berth_rps:.0f} vs LiteLLM {lite_rps:.0f} "
                              f"(Berth/LiteLLM = {berth_rps / lite_rps:.1f}×; target ≥ 10×)")
