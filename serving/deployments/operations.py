"""Switch A → B and reconfigure, with rollback.

A switch first checks B as a deploy would — validated, estimated and fitted, counting what A holds as
free — and is refused at once, recording nothing, when B is invalid or would not fit even in A's
place. Only then, on the control worker, does it free A's memory for B (stopping A — llama.cpp cannot
sleep), deploy B under A's model name, and wait for B to be ready (time B waits at the start-up gate
is not counted against it). If B cannot be deployed or fails to come up, every step taken is undone
in reverse order: B is stopped and removed (why it failed is kept in the step), A started again and
waited for. An undo step that fails leaves the operation ``rollback_incomplete`` naming the step,
so a person knows exactly what to look at. Every step is a line of the Operation row.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from django.conf import settings
from django.db import close_old_connections, transaction
from django.utils import timezone

from berth.errors import BerthError
from serving import queues
from serving.deployments import service
from serving.deployments.request import DeployRequest
from serving.errors import DeploymentConflict, InvalidDeployment
from serving.models import Deployment, DeploymentState as S, Operation
from serving.models.states import STARTING_UP, TERMINAL, UP
from tenancy import audit
from tenancy.audit import Actor

log = logging.getLogger(__name__)
STOP_TIMEOUT_SECONDS = 120


def switch(actor: Actor, source: Deployment, request: DeployRequest,
           kind: str = Operation.Kind.SWITCH) -> Operation:
    """Record a switch of ``source`` to what ``request`` describes (under ``source``'s name) and hand
    it to the control worker. Refused at once, changing nothing, when ``source`` is not serving or
    when B is invalid or would not fit even with A's memory given back (``service.fit_in_place_of``):
    A is only stopped for a B that can take its place."""
    service.require(actor, "use", source)
    if source.state not in UP:
        raise DeploymentConflict(f"{source.name} is {source.state}: only a serving deployment is switched.")
    if Operation.objects.filter(source=source, state=Operation.State.RUNNING).exists():
        raise DeploymentConflict(f"{source.name} is already being switched.")
    request = dataclasses.replace(request, name=source.name)
    service.fit_in_place_of(actor, request, source)
    description = request.as_json()
    with transaction.atomic():
        operation = Operation.objects.create(kind=kind, source=source, request=description, requested_by=actor.user)
        audit.record(actor, f"deployment.{kind}", source, scope=source.owner, details={"to": description})
        transaction.on_commit(lambda: _enqueue(operation))
    return operation


def reconfigure(actor: Actor, source: Deployment, config_patch: dict) -> Operation:
    """Change one deployment's engine configuration in place, with the same rollback as a switch."""
    request = DeployRequest.of(source, config={**source.config, **config_patch})
    return switch(actor, source, request, kind=Operation.Kind.RECONFIGURE)


def deploy_after(actor: Actor, request: DeployRequest, actions: list[dict]) -> Operation:
    """Deploy once the chosen actions (``{"kind": "sleep"|"stop", "target": name}``, as the fit's plans
    name them) have freed memory; if the deploy is still refused, the actions are undone."""
    problems = [a for a in actions if a.get("kind") not in ("sleep", "stop") or not a.get("target")]
    if not actions or problems:
        raise InvalidDeployment("Actions are a list of {kind: sleep|stop, target: deployment name}.",
                                details={"actions": problems or "empty"})
    targets = []
    for action in actions:
        target = Deployment.objects.filter(name=action["target"], node=request.node,
                                           state__in=UP).first()
        if target is None:
            raise InvalidDeployment(f"No running deployment {action['target']!r} on {request.node.name}.")
        service.require(actor, "use", target)
        targets.append(target)
    description = request.as_json() | {"actions": actions}
    with transaction.atomic():
        operation = Operation.objects.create(kind=Operation.Kind.DEPLOY, request=description,
                                             requested_by=actor.user)
        audit.record(actor, "deployment.deploy_after", operation, scope=request.owner, details=description)
        transaction.on_commit(lambda: _enqueue(operation))
    return operation


def _enqueue(operation: Operation) -> None:
    queues.to_control(queues.RUN_OPERATION, str(operation.public_id))


@dataclasses.dataclass
class _Run:
    operation: Operation
    actor: Actor

    def step(self, name: str, status: str, message: str = "") -> None:
        self.operation.steps = [*self.operation.steps, {"step": name, "status": status, "message": message,
                                                        "at": timezone.now().isoformat()}]
        self.operation.save(update_fields=["steps"])

    def finish(self, state: str, message: str) -> Operation:
        self.operation.state = state
        self.operation.message = message
        self.operation.finished_at = timezone.now()
        self.operation.save(update_fields=["state", "message", "finished_at"])
        return self.operation


def run(operation_id: str) -> Operation:
    """Carry an operation out (the control worker's task calls this)."""
    operation = Operation.objects.select_related("source__node").get(public_id=operation_id)
    run = _Run(operation, Actor(user=operation.requested_by) if operation.requested_by else Actor(system="switch"))
    if operation.kind == Operation.Kind.DEPLOY:
        return _run_deploy_after(run)
    source = operation.source
    request = dataclasses.replace(DeployRequest.from_json(operation.request), name=source.name)

    # 1. Free A's memory: llama.cpp cannot sleep, so A stops (vLLM's sleep frees too little to count on).
    try:
        service.stop(run.actor, source)
        _wait(source, (S.STOPPED,), STOP_TIMEOUT_SECONDS)
        run.step("stop A", "done", f"{source.name} stopped; its memory counts for B")
    except BerthError as error:
        run.step("stop A", "failed", error.message)
        return run.finish(Operation.State.ROLLED_BACK, f"A could not be stopped, nothing changed: {error.message}")

    # 2. Deploy B under A's name and wait for it.
    target = None
    try:
        target = service.deploy(run.actor, request)
        operation.target = target
        operation.save(update_fields=["target"])
        run.step("deploy B", "done", f"B placed on {request.node.name}")
        _wait_ready(target)
        run.step("B ready", "done", f"{target.name} is served by B")
        return run.finish(Operation.State.SUCCEEDED, f"{source.name} now runs on B; A is stopped and kept.")
    except BerthError as error:
        run.step("B ready" if target else "deploy B", "failed", error.message)
        failure = error.message

    # 3. Undo, in reverse order: stop B and remove it (a failed switch leaves only A; why B failed
    # is kept in this step's message), start A again.
    undo_failed = []
    if target is not None:
        try:
            target.refresh_from_db()
            if target.state not in TERMINAL:
                service.stop(run.actor, target)
                _wait(target, TERMINAL, STOP_TIMEOUT_SECONDS)
            evidence = _evidence(target)
            service.remove(run.actor, target)
            operation.target = None  # the row is gone (the foreign key is set to null)
            run.step("undo: stop B", "done", f"B stopped and removed.{evidence}")
        except BerthError as error:
            run.step("undo: stop B", "failed", error.message)
            undo_failed.append("stop B")
    try:
        service.start(run.actor, Deployment.objects.get(pk=source.pk))
        _wait_ready(source)
        run.step("undo: start A", "done", f"{source.name} is served by A again")
    except BerthError as error:
        run.step("undo: start A", "failed", error.message)
        undo_failed.append("start A")
    if undo_failed:
        return run.finish(Operation.State.ROLLBACK_INCOMPLETE,
                          f"B failed ({failure}) and the rollback did not finish: {', '.join(undo_failed)} failed.")
    return run.finish(Operation.State.ROLLED_BACK, f"B failed ({failure}); A serves {source.name} again.")


def _run_deploy_after(run: _Run) -> Operation:
    description = run.operation.request
    request = DeployRequest.from_json(description)
    done = []  # (action, deployment), to undo in reverse
    failure = ""
    for action in description["actions"]:
        target = Deployment.objects.filter(name=action["target"], node=request.node,
                                           state__in=UP).first()
        try:
            if target is None:
                raise BerthError(f"{action['target']} no longer runs there.", code="action_target_gone")
            if action["kind"] == "sleep":
                service.sleep(run.actor, target)
                _wait(target, (S.SLEEPING,), STOP_TIMEOUT_SECONDS)
            else:
                service.stop(run.actor, target)
                _wait(target, (S.STOPPED,), STOP_TIMEOUT_SECONDS)
            run.step(f"{action['kind']} {action['target']}", "done")
            done.append((action, target))
        except BerthError as error:
            run.step(f"{action['kind']} {action['target']}", "failed", error.message)
            failure = error.message
            break
    if not failure:
        try:
            deployment = service.deploy(run.actor, request)
            run.operation.target = deployment
            run.operation.save(update_fields=["target"])
            run.step("deploy", "done", f"{deployment.name} placed on {request.node.name}")
            return run.finish(Operation.State.SUCCEEDED, f"{deployment.name} is deploying.")
        except BerthError as error:
            run.step("deploy", "failed", error.message)
            failure = error.message
    undo_failed = []
    for action, target in reversed(done):
        name = f"undo: {'wake' if action['kind'] == 'sleep' else 'start'} {target.name}"
        try:
            target = Deployment.objects.get(pk=target.pk)
            if action["kind"] == "sleep":
                service.wake(run.actor, target)
            else:
                service.start(run.actor, target)
            _wait_ready(target)
            run.step(name, "done")
        except BerthError as error:
            run.step(name, "failed", error.message)
            undo_failed.append(name.removeprefix("undo: "))
    if undo_failed:
        return run.finish(Operation.State.ROLLBACK_INCOMPLETE,
                          f"The deploy failed ({failure}) and undoing did not finish: {', '.join(undo_failed)}.")
    return run.finish(Operation.State.ROLLED_BACK, f"The deploy failed ({failure}); every action was undone.")


class _Timeout(BerthError):
    status = 504
    code = "operation_timeout"


def _evidence(deployment: Deployment) -> str:
    """Why ``deployment`` ended, as its events tell it (the last log lines of its engine, if any),
    written into a step before its rows are removed."""
    ended = deployment.events.filter(to_state__in=TERMINAL).order_by("-at", "-pk").first()
    if ended is None:
        return ""
    tail = next((e.log_tail for e in deployment.events.exclude(log_tail="").order_by("-at", "-pk")[:1]), "")
    return f" It was {ended.to_state}: {ended.message}" + (f"\nLast log lines:\n{tail[-4000:]}" if tail else "")


def _wait_ready(deployment: Deployment) -> None:
    """Until ``deployment`` is ready. Its start-up deadline starts when it leaves the start-up gate's
    queue: time spent queued behind other engines' starts is not its own (the queue is bounded on its
    own: a replica queued longer than ``SERVING_QUEUE_TIMEOUT_SECONDS`` fails, and this fails with it)."""
    startup = settings.SERVING_STARTUP_TIMEOUT_SECONDS + 60
    _wait(deployment, (S.QUEUED, *STARTING_UP, S.READY), startup)  # the node's agent takes it up
    _wait(deployment, (*STARTING_UP, S.READY), settings.SERVING_QUEUE_TIMEOUT_SECONDS + 60)  # its turn comes
    _wait(deployment, (S.READY,), startup)


def _wait(deployment: Deployment, states: tuple[str, ...], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        close_old_connections()
        deployment.refresh_from_db(fields=["state", "state_detail"])
        if deployment.state in states:
            return
        if deployment.state == S.FAILED:
            raise BerthError(f"{deployment.name} failed: {deployment.state_detail}", code="deployment_failed")
        if time.monotonic() > deadline:
            raise _Timeout(f"{deployment.name} is still {deployment.state} after {timeout:.0f}s.")
        time.sleep(0.2)
