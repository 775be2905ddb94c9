"""Estimate accuracy against reality: real llama-server processes, their peak resident memory.

For generated GGUF models of many shapes — dense llama/qwen2, sliding-window gemma3 and phi3 (and a
llama header naming a window llama.cpp ignores), Q4_0/Q4_K/Q4_K_M/Q6_K/Q8_0 weights, mixtures of
experts, long contexts, flash attention on and off — and SmolLM2, start the llama-server this
project builds with each configuration, send one prompt that fills a slot's context (the worst case
a reservation must hold: every cache cell and a full micro-batch of attention; every slot at once
where there are several), read VmHWM from
/proc/<pid>/status, and print estimate, measured and error per row: for the uncalibrated estimate,
after one calibrated load of a neighbouring configuration (half the context), and for two
baselines other tools use; then the mean absolute error and the worst row of each.

What a server keeps across many requests is not in the measurement: its prompt cache (up to
``--cache-ram``, 8 GiB by default) and, for sliding-window models, checkpoints beyond the two a
prompt makes (up to ``--ctx-checkpoints``). Loopback only; every process it starts is stopped by
its PID. Not part of the test suite: run it on purpose (about 15 minutes on two cores; ``--only``
runs the rows whose label contains a word).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from scheduler.estimation.engines import GIB, LlamaCppConfig, estimate_llamacpp
from scheduler.estimation.gguf_header import _read_shape_cached, read_shape
from scheduler.policy.calibration import Observation, calibrate
from serving.engines import build_llamacpp

MIB = 2**20
K256 = dict(embedding=256, feed_forward=768)  # K-quants need rows of a multiple of 256 values


@dataclasses.dataclass(frozen=True)
class Row:
    label: str
    shape: dict
    ctx: int
    parallel: int = 1
    flash_attention: bool = True


ROWS = [
    # Dense llama / qwen2 shapes.
    Row("2L e64 h4/2", dict(layers=2, embedding=64, heads=4, kv_heads=2, feed_forward=128), 1024),
    Row("4L e256 h4/4", dict(layers=4, embedding=256, heads=4, kv_heads=4, feed_forward=512), 2048),
    Row("8L e512 h8/2", dict(layers=8, embedding=512, heads=8, kv_heads=2, feed_forward=1024), 4096),
    Row("8L e512 h8/2 p4", dict(layers=8, embedding=512, heads=8, kv_heads=2, feed_forward=1024), 4096, 4),
    Row("16L e512 h8/8 p2", dict(layers=16, embedding=512, heads=8, kv_heads=8, feed_forward=2048), 4096, 2),
    Row("6L e768 h12/4", dict(layers=6, embedding=768, heads=12, kv_heads=4, feed_forward=3072), 2048),
    Row("12L e1024 h16/4 f32 p2", dict(layers=12, embedding=1024, heads=16, kv_heads=4, feed_forward=2816,
                                       weight_type="f32"), 4096, 2),
    Row("qwen2 8L e384 h6/2 p4", dict(architecture="qwen2", layers=8, embedding=384, heads=6, kv_heads=2,
                                      feed_forward=1536), 8192, 4),
    Row("10L e640 h10/5 hd96", dict(layers=10, embedding=640, heads=10, kv_heads=5, feed_forward=1792,
                                    key_length=96, value_length=96), 4096),
    Row("32L e256 h8/2 p3", dict(layers=32, embedding=256, heads=8, kv_heads=2, feed_forward=768), 6144, 3),
    # Long prompts.
    Row("long 24L e256 h4/1", dict(layers=24, embedding=256, heads=4, kv_heads=1, feed_forward=1024), 16384),
    Row("long 4L e256 h4/2", dict(layers=4, embedding=256, heads=4, kv_heads=2, feed_forward=512), 32768),
    # Flash attention off: the attention scores of a micro-batch over the whole context.
    Row("noFA 8L e512 h8/2", dict(layers=8, embedding=512, heads=8, kv_heads=2, feed_forward=1024), 4096,
        flash_attention=False),
    Row("noFA 8L e512 h8/2 p4", dict(layers=8, embedding=512, heads=8, kv_heads=2, feed_forward=1024), 4096, 4,
        flash_attention=False),
    Row("noFA qwen2 8L e384 p4", dict(architecture="qwen2", layers=8, embedding=384, heads=6, kv_heads=2,
                                      feed_forward=1536), 8192, 4, flash_attention=False),
    Row("noFA long 24L e256 h4/1", dict(layers=24, embedding=256, heads=4, kv_heads=1, feed_forward=1024), 8192,
        flash_attention=False),
    Row("noFA 12L e1024 f32 p2", dict(layers=12, embedding=1024, heads=16, kv_heads=4, feed_forward=2816,
                                      weight_type="f32"), 4096, 2, flash_attention=False),
    # Sliding windows.
    Row("gemma3 12L w512", dict(architecture="gemma3", layers=12, embedding=512, heads=4, kv_heads=1, key_length=256,
                                value_length=256, feed_forward=1536, sliding_window=512), 8192),
    Row("gemma3 12L w512 p2", dict(architecture="gemma3", layers=12, embedding=512, heads=4, kv_heads=1,
                                   key_length=256, value_length=256, feed_forward=1536, sliding_window=512), 8192, 2),
    Row("gemma3 8L w1024 long", dict(architecture="gemma3", layers=8, embedding=256, heads=4, kv_heads=2,
                                     key_length=128, value_length=128, feed_forward=768, sliding_window=1024), 16384),
    Row("gemma3 8L w256 noFA", dict(architecture="gemma3", layers=8, embedding=256, heads=4, kv_heads=2,
                                    key_length=128, value_length=128, feed_forward=768, sliding_window=256), 4096,
        flash_attention=False),
    Row("gemma3 9L pattern3 q4_k", dict(architecture="gemma3", layers=9, heads=4, kv_heads=2, sliding_window=256,
                                        sliding_window_pattern=3, weight_type="q4_k", **K256), 8192),
    Row("phi3 8L w512", dict(architecture="phi3", layers=8, embedding=512, heads=8, kv_heads=8, feed_forward=1536,
                             sliding_window=512), 4096),
    Row("llama 8L w512 (unused)", dict(layers=8, embedding=512, heads=8, kv_heads=2, feed_forward=1024,
                                       sliding_window=512), 4096),
    # Quantised weights: Q4_0 and Q4_K are repacked on the CPU, Q4_K_M partly, Q6_K and Q8_0 not.
    Row("q4_0 8L e512", dict(layers=8, embedding=512, heads=8, kv_heads=2, feed_forward=1536, weight_type="q4_0"),
        4096),
    Row("q4_k 12L e512", dict(layers=12, embedding=512, heads=8, kv_heads=2, feed_forward=1536, weight_type="q4_k"),
        4096),
    Row("q4_k_m 16L e768", dict(layers=16, embedding=768, heads=12, kv_heads=4, feed_forward=2048,
                                weight_type="q4_k_m"), 4096),
    Row("q6_k 8L e512", dict(layers=8, embedding=512, heads=8, kv_heads=2, feed_forward=1536, weight_type="q6_k"),
        4096),
    Row("q8_0 8L e512 p2", dict(layers=8, embedding=512, heads=8, kv_heads=2, feed_forward=1536, weight_type="q8_0"),
        4096, 2),
    # Mixtures of experts (every expert's weights resident: a long prompt routes to all of them).
    Row("moe 8x2 8L e512", dict(layers=8, embedding=512, heads=8, kv_heads=2, feed_forward=768, experts=8,
                                experts_used=2), 4096),
    Row("moe 16x4 6L q4_0", dict(layers=6, embedding=512, heads=8, kv_heads=2, feed_forward=512, experts=16,
                                 experts_used=4, weight_type="q4_0"), 4096),
    Row("moe 8x2 q4_k noFA", dict(layers=6, heads=4, kv_heads=2, experts=8, experts_used=2, weight_type="q4_k",
                                  **K256), 4096, flash_attention=False),
]


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise CommandError(f"No VmHWM for process {pid}")


def _prompt(tokens: int, vocab: int) -> list[int]:
    """A prompt of ``tokens`` token ids: BOS, then ordinary ids (byte-fallback and word pieces)."""
    return [1] + [3 + (i * 7919) % (vocab - 3) for i in range(tokens - 1)]


class Command(BaseCommand):
    help = "Measure estimate accuracy against real llama-server peak resident memory (a benchmark, not a test)."

    def add_arguments(self, parser):
        parser.add_argument("--only", default="", help="run only the rows whose label contains this word")

    def handle(self, *args, **options):
        for noisy in ("httpx", "gguf"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
        try:
            # The test assets are not part of an installed Berth: imported only when the benchmark runs.
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
        for row in ROWS:
            path = write_gguf(work / f"{row.label.replace(' ', '_').replace('/', '-')}.gguf",
                              ModelShape(**row.shape, context=row.ctx))
            cases.append((row, path))
        smol = smollm2_path()
        cases += [(Row("SmolLM2-135M Q4_1", {}, 2048), smol), (Row("SmolLM2-135M Q4_1 p4", {}, 4096, 4), smol)]
        cases = [(row, path) for row, path in cases if options["only"].lower() in row.label.lower()]

        def measure(path, config: LlamaCppConfig, shape) -> tuple[int, int]:
            server = LlamaServer(engine.path, path, work / f"{path.stem}-{config.ctx_size}-{config.parallel}.log",
                                 context=config.ctx_size, parallel=config.parallel, threads=2,
                                 extra=("-fa", "on" if config.flash_attention else "off"))
            try:
                server.wait_ready()
                per_slot = estimate_llamacpp(shape, config).inputs["ctx_per_slot"]
                tokens = min(per_slot, config.ctx_size // config.parallel) - 16

                def fill(slot: int) -> None:
                    prompt = _prompt(tokens, shape.vocab_size)
                    httpx.post(f"{server.base_url}/completion", timeout=1800, json={
                        "prompt": prompt[:1] + prompt[1 + slot:] + prompt[1:1 + slot], "n_predict": 2,
                    }).raise_for_status()

                # Every slot at once, each with a prompt of its own that fills it: one after another,
                # the server would save each idle slot to its prompt cache when the next one starts.
                with ThreadPoolExecutor(config.parallel) as pool:
                    list(pool.map(fill, range(config.parallel)))
                return _peak_rss(server.process.pid), tokens
            finally:
                server.stop()

        _read_shape_cached.cache_clear()
        started = time.perf_counter()
        read_shape(smol)
        header_ms = (time.perf_counter() - started) * 1000

        rows = []
        bench_started = time.monotonic()
        for row, path in cases:
            shape = read_shape(path)
            config = LlamaCppConfig(ctx_size=row.ctx, parallel=row.parallel, flash_attention=row.flash_attention)
            estimate = estimate_llamacpp(shape, config)
            measured, prompt = measure(path, config, shape)
            neighbour_config = dataclasses.replace(config, ctx_size=max(512 * row.parallel, row.ctx // 2))
            neighbour_estimate = estimate_llamacpp(shape, neighbour_config)
            neighbour_measured, _ = measure(path, neighbour_config, shape)
            calibrated = calibrate(estimate, config.calibration_key(shape), [Observation(
                neighbour_config.calibration_key(shape), neighbour_estimate.total_bytes, neighbour_measured, "loaded")],
                separate=config.calibration_separate)
            kv_f16 = shape.kv_bytes_per_token(2.0) * row.ctx
            rows.append({
                "label": row.label, "ctx": row.ctx, "parallel": row.parallel, "fa": row.flash_attention,
                "prompt": prompt, "measured": measured, "estimate": estimate.total_bytes,
                "calibrated": calibrated.total_bytes, "weights_x1.2+2GiB": shape.weights_bytes * 1.2 + 2 * GIB,
                "file+KV": shape.file_bytes + kv_f16,
            })
            self.stdout.write(f"measured {row.label} ctx={row.ctx} parallel={row.parallel} "
                              f"fa={'on' if row.flash_attention else 'off'} prompt={prompt}: {measured:,} B, "
                              f"at ctx={neighbour_config.ctx_size} {neighbour_measured:,} B", ending="\n")

        columns = ["estimate", "calibrated", "weights_x1.2+2GiB", "file+KV"]
        head = (f"{'model':<26}{'ctx':>7}{'par':>4}{'fa':>4}{'prompt':>7}{'measured':>10}"
                + "".join(f"{c:>19}{'err%':>8}" for c in columns))
        self.stdout.write("\n" + head)
        self.stdout.write("-" * len(head))
        errors = {c: [] for c in columns}
        for row in rows:
            line = (f"{row['label']:<26}{row['ctx']:>7}{row['parallel']:>4}{'on' if row['fa'] else 'off':>4}"
                    f"{row['prompt']:>7}{row['measured'] / MIB:>9.1f}M")
            for column in columns:
                error = (row[column] - row["measured"]) * 100 / row["measured"]
                errors[column].append(error)
                line += f"{row[column] / MIB:>18.1f}M{error:>+8.1f}"
            self.stdout.write(line)
        self.stdout.write("-" * len(head))
        if not rows:
            return
        lead = 58
        self.stdout.write(f"{'mean absolute error':<{lead}}" + "".join(
            f"{'':>19}{statistics.mean(abs(e) for e in errors[c]):>7.1f}%" for c in columns))
        self.stdout.write(f"{'worst underestimate (most negative)':<{lead}}" + "".join(
            f"{'':>19}{min(errors[c]):>+7.1f}%" for c in columns))
        self.stdout.write(f"{'rows below -10%':<{lead}}" + "".join(
            f"{'':>19}{sum(e < -10 for e in errors[c]):>8}" for c in columns))
        self.stdout.write("\nTargets: mean absolute error <= 3% uncalibrated, <= 1% after one calibrated neighbour, "
                          "no row below -10%.")
        self.stdout.write(f"GGUF header read (SmolLM2, from disk, uncached): {header_ms:.1f} ms; "
                          f"llama-server {engine.version}; {len(rows)} rows in "
                          f"{(time.monotonic() - bench_started) / 60:.1f} min; files in {work}")
