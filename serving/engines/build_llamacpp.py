"""Build the portable ``llama-server`` from the llama.cpp tree vendored in llama-cpp-python's sdist.

No binary wheel of llama-server exists and Debian has no package, but the PyPI sdist of
``llama-cpp-python`` carries the whole llama.cpp tree. We pin one release (and its SHA-256), build
with ``GGML_NATIVE=OFF`` so the binary runs on any x86-64 of the fleet, and cache the result by
version outside the work tree: a new machine pays the build once, every later call reuses it.

The sdist is fetched by ``pip download`` run with this interpreter, so the site's own package
index, mirror and proxy settings apply (``PIP_INDEX_URL``, ``pip.conf``, ``/etc/xdg/pip``, ...);
whatever index serves it, the file must have the pinned SHA-256.

This module is plain Python (no Django) so the build can run before the project is installed.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Callable

# The pinned source. Changing the version means changing the hash: the download is verified.
SDIST_NAME = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"

CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
]

STEPS = ("download", "extract", "configure", "compile", "verify", "install")

Progress = Callable[[str, str], None]


class BuildError(Exception):
    """A build step failed. ``step`` names it; ``log_path`` keeps what it printed."""

    def __init__(self, step: str, message: str, log_path: Path | None = None):
        self.step = step
        self.log_path = log_path
        where = f" (log: {log_path})" if log_path else ""
        super().__init__(f"llama-server build failed at step '{step}': {message}{where}")


@dataclasses.dataclass(frozen=True)
class BuiltEngine:
    kind: str
    version: str  # what the binary says of itself, e.g. "b6123 (abc1234)"
    source: str  # the pinned source it came from, e.g. "llama-cpp-python==0.3.36"
    path: Path
    reused: bool


def default_cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "berth" / "engines"


def install_dir(cache_root: Path) -> Path:
    return cache_root / "llamacpp" / SDIST_VERSION


def binary_path(cache_root: Path) -> Path:
    return install_dir(cache_root) / "llama-server"


def read_version(binary: Path, timeout: float = 30) -> str:
    """Run ``llama-server --version`` and return its version line ("b6123 (abc1234)")."""
    proc = subprocess.run(
        [str(binary), "--version"], capture_output=True, text=True, timeout=timeout, check=False
    )
    text = proc.stdout + proc.stderr
    match = re.search(r"version:\s*(.+)", text)
    if proc.returncode != 0 or not match:
        raise RuntimeError(f"`{binary} --version` exited {proc.returncode}: {text.strip()[-500:]}")
    return match.group(1).strip()


def installed(cache_root: Path) -> BuiltEngine | None:
    """The cached build, if one is there and runs."""
    meta_path = install_dir(cache_root) / "engine.json"
    binary = binary_path(cache_root)
    if not (meta_path.is_file() and binary.is_file()):
        return None
    try:
        meta = json.loads(meta_path.read_text())
        version = read_version(binary)
    except (OSError, ValueError, RuntimeError, subprocess.TimeoutExpired):
        return None
    return BuiltEngine("llamacpp", version, meta.get("source", ""), binary, reused=True)


def build(cache_root: Path | None = None, jobs: int | None = None, progress: Progress | None = None,
          force: bool = False) -> BuiltEngine:
    """Return the cached ``llama-server``, building it first when it is missing or broken."""
    cache_root = Path(cache_root or default_cache_root())
    say = progress or (lambda step, message: None)
    work = cache_root / "llamacpp" / f".build-{SDIST_VERSION}"
    work.mkdir(parents=True, exist_ok=True)
    # Two builds at once (two shells, CI and a developer) would trample one tree: take turns.
    with open(cache_root / "llamacpp" / f".{SDIST_VERSION}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force:
            cached = installed(cache_root)
            if cached:
                say("install", f"reusing {cached.path} ({cached.version})")
                return cached
        log_path = cache_root / "llamacpp" / f"build-{SDIST_VERSION}.log"
        with open(log_path, "w") as log:
            engine = _build(work, cache_root, jobs or os.cpu_count() or 1, say, log, log_path)
        shutil.rmtree(work, ignore_errors=True)
        return engine


def _build(work: Path, cache_root: Path, jobs: int, say: Progress, log, log_path: Path) -> BuiltEngine:
    def run(step: str, argv: list[str], parse_percent: bool = False) -> None:
        log.write(f"$ {' '.join(argv)}\n")
        log.flush()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        last = -1
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            match = re.match(r"\[\s*(\d+)%\]", line) if parse_percent else None
            if match and int(match.group(1)) != last:
                last = int(match.group(1))
                say(step, f"{last}%")
        if proc.wait() != 0:
            log.flush()
            raise BuildError(step, f"`{argv[0]}` exited {proc.returncode}", log_path)

    sdist = work / f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
    if _sha256(sdist) != SDIST_SHA256:  # a verified sdist from an interrupted build is kept
        say("download", f"{SDIST_NAME}=={SDIST_VERSION} through pip (this site's package index)")
        downloaded = _download(work / "download", log, log_path)
        digest = _sha256(downloaded)
        if digest != SDIST_SHA256:
            downloaded.unlink(missing_ok=True)
            log.write(f"SHA-256 of {downloaded.name}: {digest}, pinned: {SDIST_SHA256}\n")
            log.flush()
            raise BuildError("download", f"the SHA-256 of {downloaded.name} is {digest}, "
                             f"not the pinned {SDIST_SHA256}", log_path)
        downloaded.replace(sdist)

    source = work / "src"
    tree = source / f"llama_cpp_python-{SDIST_VERSION}" / "vendor" / "llama.cpp"
    if not (tree / "CMakeLists.txt").is_file():
        say("extract", "vendor/llama.cpp")
        shutil.rmtree(source, ignore_errors=True)
        try:
            with tarfile.open(sdist) as archive:
                archive.extractall(source, filter="data")
        except (OSError, tarfile.TarError) as exc:
            raise BuildError("extract", str(exc), log_path) from exc
        if not (tree / "CMakeLists.txt").is_file():
            raise BuildError("extract", "the sdist holds no vendor/llama.cpp tree", log_path)

    if not shutil.which("cmake"):
        raise BuildError("configure", "cmake is not installed (apt-get install -y cmake g++)", log_path)
    build_dir = work / "build"
    say("configure", "cmake " + " ".join(CMAKE_FLAGS))
    run("configure", ["cmake", "-S", str(tree), "-B", str(build_dir), *CMAKE_FLAGS])
    say("compile", f"llama-server with {jobs} job(s); this takes several minutes on a small machine")
    started = time.monotonic()
    run("compile", ["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(jobs)],
        parse_percent=True)
    say("compile", f"done in {time.monotonic() - started:.0f}s")

    built = build_dir / "bin" / "llama-server"
    try:
        version = read_version(built)
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
        raise BuildError("verify", str(exc), log_path) from exc
    say("verify", f"llama-server --version: {version}")

    target = install_dir(cache_root)
    staging = target.with_name(target.name + ".new")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    shutil.copy2(built, staging / "llama-server")
    source_id = f"{SDIST_NAME}=={SDIST_VERSION}"
    (staging / "engine.json").write_text(json.dumps(
        {"kind": "llamacpp", "version": version, "source": source_id, "cmake_flags": CMAKE_FLAGS},
        indent=2))
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)  # the cache holds a whole build or none
    say("install", str(target / "llama-server"))
    return BuiltEngine("llamacpp", version, source_id, target / "llama-server", reused=False)


def _sha256(path: Path) -> str | None:
    """The file's SHA-256 in hex, or None when there is no such file."""
    if not path.is_file():
        return None
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _download(dest: Path, log, log_path: Path) -> Path:
    """Have pip fetch the pinned sdist into the empty folder ``dest``; return the file it saved.

    ``--no-binary`` names only our package: pip still prepares the sdist's metadata, and the build
    requirements it installs for that may come as wheels from the same index.
    """
    requirement = f"{SDIST_NAME}=={SDIST_VERSION}"
    if not sys.executable:
        raise BuildError("download", "this Python does not know its own path (sys.executable) to run pip",
                         log_path)
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    argv = [sys.executable, "-m", "pip", "download", "--no-binary", SDIST_NAME, "--no-deps",
            "--dest", str(dest), requirement]
    log.write(f"$ {' '.join(argv)}\n")
    log.flush()
    try:
        proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    except OSError as exc:
        raise BuildError("download", f"could not run pip: {exc}", log_path) from exc
    log.write(proc.stdout)
    log.flush()
    if proc.returncode != 0:
        lines = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
        last = f": {lines[-1]}" if lines else ""
        raise BuildError("download", f"`pip download {requirement}` exited {proc.returncode}{last}", log_path)
    saved = [path for path in dest.iterdir() if path.is_file()]
    if len(saved) != 1:
        names = ", ".join(sorted(path.name for path in saved)) or "nothing"
        raise BuildError("download", f"`pip download {requirement}` saved {names}, not one sdist", log_path)
    return saved[0]


if __name__ == "__main__":  # lets the Makefile build before Django is installed
    engine = build(progress=lambda step, message: print(f"[{step}] {message}", flush=True))
    print(engine.path)
