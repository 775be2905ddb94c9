"""The deployment verbs: preview, deploy, start, stop, sleep, wake, remove. The API, the console,
commands and the control loop call these; the node's agent carries out what touches engines
(``serving.node``), through the jobs its node is given (``serving.queues.to_node``)."""

from __future__ import annotations

import time
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from berth.errors import NotFound
from scheduler import memory
from scheduler.errors import InsufficientMemory, NotPlaceable
from scheduler.models import Accelerator, Node
from scheduler.policy.fit import Resident, plan_fit
from serving import queues
from serving.deployments import actions, gate, ports, states, stopping
from serving.deployments.request import DeployRequest
from serving.deployments.states import accelerators_of, holder_of, release
from serving.engines.registry import engine_for, estimation_config
from serving.errors import DeploymentConflict, InvalidDeployment, WakeRefused
from serving.models import Deployment, DeploymentEvent, DeploymentState as S, Replica
from serving.models.states import BEFORE_START, HOLDING, RESIDENT, SERVING
from tenancy import access, audit
from tenancy.audit import Actor
from tenancy.services import contracts

__all__ = ["DeployRequest", "deploy", "fit_in_place_of", "preview", "remove", "sleep", "start", "stop", "wake"]

GIB = 2**30
PLACEMENT = "placement"  # the system actor of the placement pass (serving.control.placement)


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


def residents(node: Node, *, leaving: Deployment | None = None) -> list:
    """The node's running deployments as the fit planner sees them (but ``leaving``, about to stop)."""
    running = Deployment.objects.filter(node=node, state__in=RESIDENT)
    if leaving is not None:
        running = running.exclude(pk=leaving.pk)
    return [Resident(name=d.name, memory_bytes=d.memory_reserved_bytes or 0, priority=d.priority,
                     can_sleep=d.engine == Deployment.Engine.VLLM, sleeping=d.state == S.SLEEPING)
            for d in running]


def _estimate(request: DeployRequest, config: dict[str, Any], residents=(), freeing=()) -> memory.EstimateResult:
    gpus = len(request.accelerators)
    return memory.estimate_and_fit(request.model_path, request.engine, estimation_config(request.engine, config, gpus),
                                   node=request.node, accelerator=request.accelerator, residents=residents,
                                   priority=request.priority, draft_path=config.get("draft_model"), freeing=freeing)


def _refuse_unless_fits(request: DeployRequest, result: memory.EstimateResult, fit=None) -> None:
    """The refusal of a deploy that does not fit (409): the fit, with its plans, and the estimate."""
    fit = fit or result.fit
    if fit is not None and not fit.fits:
        raise InsufficientMemory(f"{request.name} does not fit on {request.node.name}: "
                                 f"{result.estimate.total_bytes / GIB:,.2f} GiB needed.",
                                 details={"fit": fit.as_dict(), "estimate": result.estimate.as_dict()})


def fit_in_place_of(actor: Actor, request: DeployRequest, source: Deployment) -> memory.EstimateResult:
    """Would ``request`` (B) deploy once ``source`` (A) has stopped? Validated, estimated and fitted
    as ``deploy`` would (refused with the same errors: 400 when B is invalid, 409 with the fit and its
    plans when it does not fit), with what A holds counted as free: its replicas' reservations on
    B's node, a shard on each of its accelerators. The plans leave A out (it is going anyway).
    Changes nothing: a switch asks this before it stops A, so an impossible B never costs A its engine."""
    _require_owner(actor, request)
    config = _validate(request)
    freeing = [holder_of(replica) for replica in source.replica_set.filter(state__in=HOLDING)]
    result = _estimate(request, config, residents(request.node, leaving=source), freeing=freeing)
    _refuse_unless_fits(request, result)
    if request.node.state != Node.State.READY:
        raise NotPlaceable(f"Node {request.node.name} is {request.node.get_state_display().lower()}: "
                           "no new work goes there.", details={"state": request.node.state})
    for accelerator in request.accelerators:
        # The estimate fitted the first accelerator (or the node's RAM); each takes a shard of the same size.
        if not accelerator.placeable:
            raise NotPlaceable(f"{accelerator} cannot take work: {accelerator.unplaceable_reason}",
                               details={"reason": accelerator.unplaceable_reason})
        budget = memory.budget_for(request.node, accelerator, freeing=freeing)
        if budget is not None:
            _refuse_unless_fits(request, result, plan_fit(budget, result.estimate.total_bytes))
    return result


def deploy(actor: Actor, request: DeployRequest) -> Deployment:
    """Validate → estimate → fit under the memory lock → allocate a port → record → start (by the
    node's agent, once this commits). Refused with fresh plans, changing nothing, when it does not fit."""
    _require_owner(actor, request)
    config = _validate(request)
    result = _estimate(request, config)
    _refuse_unless_fits(request, result)
    reserve_bytes = result.estimate.total_bytes
    try:
        with transaction.atomic():
            if not request.another_replica and Deployment.objects.filter(
                    name=request.name.strip(), state__in=SERVING).exists():
                raise DeploymentConflict(f"A deployment already serves {request.name!r}; stop it or switch to the new one.")
            deployment = Deployment.objects.create(
                name=request.name.strip(), task=request.task, engine=request.engine, runtime=request.runtime,
                model_path=str(memory.allowed_model_path(request.model_path)), config=config, profile=request.profile,
                node=request.node,
                gpu_uuids=[a.uuid for a in request.accelerators], owner=request.owner,
                priority=request.priority, cores=request.cores, memory_reserved_bytes=reserve_bytes,
                estimate=result.estimate.as_dict(), node_path=request.node_path, transfers=list(request.transfers),
                created_by=actor.user)
            _place(actor, deployment, accelerators_of(deployment), result.device, waits_for=request.waits_for)
            _changed(actor)
            audit.record(actor, "deployment.create", deployment, scope=request.owner, details={
                "name": deployment.name, "engine": deployment.engine, "runtime": deployment.runtime,
                "node": request.node.name, "reserved_bytes": reserve_bytes})
    except IntegrityError as exc:
        raise DeploymentConflict("Another deployment took the same port at the same moment; try again.") from exc
    return deployment


def _changed(actor: Actor) -> None:
    """What should run has changed: a reconcile pass within a second places around it (catalog
    models may now fit, or need room). Not for the placement pass's own launches and evictions."""
    if actor.system != PLACEMENT:
        queues.reconcile_soon()


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
    transaction.on_commit(lambda: queues.to_node("start", replica))
    return replica


def start(actor: Actor, deployment: Deployment) -> Deployment:
    """Start a stopped or failed deployment again, with a fresh replica (and a fresh fit check)."""
    require(actor, "use", deployment)
    actions.require_possible(deployment, "start")
    accelerators = accelerators_of(deployment)
    with transaction.atomic():
        if Deployment.objects.filter(name=deployment.name, state__in=SERVING) \
                .exclude(pk=deployment.pk).exists():
            raise DeploymentConflict(f"Another deployment serves {deployment.name!r} now; stop it first.")
        _place(actor, deployment, accelerators, "gpu" if accelerators else "cpu")
        states.summarise(deployment)  # it speaks for its fresh replica from now on (planned)
        _changed(actor)
        audit.record(actor, "deployment.start", deployment, scope=deployment.owner, details={"name": deployment.name})
    return deployment


def stop(actor: Actor, deployment: Deployment) -> Deployment:
    """Stop every replica; a queued one is cancelled at once. Never waits on the start-up gate."""
    require(actor, "use", deployment)
    with transaction.atomic():
        _changed(actor)
        audit.record(actor, "deployment.stop", deployment, scope=deployment.owner, details={"name": deployment.name})
        for replica in deployment.replica_set.select_for_update().filter(state__in=SERVING):
            if replica.state in BEFORE_START:
                states.move(replica, S.STOPPED, "cancelled before it started")
            else:
                transaction.on_commit(lambda r=replica: stopping.begin(r))
    deployment.refresh_from_db()
    return deployment


def sleep(actor: Actor, deployment: Deployment) -> Deployment:
    """Put a ready deployment to sleep: its device memory is freed at once (never delayed by the gate)."""
    require(actor, "use", deployment)
    actions.require_possible(deployment, "sleep")
    replicas = list(deployment.replica_set.filter(state=S.READY))
    if not replicas:
        raise DeploymentConflict(f"{deployment.name} is {deployment.state}: only a ready deployment sleeps.")
    audit.record(actor, "deployment.sleep", deployment, scope=deployment.owner, details={"name": deployment.name})
    for replica in replicas:
        queues.to_node("sleep", replica)
    return deployment


WAKE_POLL_SECONDS = 0.1  # how often a wake request looks at its replicas


def wake(actor: Actor, deployment: Deployment, *, wait_seconds: float | None = None) -> Deployment:
    """Wake a sleeping deployment. Its agent claims the memory back, then takes a start-up slot: a
    wake waits its turn behind engines starting, first come first served with queued starts
    (``gate``). Waits up to ``wait_seconds`` (``SERVING_WAKE_WAIT_SECONDS``) for it to be awake and
    returns it as it is then: still sleeping means the wake goes on in the background, in line
    (``gate.wake_position``), for at most ``SERVING_WAKE_TIMEOUT_SECONDS`` in all. Refused with the
    agent's reason (``WakeRefused``) when the wake ended with it still asleep: its memory not free."""
    require(actor, "use", deployment)
    actions.require_possible(deployment, "wake")
    replicas = list(deployment.replica_set.filter(state=S.SLEEPING))
    if not replicas:
        raise DeploymentConflict(f"{deployment.name} is {deployment.state}: only a sleeping deployment wakes.")
    audit.record(actor, "deployment.wake", deployment, scope=deployment.owner, details={"name": deployment.name})
    asked = timezone.now()
    for replica in replicas:
        gate.ask_wake(replica)  # in line from now (a wake asked for already keeps its place)
        queues.to_node("wake", replica)
    wait = settings.SERVING_WAKE_WAIT_SECONDS if wait_seconds is None else wait_seconds
    deadline = time.monotonic() + wait
    rows = Replica.objects.filter(pk__in=[r.pk for r in replicas])
    while True:  # the agent clears ``wake_requested_at`` when the wake ends, awake or not
        if not rows.filter(state=S.SLEEPING, wake_requested_at__isnull=False).exists():
            break
        if time.monotonic() >= deadline:
            deployment.refresh_from_db()
            return deployment
        time.sleep(WAKE_POLL_SECONDS)
    deployment.refresh_from_db()
    still_asleep = rows.filter(state=S.SLEEPING)
    if still_asleep.exists():
        why = DeploymentEvent.objects.filter(replica__in=still_asleep, at__gte=asked, to_state=S.SLEEPING,
                                             message__startswith="wake ").order_by("-at", "-id").first()
        reason = why.message.rstrip(".") if why else "its wake did not finish"
        raise WakeRefused(f"{deployment.name} stays asleep: {reason}.")
    return deployment


def remove(actor: Actor, deployment: Deployment) -> None:
    require(actor, "use", deployment)
    actions.require_possible(deployment, "remove")
    with transaction.atomic():
        _changed(actor)
        audit.record(actor, "deployment.remove", deployment, scope=deployment.owner, details={"name": deployment.name})
        for replica in deployment.replica_set.all():
            release(replica)
        deployment.delete()


def visible_deployments(caller):
    """Deployments whose owner scope the caller may see; ownerless ones are for administrators.
    The console and the API list and look up deployments through this one narrowing."""
    queryset = Deployment.objects.select_related("node", "owner").prefetch_related("replica_set__node")
    return access.visible_owned(caller, queryset)


def require(actor: Actor, action: str, deployment: Deployment) -> None:
    if deployment.owner is not None:
        access.require(actor, action, deployment.owner)
    elif not access.is_superuser(actor):
        raise NotFound("No such deployment, or it is outside your reach.")
