"""``manage.py bench_gateway [--litellm]``: what the gateway adds, against a fast stub engine.

Starts the stub engine (``gateway.bench.stub``) and one Berth web process (uvicorn, one worker,
``berth.asgi``) with a real key, rate limits and a budget on every level, usage records and the
access log on. Measures, direct to the stub and through each gateway, twice: sequential latency
(median and p99 added), streaming time to first chunk added, and requests/s with 32 concurrent
clients; then a thousand streams open together (time to first chunk), 200 KB prompts (requests/s)
and the gateway's RSS over a million requests. ``--litellm`` installs LiteLLM's proxy into its own virtualenv (``var/bench/litellm-venv``)
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

import aiohttp
import orjson
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import connection

from gateway.bench.fixture import berth_fixture, cleanup, free_port, stop, wait_http

BODY = {"model": "bench-model", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}


def _headers(key: str | None) -> dict:
    return {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}


async def _measure(base: str, key: str | None, sequential: int, streamed: int, seconds: float) -> dict:
    headers = _headers(key)
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
    many = await _throughput(base, key, body, seconds)
    latencies.sort()
    return {"p50": statistics.median(latencies), "p99": latencies[int(len(latencies) * 0.99) - 1],
            "ttfc": statistics.median(firsts), **many}


async def _streams(base: str, key: str | None, count: int) -> dict:
    """``count`` streams open together: each generates for two seconds (the stub's slow stream) and
    they start over one second, so all of them are open at the end of it; each one's time to first
    chunk (median and p99)."""
    headers = _headers(key)
    body = orjson.dumps({**BODY, "stream": True, "user": "slow"})
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=120)) as session:
        async def one(after: float = 0.0) -> float | None:
            await asyncio.sleep(after)
            began = time.perf_counter()
            try:
                async with session.post(f"{base}/v1/chat/completions", data=body, headers=headers) as response:
                    if response.status != 200:
                        return None
                    await response.content.readany()
                    first = (time.perf_counter() - began) * 1000
                    await response.read()
                    return first
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return None

        await asyncio.gather(*(one(index / count) for index in range(count)))  # connections open and warm
        firsts = await asyncio.gather(*(one(index / count) for index in range(count)))
    ok = sorted(first for first in firsts if first is not None)
    if not ok:
        raise CommandError(f"{base}: none of {count} concurrent streams answered")
    return {"p50": statistics.median(ok), "p99": ok[max(int(len(ok) * 0.99) - 1, 0)], "failed": count - len(ok)}


async def _throughput(base: str, key: str | None, body: bytes, seconds: float, clients: int = 32) -> dict:
    """Requests/s of ``clients`` sending ``body`` back to back for ``seconds``."""
    headers = _headers(key)
    done = failed = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients)) as session:
        async def worker(deadline: float):
            nonlocal done, failed
            while time.perf_counter() < deadline:
                async with session.post(f"{base}/v1/chat/completions", data=body, headers=headers) as response:
                    await response.read()
                    if response.status == 200:
                        done += 1
                    else:
                        failed += 1

        await asyncio.gather(*(worker(time.perf_counter() + 1) for _ in range(clients)))  # warm
        done = failed = 0
        began = time.perf_counter()
        await asyncio.gather(*(worker(began + seconds) for _ in range(clients)))
        elapsed = time.perf_counter() - began
    return {"rps": done / elapsed, "failed": failed}


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise CommandError(f"no VmRSS for process {pid}")


async def _rss_over(base: str, key: str, pid: int, requests: int, clients: int = 64) -> dict:
    """The gateway process's RSS after a tenth of ``requests`` (warm) and after all of them."""
    headers = _headers(key)
    body = orjson.dumps(BODY)
    sent = failed = 0
    marks = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients)) as session:
        async def worker():
            nonlocal sent, failed
            while sent < requests:
                sent += 1
                if sent == requests // 10:
                    marks["warm"] = _rss_mib(pid)
                async with session.post(f"{base}/v1/chat/completions", data=body, headers=headers) as response:
                    await response.read()
                    failed += response.status != 200

        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        elapsed = time.perf_counter() - began
    await asyncio.sleep(2)  # the last usage batch written and the access log flushed
    end = _rss_mib(pid)
    warm = marks.get("warm", end)
    return {"warm": warm, "end": end, "growth": (end - warm) / warm * 100, "requests": sent, "failed": failed,
            "seconds": elapsed}


class Command(BaseCommand):
    help = "Benchmark the gateway (and optionally LiteLLM's proxy) against a stub engine."

    def add_arguments(self, parser):
        parser.add_argument("--litellm", action="store_true", help="Also measure LiteLLM's proxy (installs it).")
        parser.add_argument("--sequential", type=int, default=1000)
        parser.add_argument("--streamed", type=int, default=300)
        parser.add_argument("--seconds", type=float, default=8.0)
        parser.add_argument("--rounds", type=int, default=2)
        parser.add_argument("--streams", type=int, default=1000, help="Streams opened at once (0: skip).")
        parser.add_argument("--large-kb", type=int, default=200, help="Prompt size of the large-prompt row (0: skip).")
        parser.add_argument("--rss-requests", type=int, default=1_000_000,
                            help="Requests through the gateway while its RSS is watched (0: skip).")

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
            self._scale(options, targets, berth.pid, made["key"], berth_url)
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

    def _scale(self, options, targets, berth_pid: int, key: str, berth_url: str) -> None:
        """The issue's rows beyond latency: a thousand streams at once, large prompts, memory over time."""
        if options["streams"] or options["large_kb"]:
            self._streams_and_prompts(options, targets)
        if options["rss_requests"]:
            self.stdout.write(f"berth: {options['rss_requests']} requests while its RSS is watched …")
            rss = asyncio.run(_rss_over(berth_url, key, berth_pid, options["rss_requests"]))
            self.stdout.write(f"RSS of the gateway process: {rss['warm']:.1f} MiB after {rss['requests'] // 10} "
                              f"requests, {rss['end']:.1f} MiB after {rss['requests']} ({rss['growth']:+.1f} %; "
                              f"target within ±5 %), {rss['failed']} failed, {rss['requests'] / rss['seconds']:.0f}/s")

    def _streams_and_prompts(self, options, targets) -> None:
        rows = [f"{'target':<8} {'streams':>7} {'ttfc p50':>9} {'ttfc p99':>9} {'+p50 ms':>8} {'failed':>6} "
                f"{'rps ' + str(options['large_kb']) + ' KB':>11} {'×direct':>8}"]
        streams, large = {}, {}
        prompt = "x" * (options["large_kb"] * 1024)
        large_body = orjson.dumps({**BODY, "messages": [{"role": "user", "content": prompt}]})
        for name, url, target_key in targets:
            self.stdout.write(f"{name}: {options['streams']} streams open together, {options['large_kb']} KB prompts …")
            if options["streams"]:
                streams[name] = asyncio.run(_streams(url, target_key, options["streams"]))
            if options["large_kb"]:
                large[name] = asyncio.run(_throughput(url, target_key, large_body, options["seconds"]))
        for name, _, _ in targets:
            s, big = streams.get(name), large.get(name)
            added = s["p50"] - streams["direct"]["p50"] if s else 0.0
            ratio = big["rps"] / large["direct"]["rps"] if big else 0.0
            rows.append(f"{name:<8} {options['streams']:>7} {s['p50'] if s else 0:>9.2f} {s['p99'] if s else 0:>9.2f} "
                        f"{added:>8.2f} {(s['failed'] if s else 0) + (big['failed'] if big else 0):>6} "
                        f"{big['rps'] if big else 0:>11.0f} {ratio:>8.2f}")
        self.stdout.write("\n" + "\n".join(rows))
        if "berth" in streams:
            added = streams["berth"]["p50"] - streams["direct"]["p50"]
            self.stdout.write(f"time to first chunk added with {options['streams']} streams open: {added:.2f} ms "
                              f"(target ≤ 2)")
        if "berth" in large:
            self.stdout.write(f"{options['large_kb']} KB prompts through Berth: {large['berth']['rps']:.0f} requests/s "
                              f"(target ≥ 500)")

    def _table(self, results: dict[str, list[dict]]) -> None:
        direct = results["direct"]
        lines = [f"{'target':<8} {'round':>5} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8} {'+p99 ms':>8} "
                 f"{'ttfc ms':>8} {'+ttfc':>7} {'rps@32':>8} {'×direct':>8} {'failed':>6}"]
        summary = {}
        for name, rounds in results.items():
            for index, figures in enumerate(rounds):
                base = direct[index]
                added = (figures["p50"] - base["p50"], figures["p99"] - base["p99"], figures["ttfc"] - base["ttfc"])
                lines.append(f"{name:<8} {index + 1:>5} {figures['p50']:>8.2f} {figures['p99']:>8.2f} "
                             f"{added[0]:>8.2f} {added[1]:>8.2f} {figures['ttfc']:>8.2f} {added[2]:>7.2f} "
                             f"{figures['rps']:>8.0f} {figures['rps'] / base['rps']:>8.2f} {figures['failed']:>6}")
                summary.setdefault(name, []).append((added[0], figures["rps"], figures["rps"] / base["rps"]))
        self.stdout.write("\n".join(lines))
        added = statistics.median(a for a, _, _ in summary["berth"])
        ratio = statistics.median(r for _, _, r in summary["berth"])
        self.stdout.write(f"\nBerth adds {added:.2f} ms at the median (target ≤ 0.5) and serves {ratio:.2f}× what the "
                          f"stub serves directly (target ≥ 0.25)")
        if "litellm" in summary:
            berth_added = statistics.median(a for a, _, _ in summary["berth"])
            berth_rps = statistics.median(r for _, r, _ in summary["berth"])
            lite_added = statistics.median(a for a, _, _ in summary["litellm"])
            lite_rps = statistics.median(r for _, r, _ in summary["litellm"])
            self.stdout.write(f"\nadded median latency: Berth {berth_added:.2f} ms vs LiteLLM {lite_added:.2f} ms "
                              f"(Berth/LiteLLM = {berth_added / lite_added:.2f}; target ≤ 0.10)")
            self.stdout.write(f"requests/s at 32 clients: Berth {berth_rps:.0f} vs LiteLLM {lite_rps:.0f} "
                              f"(Berth/LiteLLM = {berth_rps / lite_rps:.1f}×; target ≥ 10×)")
