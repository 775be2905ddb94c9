"""Estimate accuracy against reality: real llama-server processes, their peak resident memory.

For generated GGUF shapes (layers, heads, KV heads, context, parallel) and SmolLM2, start the
llama-server this project builds with each configuration, send one short request, read VmHWM
from /proc/<pid>/status, and print estimate, measured and error per row with the mean absolute
error: for the uncalibrated estimate, after one calibrated load of a neighbouring configuration
(half the context), and for two baselines other tools use. Loopback only; every process it
starts is stopped by its PID. Not part of the test suite: run it on purpose.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from scheduler.estimation.engines import GIB, LlamaCppConfig, estimate_llamacpp
from scheduler.estimation.gguf_header import _read_shape_cached, read_shape
from scheduler.policy.calibration import Observation, calibrate
from serving.engines import build_llamacpp

SHAPES = [  # (label, shape, ctx, parallel)
    ("2L e64 h4/2", dict(layers=2, embedding=64, heads=4, kv_heads=2, feed_forward=128), 1024, 1),
    ("4L e256 h4/4", dict(layers=4, embedding=256, heads=4, kv_heads=4, feed_forward=512), 2048, 1),
    ("8L e512 h8/2", dict(layers=8, embedding=512, heads=8, kv_heads=2, feed_forward=1024), 4096, 1),
    ("8L e512 h8/2 p4", dict(layers=8, embedding=512, heads=8, kv_heads=2, feed_forward=1024), 4096, 4),
    ("16L e512 h8/8", dict(layers=16, embedding=512, heads=8, kv_heads=8, feed_forward=2048), 8192, 1),
    ("16L e512 h8/8 p2", dict(layers=16, embedding=512, heads=8, kv_heads=8, feed_forward=2048), 4096, 2),
    ("6L e768 h12/4", dict(layers=6, embedding=768, heads=12, kv_heads=4, feed_forward=3072), 2048, 1),
    ("12L e1024 h16/4 f32", dict(layers=12, embedding=1024, heads=16, kv_heads=4, feed_forward=2816,
                                 weight_type="f32"), 4096, 2),
    ("24L e256 h4/1", dict(layers=24, embedding=256, heads=4, kv_heads=1, feed_forward=1024), 16384, 1),
    ("qwen2 8L e384 h6/2 p4", dict(architecture="qwen2", layers=8, embedding=384, heads=6, kv_heads=2,
                                   feed_forward=1536), 8192, 4),
    ("10L e640 h10/5 hd96", dict(layers=10, embedding=640, heads=10, kv_heads=5, feed_forward=1792,
                                 key_length=96, value_length=96), 6144, 1),
    ("32L e256 h8/2", dict(layers=32, embedding=256, heads=8, kv_heads=2, feed_forward=768), 12288, 3),
]


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise CommandError(f"No VmHWM for process {pid}")


class Command(BaseCommand):
    help = "Measure estimate accuracy against real llama-server peak resident memory (a benchmark, not a test)."

    def handle(self, *args, **options):
        import logging

        for noisy in ("httpx", "gguf"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
        try:
            from tests.assets.gguf_models import ModelShape, write_gguf
            from tests.assets.llama_server import LlamaServer
            from tests.assets.smollm2 import smollm2_path
        except ImportError as error:
            raise CommandError(f"The benchmark needs the test assets and serving's engine build: {error}") from None
        engine = build_llamacpp.installed(Path(settings.ENGINE_CACHE_DIR))
        if engine is None:
            raise CommandError("llama-server is not built: run `python -m serving.engines.build_llamacpp` first.")
        work = Path(tempfile.mkdtemp(prefix="berth-bench-"))
        cases = []
        for label, shape, ctx, parallel in SHAPES:
            path = write_gguf(work / f"{label.replace(' ', '_').replace('/', '-')}.gguf", ModelShape(**shape, context=ctx))
            cases.append((label, path, ctx, parallel))
        smol = smollm2_path()
        cases += [("SmolLM2-135M Q4_1", smol, 2048, 1), ("SmolLM2-135M Q4_1 p4", smol, 4096, 4)]

        def measure(path, ctx, parallel):
            server = LlamaServer(engine.path, path, work / f"{path.stem}-{ctx}-{parallel}.log", context=ctx,
                                 parallel=parallel, threads=2)
            try:
                server.wait_ready()
                httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "hello world", "max_tokens": 4},
                           timeout=120).raise_for_status()
                return _peak_rss(server.process.pid)
            finally:
                server.stop()

        _read_shape_cached.cache_clear()
        started = time.perf_counter()
        read_shape(smol)
        header_ms = (time.perf_counter() - started) * 1000

        rows = []
        for label, path, ctx, parallel in cases:
            shape = read_shape(path)
            config = LlamaCppConfig(ctx_size=ctx, parallel=parallel)
            estimate = estimate_llamacpp(shape, config)
            measured = measure(path, ctx, parallel)
            neighbour_config = dataclasses.replace(config, ctx_size=max(512, ctx // 2))
            neighbour_estimate = estimate_llamacpp(shape, neighbour_config)
            neighbour_measured = measure(path, neighbour_config.ctx_size, parallel)
            calibrated = calibrate(estimate, config.calibration_key(shape), [Observation(
                neighbour_config.calibration_key(shape), neighbour_estimate.total_bytes, neighbour_measured, "loaded")])
            kv_f16 = shape.kv_bytes_per_token(2.0) * ctx
            rows.append({
                "label": label, "ctx": ctx, "parallel": parallel, "measured": measured,
                "estimate": estimate.total_bytes, "calibrated": calibrated.total_bytes,
                "weights_x1.2+2GiB": shape.weights_bytes * 1.2 + 2 * GIB,
                "file+KV": shape.file_bytes + kv_f16,
            })
            self.stdout.write(f"measured {label} ctx={ctx} parallel={parallel}", ending="\n")

        columns = ["estimate", "calibrated", "weights_x1.2+2GiB", "file+KV"]
        mib = 2**20
        head = f"{'model':<24}{'ctx':>7}{'par':>4}{'measured':>10}" + "".join(f"{c:>20}{'err%':>8}" for c in columns)
        self.stdout.write("\n" + head)
        self.stdout.write("-" * len(head))
        errors = {c: [] for c in columns}
        for row in rows:
            line = f"{row['label']:<24}{row['ctx']:>7}{row['parallel']:>4}{row['measured'] / mib:>9.1f}M"
            for column in columns:
                error = (row[column] - row["measured"]) * 100 / row["measured"]
                errors[column].append(abs(error))
                line += f"{row[column] / mib:>19.1f}M{error:>+8.1f}"
            self.stdout.write(line)
        self.stdout.write("-" * len(head))
        self.stdout.write(f"{'mean absolute error':<45}" + "".join(
            f"{'':>20}{statistics.mean(errors[c]):>7.1f}%" for c in columns))
        self.stdout.write(f"\nGGUF header read (SmolLM2, from disk, uncached): {header_ms:.1f} ms; "
                          f"llama-server {engine.version}; files in {work}")
