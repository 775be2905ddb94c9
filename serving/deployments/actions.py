"""Which verbs a deployment takes in the state it is in now, and why not: one rule, read by the
console (the buttons it offers) and by a verb posted anyway (refused with the reason, nothing
changed). The service's verbs refuse by it too, so the API and the console say the same.

A deployment speaks for its replicas (``states.summarise``), so its state says what its replicas
can do: the rule follows the state sets of ``serving.models.states`` and the replicas' state
machine (``states.ALLOWED``).
"""

from __future__ import annotations

from berth.errors import BerthError
from serving.deployments.states import ALLOWED
from serving.errors import DeploymentConflict, SleepNotSupported
from serving.models import Deployment, DeploymentState as S
from serving.models.states import BEFORE_START, TERMINAL, UP

VERBS = ("start", "stop", "sleep", "wake", "reconfigure", "remove")


def can_sleep(deployment: Deployment) -> bool:
    """Whether its engine can sleep and wake (vLLM started with sleep mode, its default)."""
    sleep_mode = (deployment.config or {}).get("enable_sleep_mode", True)
    return deployment.engine == Deployment.Engine.VLLM and bool(sleep_mode)


def _stops(state: str) -> bool:
    """A stop moves an engine that runs (or may) to stopping, and cancels one not started yet."""
    moves = ALLOWED.get(state, ())
    return S.STOPPING in moves or (state in BEFORE_START and S.STOPPED in moves)


def refusal(deployment: Deployment, verb: str) -> BerthError | None:
    """Why ``verb`` cannot be done to ``deployment`` now (an error with its code), or None if it can."""
    name, state = deployment.name, deployment.state
    if verb == "start":
        if state in TERMINAL:
            return None
        return DeploymentConflict(f"{name} is {state}: only a stopped or failed deployment starts.",
                                  details={"state": state, "verb": verb})
    if verb == "stop":
        if _stops(state):
            return None
        said = f"{name} is stopping already." if state == S.STOPPING else f"{name} is {state}: nothing runs to stop."
        return DeploymentConflict(said, details={"state": state, "verb": verb})
    if verb == "sleep":
        if deployment.engine != Deployment.Engine.VLLM:
            return SleepNotSupported(f"{deployment.get_engine_display()} cannot sleep: stop {name} to free its "
                                     "memory (it loads again when started).", details={"engine": deployment.engine})
        if not can_sleep(deployment):
            return SleepNotSupported(f"{name} was started without sleep mode: stop it to free its memory, or "
                                     "reconfigure it with enable_sleep_mode.", details={"engine": deployment.engine})
        if S.SLEEPING in ALLOWED.get(state, ()):
            return None
        return DeploymentConflict(f"{name} is {state}: only a ready deployment sleeps.",
                                  details={"state": state, "verb": verb})
    if verb == "wake":
        if state == S.SLEEPING:
            return None
        return DeploymentConflict(f"{name} is {state}: only a sleeping deployment wakes.",
                                  details={"state": state, "verb": verb})
    if verb == "reconfigure":
        if state in UP:
            return None
        return DeploymentConflict(f"{name} is {state}: only a ready or sleeping deployment is reconfigured.",
                                  details={"state": state, "verb": verb})
    if verb == "remove":
        if state in TERMINAL + (S.PLANNED,):  # nothing runs, nor will: its record may go
            return None
        return DeploymentConflict(f"{name} is {state}: stop it before removing it.",
                                  details={"state": state, "verb": verb})
    raise ValueError(f"unknown verb {verb!r}")


def possible(deployment: Deployment) -> tuple[str, ...]:
    """The verbs ``deployment`` takes now, in ``VERBS`` order."""
    return tuple(verb for verb in VERBS if refusal(deployment, verb) is None)


def require_possible(deployment: Deployment, verb: str) -> None:
    error = refusal(deployment, verb)
    if error is not None:
        raise error
