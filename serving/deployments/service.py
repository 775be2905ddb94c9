"""The deployment verbs: preview, deploy, stop, remove. The API, the console, commands and the
reconcile loop call these; the node agent carries out what touches engines (``serving.agent``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from django.db import IntegrityError, transaction

from berth.errors import NotFound
from scheduler import memory
from scheduler.errors import InsufficientMemory
from scheduler.models import Accelerator, Node
from serving.deployments import ports, states
from serving.engines.registry import engine_for
from serving.errors import DeploymentConflict, InvalidDeployment, SleepNotSupported
from serving.models import Deployment, DeploymentState as S, Replica
from tenancy import access, audit
from tenancy.audit import Actor
from tenancy.models import Scope
from tenancy.services import contracts

GIB = 2**30
# Engine configuration keys (as engines take them) → the estimator's names for the same thing.
ESTIMATION_KEYS = {
    "llamacpp": {"context": "ctx_size", "ctx_size": "ctx_size", "parallel": "parallel", "gpu_layers": "n_gpu_layers",
                 "n_gpu_layers": "n_gpu_layers", "cache_type_k": "cache_type_k", "cache_type_v": "cache_type_v",
                 "ubatch_size": "ubatch_size", "flash_attn": "flash_attention", "flash_attention": "flash_attention"},
    "vllm": {"max_model_len": "max_model_len", "max_num_seqs": "max_num_seqs", "kv_cache_dtype": "kv_cache_dtype",
             "tensor_parallel_size": "tensor_parallel_size", "enforce_eager": "enforce_eager",
             "max_num_batched_tokens": "max_num_batched_tokens"},
}


@dataclasses.dataclass(frozen=True)
class DeployRequest:
    name: str
    model_path: str
    node: Node
    engine: str = Deployment.Engine.LLAMACPP
    runtime: str = Deployment.Runtime.PROCESS
    task: str = Deployment.Task.CHAT
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    accelerator: Accelerator | None = None
    # A tensor-parallel replica's further accelerators, on the same node: a shard on each.
    shards: tuple[Accelerator, ...] = ()
    owner: Scope | None = None
    priority: int = 50
    cores: int | None = None
    # The placement loop adds replicas of a catalog model: more than one deployment serves its name.
    another_replica: bool = False
    # Replicas stopped to make room for this one (preemption): it starts once they have stopped.
    waits_for: tuple[str, ...] = ()
    profile: str = ""  # the catalog profile it runs ("" when deployed by hand)


def estimation_config(engine: str, config: dict[str, Any], gpus: int = 0) -> dict[str, Any]:
    """An engine configuration in the estimator's names, with what the engine does by default on
    ``gpus`` placed accelerators: llama.cpp offloads every layer and splits them over the GPUs,
    vLLM shards the model over them (tensor parallel)."""
    names = ESTIMATION_KEYS.get(engine, {})
    translated = {}
    for key, value in config.items():
        if key in names and value is not None:
            if names[key] == "n_gpu_layers" and isinstance(value, str):
                value = -1 if value == "all" else int(value)
            if names[key] == "flash_attention" and isinstance(value, str):
                value = value != "off"  # "auto" may use it: estimate as if it does
            translated[names[key]] = value
    if engine == "llamacpp" and gpus:
        translated.setdefault("n_gpu_layers", -1)
        if gpus > 1:
            translated["split_gpus"] = gpus
    if engine == "vllm" and gpus > 1:
        translated.setdefault("tensor_parallel_size", gpus)
    return translated


def _validate(request: DeployRequest) -> dict[str, Any]:
    problems = {}
    name = (request.name or "").strip()
    if not name or len(name) > 200 or any(c.isspace() for c in name):
        problems["name"] = "1-200 characters without spaces: the model name clients will ask for."
    for field, enum in (("engine", Deployment.Engine), ("runtime", Deployment.Runtime), ("task", Deployment.Task)):
        if getattr(request, field) not in enum.values:
            problems[field] = f"one of {', '.join(enum.values)}"
    if not 0 <= request.priority <= 100:
        problems["priority"] = "0 to 100"
    if request.cores is not None and request.cores < 1:
        problems["cores"] = "at least 1"
    if problems:
        raise InvalidDeployment("The deployment is invalid.", details=problems)
    config = engine_for(request.engine).validate_config(dict(request.config))
    memory.allowed_model_path(request.model_path)
    if config.get("draft_model"):
        memory.allowed_model_path(config["draft_model"])  # under the model roots, like the model itself
    return config


def preview(actor: Actor, request: DeployRequest) -> memory.EstimateResult:
    """Will it fit, and what is it made of — changes nothing (the wizard calls this as one types).
    When it does not, the plans may sleep or stop what already runs on the node, by name. It takes
    what the deploy would (it reads the model's file): a viewer is refused before anything is read."""
    _require_owner(actor, request)
    return _estimate(request, _validate(request), residents(request.node))


def _require_owner(actor: Actor, request: DeployRequest) -> None:
    if request.owner is not None:
        access.require(actor, "use", request.owner)
    elif not access.is_superuser(actor):
        raise InvalidDeployment("Name the project (or team) this deployment belongs to.", details={"owner": "required"})


def residents(node: Node) -> list:
    """The node's running deployments as the fit planner sees them."""
    from scheduler.policy.fit import Resident

    return [Resident(name=d.name, memory_bytes=d.memory_reserved_bytes or 0, priority=d.priority,
                     can_sleep=d.engine == Deployment.Engine.VLLM, sleeping=d.state == S.SLEEPING)
            for d in Deployment.objects.filter(node=node, state__in=(S.READY, S.SLEEPING, S.UNKNOWN))]


def _estimate(request: DeployRequest, config: dict[str, Any], residents=()) -> memory.EstimateResult:
    gpus = len(request.shards) + 1 if request.accelerator is not None else 0
    return memory.estimate_and_fit(request.model_path, request.engine, estimation_config(request.engine, config, gpus),
                                   node=request.node, accelerator=request.accelerator, residents=residents,
                                   priority=request.priority, draft_path=config.get("draft_model"))


def deploy(actor: Actor, request: DeployRequest) -> Deployment:
    """Validate → estimate → fit under the memory lock → allocate a port → record → start (by the
    node's agent, once this commits). Refused with fresh plans, changing nothing, when it does not fit."""
    _require_owner(actor, request)
    config = _validate(request)
    result = _estimate(request, config)
    if result.fit is not None and not result.fit.fits:
        raise InsufficientMemory(f"{request.name} does not fit on {request.node.name}: "
                                 f"{result.estimate.total_bytes / GIB:,.2f} GiB needed.",
                                 details={"fit": result.fit.as_dict(), "estimate": result.estimate.as_dict()})
    reserve_bytes = result.estimate.total_bytes
    try:
        with transaction.atomic():
            if not request.another_replica and Deployment.objects.filter(
                    name=request.name.strip(), state__in=states.ACTIVE + (S.PLANNED,)).exists():
                raise DeploymentConflict(f"A deployment already serves {request.name!r}; stop it or switch to the new one.")
            deployment = Deployment.objects.create(
                name=request.name.strip(), task=request.task, engine=request.engine, runtime=request.runtime,
                model_path=str(memory.allowed_model_path(request.model_path)), config=config, profile=request.profile,
                node=request.node,
                gpu_uuids=[a.uuid for a in (request.accelerator, *request.shards) if a is not None], owner=request.owner,
                priority=request.priority, cores=request.cores, memory_reserved_bytes=reserve_bytes,
                estimate=result.estimate.as_dict(), created_by=actor.user)
            _place(actor, deployment, accelerators_of(deployment), result.device, waits_for=request.waits_for)
            audit.record(actor, "deployment.create", deployment, scope=request.owner, details={
                "name": deployment.name, "engine": deployment.engine, "runtime": deployment.runtime,
                "node": request.node.name, "reserved_bytes": reserve_bytes})
    except IntegrityError as exc:
        raise DeploymentConflict("Another deployment took the same port at the same moment; try again.") from exc
    return deployment


def accelerators_of(deployment: Deployment) -> list[Accelerator]:
    """The deployment's accelerators in its own order (the first is the one its estimate is for)."""
    if not deployment.gpu_uuids:
        return []
    found = {a.uuid: a for a in Accelerator.objects.filter(uuid__in=deployment.gpu_uuids)}
    return [found[uuid] for uuid in deployment.gpu_uuids if uuid in found]


def _place(actor: Actor, deployment: Deployment, accelerators: list[Accelerator], device: str,
           waits_for: tuple[str, ...] = ()) -> Replica:
    """A new replica of ``deployment``: a port, its memory on the node (a shard on each of its
    accelerators) and its share of the owner's contracts, all claimed in the caller's transaction;
    the agent starts it once that commits."""
    reserve_bytes = deployment.memory_reserved_bytes
    replica = Replica.objects.create(deployment=deployment, node=deployment.node, port=ports.allocate(deployment.node),
                                     memory_reserved_bytes=reserve_bytes, state=S.PLANNED, waits_for=list(waits_for))
    holder = holder_of(replica)
    memory.reserve_shards(deployment.node, holder, reserve_bytes, accelerators,
                          description=f"{deployment.name} ({deployment.engine})")
    if deployment.owner is not None:
        gpus = len(accelerators) if device != "cpu" else 0
        contracts.reserve(deployment.owner, holder, actor=actor,
                          gpu_memory_gib=round(reserve_bytes * gpus / GIB, 2), gpus=gpus, cores=deployment.cores or 0)
    transaction.on_commit(lambda: dispatch("start", replica))
    return replica


def start(actor: Actor, deployment: Deployment) -> Deployment:
    """Start a stopped or failed deployment again, with a fresh replica (and a fresh fit check)."""
    require(actor, "use", deployment)
    if deployment.state not in (S.STOPPED, S.FAILED):
        raise DeploymentConflict(f"{deployment.name} is {deployment.state}: only a stopped or failed deployment starts.")
    accelerators = accelerators_of(deployment)
    with transaction.atomic():
        if Deployment.objects.filter(name=deployment.name, state__in=states.ACTIVE + (S.PLANNED,)) \
                .exclude(pk=deployment.pk).exists():
            raise DeploymentConflict(f"Another deployment serves {deployment.name!r} now; stop it first.")
        _place(actor, deployment, accelerators, "gpu" if accelerators else "cpu")
        audit.record(actor, "deployment.start", deployment, scope=deployment.owner, details={"name": deployment.name})
    return deployment


def holder_of(replica: Replica) -> str:
    return f"replica:{replica.public_id}"


def dispatch(operation: str, replica: Replica) -> None:
    """Hand an engine operation to the agent of the replica's node."""
    from serving import tasks

    task = {"start": tasks.start_replica, "stop": tasks.stop_replica, "sleep": tasks.sleep_replica,
            "wake": tasks.wake_replica}[operation]
    task.apply_async(args=[str(replica.public_id)], queue=f"node.{replica.node.name}")


def stop(actor: Actor, deployment: Deployment) -> Deployment:
    """Stop every replica; a queued one is cancelled at once. Never waits on the start-up gate."""
    require(actor, "use", deployment)
    with transaction.atomic():
        audit.record(actor, "deployment.stop", deployment, scope=deployment.owner, details={"name": deployment.name})
        for replica in deployment.replica_set.select_for_update().filter(state__in=states.ACTIVE + (S.PLANNED,)):
            if replica.state in (S.PLANNED, S.QUEUED):
                states.move(replica, S.STOPPED, "cancelled before it started")
                release(replica)
            else:
                transaction.on_commit(lambda r=replica: dispatch("stop", r))
    deployment.refresh_from_db()
    return deployment


def sleep(actor: Actor, deployment: Deployment) -> Deployment:
    """Put a ready deployment to sleep: its device memory is freed at once (never delayed by the gate)."""
    require(actor, "use", deployment)
    if deployment.engine != Deployment.Engine.VLLM:
        raise SleepNotSupported(f"{deployment.get_engine_display()} cannot sleep: stop {deployment.name} to free "
                                "its memory (it loads again when started).")
    replicas = list(deployment.replica_set.filter(state=S.READY))
    if not replicas:
        raise DeploymentConflict(f"{deployment.name} is {deployment.state}: only a ready deployment sleeps.")
    audit.record(actor, "deployment.sleep", deployment, scope=deployment.owner, details={"name": deployment.name})
    for replica in replicas:
        dispatch("sleep", replica)
    return deployment


def wake(actor: Actor, deployment: Deployment) -> Deployment:
    """Wake a sleeping deployment once the memory it takes back is free again."""
    require(actor, "use", deployment)
    replicas = list(deployment.replica_set.filter(state=S.SLEEPING))
    if not replicas:
        raise DeploymentConflict(f"{deployment.name} is {deployment.state}: only a sleeping deployment wakes.")
    audit.record(actor, "deployment.wake", deployment, scope=deployment.owner, details={"name": deployment.name})
    for replica in replicas:
        dispatch("wake", replica)
    return deployment


def remove(actor: Actor, deployment: Deployment) -> None:
    require(actor, "use", deployment)
    if deployment.state not in (S.STOPPED, S.FAILED, S.PLANNED):
        raise DeploymentConflict(f"{deployment.name} is {deployment.state}: stop it before removing it.")
    with transaction.atomic():
        audit.record(actor, "deployment.remove", deployment, scope=deployment.owner, details={"name": deployment.name})
        for replica in deployment.replica_set.all():
            release(replica)
        deployment.delete()


def release(replica: Replica) -> None:
    """Give back what the replica held: its memory on the node and its share of the contracts."""
    holder = holder_of(replica)
    memory.release_reservation(holder)
    contracts.release(holder)


def visible_deployments(caller):
    """Deployments whose owner scope the caller may see; ownerless ones are for administrators.
    The console and the API list and look up deployments through this one narrowing."""
    queryset = Deployment.objects.select_related("node", "owner").prefetch_related("replica_set__node")
    if access.is_superuser(caller):
        return queryset
    return access.visible_to(caller, queryset.filter(owner__isnull=False), "owner")


def require(actor: Actor, action: str, deployment: Deployment) -> None:
    if deployment.owner is not None:
        access.require(actor, action, deployment.owner)
    elif not access.is_superuser(actor):
        raise NotFound("No such deployment, or it is outside your reach.")
