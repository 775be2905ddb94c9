"""Build the local llama.cpp engine image ``berth/llama-server:<version>`` when it is missing.

No registry can be reached from the fleet's machines, so the image is made here from two things
we already have: a minimal Debian root file system (``debootstrap --variant=minbase``, cached as a
tarball and ``docker import``-ed as a base) and the portable ``llama-server`` that
``build_llamacpp`` caches. The Dockerfile (deploy/docker/llama-server.Dockerfile) only copies the
binary in, so a build runs no container and needs no network.

The root file system comes from the Debian mirror apt is configured with on this machine
(/etc/apt/sources.list, sources.list.d/*.list and deb822 *.sources: the first source serving
``bookworm`` itself), or from ``BERTH_DEBIAN_MIRROR`` (an http://, https://, ftp:// or file:///
address; it wins over apt's). With neither, the build fails and says so: there is no built-in mirror.

Plain Python (no Django), like ``build_llamacpp``, so the test command can run it before Django is
configured: ``python -m serving.engines.llamacpp_image [--if-docker]``.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

from serving.engines import build_llamacpp

IMAGE_REPOSITORY = "berth/llama-server"
IMAGE_TAG = build_llamacpp.SDIST_VERSION  # the llama-cpp-python release the binary comes from
IMAGE = f"{IMAGE_REPOSITORY}:{IMAGE_TAG}"
BASE_IMAGE = "berth/debian-minbase:bookworm"
DEBIAN_SUITE = "bookworm"
DEBOOTSTRAP_PACKAGES = "libgomp1,libssl3,ca-certificates"
APT_DIR = Path("/etc/apt")
MIRROR_SETTING = "BERTH_DEBIAN_MIRROR"
DOCKERFILE = Path(__file__).resolve().parents[2] / "deploy" / "docker" / "llama-server.Dockerfile"

Progress = Callable[[str, str], None]


class ImageBuildError(Exception):
    def __init__(self, step: str, message: str):
        self.step = step
        super().__init__(f"llama-server image build failed at step '{step}': {message}")


def rootfs_tarball(cache_root: Path) -> Path:
    """The cached Debian root file system (``cache_root`` is the engines cache, ~/.cache/berth/engines)."""
    return cache_root.parent / "images" / f"debian-{DEBIAN_SUITE}-minbase.tar"


def debian_mirror(apt_dir: Path = APT_DIR) -> str:
    """The Debian mirror debootstrap fetches ``DEBIAN_SUITE`` from.

    ``BERTH_DEBIAN_MIRROR`` when set; else the first apt source (``apt_dir``/sources.list, then
    sources.list.d/*.list and *.sources in apt's order) that serves the suite itself. There is no
    built-in address: a machine may reach only its own mirror, so guessing one would fail later
    and further from the cause.
    """
    explicit = os.environ.get(MIRROR_SETTING, "").strip()
    if explicit:
        if not _debootstrap_can_fetch(explicit):
            raise ImageBuildError("rootfs", f"{MIRROR_SETTING}={explicit!r} is not an http://, https://, "
                                            f"ftp:// or file:/// address of a Debian mirror")
        return explicit
    files = [apt_dir / "sources.list"]
    parts = apt_dir / "sources.list.d"
    if parts.is_dir():
        files += sorted(path for path in parts.iterdir() if path.suffix in (".list", ".sources"))
    for path in files:
        try:
            text = path.read_text()
        except (FileNotFoundError, IsADirectoryError):
            continue
        except (OSError, UnicodeDecodeError) as exc:
            raise ImageBuildError("rootfs", f"cannot read the apt source {path}: {exc}") from exc
        parse = _deb822_sources if path.suffix == ".sources" else _one_line_sources
        for types, uris, suites in parse(text):
            if "deb" in types and DEBIAN_SUITE in suites:
                for uri in uris:
                    if _debootstrap_can_fetch(uri):
                        return uri
    raise ImageBuildError("rootfs", f"no Debian mirror for {DEBIAN_SUITE}: no apt source under {apt_dir} "
                                    f"(sources.list, sources.list.d/*.list, *.sources) serves it; set "
                                    f"{MIRROR_SETTING} to the mirror's address (http://HOST/debian)")


def _debootstrap_can_fetch(uri: str) -> bool:
    # apt's transports debootstrap lacks (mirror+file:, tor+http:, cdrom:) do not count.
    return re.match(r"(https?|ftp)://[^/\s]+|file:///", uri) is not None


def _one_line_sources(text: str):
    """``deb [options] URI SUITE [COMPONENT...]`` lines, as (types, uris, suites)."""
    for line in text.splitlines():
        line = line.split("#", 1)[0]
        line = re.sub(r"^(\s*\S+)\s+\[[^\]]*\]", r"\1 ", line)  # deb [arch=amd64 signed-by=...] URI
        words = line.split()
        if len(words) >= 3:
            yield {words[0]}, [words[1]], {words[2]}


def _deb822_sources(text: str):
    """The stanzas of a deb822 ``.sources`` file, as (types, uris, suites); ``Enabled: no`` skipped."""
    for stanza in re.split(r"\n[ \t]*\n", text):
        fields: dict[str, str] = {}
        name = None
        for line in stanza.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            if line[0] in " \t" and name:  # a folded continuation of the field above
                fields[name] += " " + line.strip()
                continue
            name, _, value = line.partition(":")
            name = name.strip().lower()
            fields[name] = value.strip()
        if fields.get("enabled", "yes").lower() == "no":
            continue
        yield (set(fields.get("types", "").split()), fields.get("uris", "").split(),
               set(fields.get("suites", "").split()))


def image_present(client, name: str) -> bool:
    import docker.errors

    try:
        client.images.get(name)
        return True
    except docker.errors.ImageNotFound:
        return False


def build_image(client=None, cache_root: Path | None = None, progress: Progress | None = None,
                force: bool = False) -> str:
    """Return the image name, building the image (and its base) first when missing."""
    import docker

    say = progress or (lambda step, message: None)
    cache_root = Path(cache_root or build_llamacpp.default_cache_root())
    client = client or docker.from_env()
    if not force and image_present(client, IMAGE):
        say("image", f"{IMAGE} is present")
        return IMAGE

    engine = build_llamacpp.build(cache_root, progress=progress)  # reuses the cached binary
    lock_path = cache_root.parent / "images" / ".image.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two test runs at once build it once
        if not force and image_present(client, IMAGE):
            return IMAGE
        if force or not image_present(client, BASE_IMAGE):
            tarball = _rootfs(cache_root, say)
            say("import", f"{tarball} as {BASE_IMAGE}")
            repository, tag = BASE_IMAGE.split(":")
            client.api.import_image_from_file(str(tarball), repository=repository, tag=tag)
        if not DOCKERFILE.is_file():
            raise ImageBuildError("build", f"{DOCKERFILE} is missing")
        with tempfile.TemporaryDirectory(prefix="berth-image-") as context:
            shutil.copy2(DOCKERFILE, Path(context) / "Dockerfile")
            shutil.copy2(engine.path, Path(context) / "llama-server")
            say("build", f"{IMAGE} from {BASE_IMAGE} + {engine.path}")
            try:
                # host network: the daemon has no bridge (and this build runs no container anyway)
                client.images.build(path=context, tag=IMAGE, buildargs={"BASE": BASE_IMAGE}, rm=True,
                                    network_mode="host", labels={"berth.engine": "llamacpp",
                                                                 "berth.engine.version": engine.version})
            except docker.errors.BuildError as exc:
                raise ImageBuildError("build", str(exc)) from exc
    say("done", IMAGE)
    return IMAGE


def _rootfs(cache_root: Path, say: Progress) -> Path:
    tarball = rootfs_tarball(cache_root)
    if tarball.is_file():
        say("rootfs", f"reusing {tarball}")
        return tarball
    mirror = debian_mirror()  # before installing anything: a machine without one fails at once
    debootstrap = shutil.which("debootstrap") or ("/usr/sbin/debootstrap" if Path("/usr/sbin/debootstrap").exists() else None)
    if not debootstrap:
        if os.geteuid() != 0:
            raise ImageBuildError("rootfs", "debootstrap is not installed (apt-get install -y debootstrap)")
        say("rootfs", "apt-get install debootstrap")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for argv in (["apt-get", "update", "-qq"],
                     ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "debootstrap"]):
            proc = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
            if proc.returncode != 0:
                raise ImageBuildError("rootfs", f"`{' '.join(argv)}` exited {proc.returncode}: {proc.stderr[-500:]}")
        debootstrap = shutil.which("debootstrap") or "/usr/sbin/debootstrap"
    tarball.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="berth-rootfs-", dir=tarball.parent) as work:
        rootfs = Path(work) / "rootfs"
        say("rootfs", f"debootstrap --variant=minbase {DEBIAN_SUITE} from {mirror} (about half a minute)")
        proc = subprocess.run([debootstrap, "--variant=minbase", f"--include={DEBOOTSTRAP_PACKAGES}",
                               DEBIAN_SUITE, str(rootfs), mirror], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise ImageBuildError("rootfs", f"debootstrap exited {proc.returncode}: {(proc.stdout + proc.stderr)[-800:]}")
        partial = Path(work) / "rootfs.tar"
        proc = subprocess.run(["tar", "-C", str(rootfs), "--numeric-owner", "-cf", str(partial), "."],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise ImageBuildError("rootfs", f"tar exited {proc.returncode}: {proc.stderr[-500:]}")
        partial.rename(tarball)  # the cache holds a whole root file system or none
    return tarball


def main(argv: list[str]) -> int:
    say = lambda step, message: print(f"[{step}] {message}", flush=True)  # noqa: E731
    import docker
    import docker.errors

    try:
        client = docker.from_env()
        client.ping()
    except docker.errors.DockerException as exc:
        if "--if-docker" in argv:
            say("image", f"no Docker daemon answers ({exc}); not building {IMAGE}")
            return 0
        print(f"No Docker daemon answers: {exc}", file=sys.stderr)
        return 1
    try:
        print(build_image(client, progress=say, force="--force" in argv))
    except (ImageBuildError, build_llamacpp.BuildError) as exc:
        print(str(exc), file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
