"""Engines as Docker containers, through the Docker SDK (``DOCKER_HOST`` from the environment).

Every container runs on the host network (Docker's default bridge is a private range Berth must
not use; the engine binds the loopback or node address and port the agent allocated), carries the
labels ``berth.managed=true``, ``berth.replica`` and ``berth.deployment`` (found again by label
after a restart), mounts the model's directory read-only at the same path, and is limited to the
reservation's memory and cores. Images are never pulled unless the node allows it.
"""

from __future__ import annotations

import os
from pathlib import Path

from serving.engines.base import EngineCommand, LaunchSpec
from serving.errors import EngineAlreadyRunning, EngineStartFailed, ImageMissing
from serving.runtimes.base import Exit, Handle, Status

MANAGED_LABEL = "berth.managed"
REPLICA_LABEL = "berth.replica"
DEPLOYMENT_LABEL = "berth.deployment"
OOM_EVIDENCE = "Docker OOMKilled"


def container_name(replica_id: str) -> str:
    return f"berth-{replica_id}"


def _exit_of(state: dict) -> Exit:
    code = state.get("ExitCode")
    if state.get("OOMKilled"):
        return Exit(code=code, signal=9, oom_evidence=OOM_EVIDENCE)
    # Docker reports a process ended by signal N as 128 + N (137: SIGKILL — `docker kill`, a stop
    # timeout, or an OOM kill outside the container's own limit: no evidence, so not OOM).
    if code is not None and 128 < code < 160:
        return Exit(code=code, signal=code - 128)
    return Exit(code=code, signal=None)


class DockerRuntime:
    kind = "docker"

    def __init__(self, client=None, allow_pull: bool | None = None):
        self._client = client
        self._allow_pull = allow_pull
        self._peaks: dict[str, int] = {}  # container id → largest peak seen

    @property
    def client(self):
        if self._client is None:
            import docker

            self._client = docker.from_env()
        return self._client

    @property
    def allow_pull(self) -> bool:
        if self._allow_pull is None:
            from django.conf import settings

            self._allow_pull = bool(getattr(settings, "SERVING_DOCKER_ALLOW_PULL", False))
        return self._allow_pull

    def ensure_image(self, image: str) -> None:
        import docker.errors

        try:
            self.client.images.get(image)
            return
        except docker.errors.ImageNotFound:
            pass
        if not self.allow_pull:
            hint = ("build it with `manage.py engines image llamacpp`" if image.startswith("berth/")
                    else "load it on this node, or allow pulling (BERTH_DOCKER_ALLOW_PULL=true)")
            raise ImageMissing(f"The image {image} is not on this node; {hint}.", details={"image": image})
        try:
            self.client.images.pull(image)
        except docker.errors.DockerException as exc:
            raise ImageMissing(f"The image {image} is not on this node and pulling it failed: {exc}.",
                               details={"image": image, "error": str(exc)}) from exc

    def start(self, spec: LaunchSpec, command: EngineCommand) -> Handle:
        import docker.errors
        from docker.types import DeviceRequest, Mount

        if not command.image:
            raise EngineStartFailed(f"The {spec.engine} command names no image for the Docker runtime.")
        self.ensure_image(command.image)
        name = container_name(spec.replica_id)
        try:
            old = self.client.containers.get(name)
        except docker.errors.NotFound:
            old = None
        if old is not None:
            if old.status == "running":
                raise EngineAlreadyRunning(f"Replica {spec.replica_id} already runs as container {old.short_id}.",
                                           details={"container_id": old.id})
            old.remove(force=True)  # a leftover of a failed start: its name is ours to reuse

        labels = {**spec.labels, MANAGED_LABEL: "true", REPLICA_LABEL: spec.replica_id}
        labels.setdefault(DEPLOYMENT_LABEL, "")
        models = [spec.model_path] + ([spec.config["draft_model"]] if spec.config.get("draft_model") else [])
        mounts = [Mount(target=d, source=d, type="bind", read_only=True)
                  for d in dict.fromkeys(d for path in models for d in self._model_dirs(path))]
        options = {}
        if spec.memory_limit_bytes:
            options["mem_limit"] = spec.memory_limit_bytes
            options["memswap_limit"] = spec.memory_limit_bytes  # no swap beyond the reservation
        if spec.cores:
            options["nano_cpus"] = int(spec.cores * 1_000_000_000)
        if spec.gpu_uuids:
            options["device_requests"] = [DeviceRequest(device_ids=list(spec.gpu_uuids), capabilities=[["gpu"]])]
        executable = Path(command.argv[0]).name  # the image carries the engine on its PATH
        try:
            container = self.client.containers.run(
                command.image, entrypoint=[executable], command=list(command.argv[1:]), name=name,
                detach=True, labels=labels, environment=dict(command.env), network_mode="host",
                mounts=mounts, **options)
        except docker.errors.DockerException as exc:
            raise EngineStartFailed(f"Docker could not start {name}: {exc}.",
                                    details={"image": command.image, "error": str(exc)}) from exc
        return Handle(runtime=self.kind, replica_id=spec.replica_id, container_id=container.id)

    @staticmethod
    def _model_dirs(model_path: str) -> list[str]:
        """The model's directory (or the model directory itself), and where a link in it leads."""
        dirs = []
        for path in (Path(model_path), Path(os.path.realpath(model_path))):
            directory = str(path if path.is_dir() else path.parent)
            if directory not in dirs:
                dirs.append(directory)
        return dirs

    def _container(self, handle: Handle):
        import docker.errors

        try:
            return self.client.containers.get(handle.container_id or container_name(handle.replica_id))
        except docker.errors.NotFound:
            return None

    def status(self, handle: Handle) -> Status:
        container = self._container(handle)
        if container is None:
            return Status(running=False, exit=Exit(code=None, signal=None),  # vanished
                          peak_memory_bytes=self._peaks.get(handle.container_id or ""))
        state = container.attrs.get("State", {})
        if state.get("Running"):
            return Status(running=True, peak_memory_bytes=self._peak(container))
        return Status(running=False, exit=_exit_of(state), peak_memory_bytes=self._peaks.get(container.id))

    def _peak(self, container) -> int | None:
        try:
            stats = container.stats(stream=False, one_shot=True)
        except Exception:  # stats are best effort: a container may end between the calls
            return self._peaks.get(container.id)
        memory = stats.get("memory_stats") or {}
        peak = memory.get("max_usage") or self._cgroup_v2_peak(container.id) or memory.get("usage")
        if peak:
            self._peaks[container.id] = max(int(peak), self._peaks.get(container.id, 0))
        return self._peaks.get(container.id)

    @staticmethod
    def _cgroup_v2_peak(container_id: str) -> int | None:
        """cgroup v2 has no max_usage in Docker's stats; memory.peak is there when the daemon is local."""
        for path in (f"/sys/fs/cgroup/system.slice/docker-{container_id}.scope/memory.peak",
                     f"/sys/fs/cgroup/docker/{container_id}/memory.peak"):
            try:
                return int(Path(path).read_text())
            except (OSError, ValueError):
                continue
        return None

    def logs(self, handle: Handle, lines: int = 200) -> str:
        container = self._container(handle)
        if container is None:
            return ""
        return container.logs(stdout=True, stderr=True, tail=lines).decode(errors="replace")

    def stop(self, handle: Handle, grace_seconds: float = 30) -> Exit | None:
        """Stop (SIGTERM, SIGKILL after the grace period) and remove the container. The exit, or
        None when it was not running."""
        import docker.errors

        container = self._container(handle)
        if container is None:
            return None
        was_running = container.attrs.get("State", {}).get("Running", False)
        try:
            if was_running:
                container.stop(timeout=max(1, int(round(grace_seconds))))
            container.reload()
            exit = _exit_of(container.attrs.get("State", {}))
            container.remove(force=True)
        except docker.errors.NotFound:
            return None
        return exit if was_running else None

    def managed(self) -> list[Handle]:
        containers = self.client.containers.list(filters={"label": f"{MANAGED_LABEL}=true"})
        return [Handle(runtime=self.kind, replica_id=c.labels.get(REPLICA_LABEL, c.name), container_id=c.id)
                for c in containers]
