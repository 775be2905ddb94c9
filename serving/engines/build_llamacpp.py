"""Build the portable ``llama-server`` from the llama.cpp tree vendored in llama-cpp-python's sdist.

No binary wheel of llama-server exists and Debian has no package, but the PyPI sdist of
``llama-cpp-python`` carries the whole llama.cpp tree. We pin one release (and its SHA-256), build
with ``GGML_NATIVE=OFF`` so the binary runs on any x86-64 of the fleet, and cache the result by
version outside the work tree: a new machine pays the build once, every later call reuses it.

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
import tarfile
import time
import urllib.request
from pathlib import Path
from typing import Callable

# The pinned source. Changing the version means changing the hash: the download is verified.
SDIST_NAME = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SIMPLE_INDEX = "https://pypi.org/simple/llama-cpp-python/"

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
    if not _sha256_matches(sdist):
        say("download", f"{SDIST_NAME}=={SDIST_VERSION} from PyPI")
        try:
            _download(sdist)
        except OSError as exc:
            raise BuildError("download", str(exc), log_path) from exc
    if not _sha256_matches(sdist):
        sdist.unlink(missing_ok=True)
        raise BuildError("download", f"SHA-256 of the sdist is not {SDIST_SHA256}", log_path)

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


def _sha256_matches(path: Path) -> bool:
    if not path.is_file():
        return False
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest() == SDIST_SHA256


def _download(dest: Path) -> None:
    """Find the pinned sdist's URL in PyPI's JSON simple index and download it."""
    request = urllib.request.Request(SIMPLE_INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        index = json.load(response)
    filename = f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
    urls = [f["url"] for f in index.get("files", []) if f.get("filename") == filename]
    if not urls:
        raise OSError(f"{filename} is not on the package index")
    partial = dest.with_suffix(".part")
    with urllib.request.urlopen(urls[0], timeout=120) as response, open(partial, "wb") as out:
        shutil.copyfileobj(response, out, 1 << 20)
    partial.rename(dest)


if __name__ == "__main__":  # lets the Makefile build before Django is installed
    engine = build(progress=lambda step, message: print(f"[{step}] {message}", flush=True))
    print(engine.path)
