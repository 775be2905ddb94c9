"""Error codes of the serving app."""

from berth.errors import BerthError, Conflict, InvalidInput


class UnknownEngine(InvalidInput):
    code = "unknown_engine"


class EngineBuildFailed(BerthError):
    status = 500
    code = "engine_build_failed"


class NoFreePort(BerthError):
    status = 503
    code = "no_free_port"


class DeploymentConflict(BerthError):
    status = 409
    code = "deployment_conflict"


class InvalidDeployment(InvalidInput):
    code = "invalid_deployment"


# Engines and runtimes


class InvalidEngineConfig(InvalidInput):
    """``details["problems"]`` lists every problem found (field, message), not just the first."""

    code = "invalid_engine_config"


class ModelNotAllowed(InvalidInput):
    """The model reference is not a usable file under an allowed root (``details["reason"]`` says why)."""

    code = "model_not_allowed"


class ImageMissing(BerthError):
    """The engine's image is not on the node and pulling is not allowed there."""

    status = 409
    code = "image_missing"


class EngineStartFailed(BerthError):
    status = 500
    code = "engine_start_failed"


class EngineAlreadyRunning(Conflict):
    code = "engine_already_running"


class EngineRequestFailed(BerthError):
    """A control call to a running engine (sleep, wake) failed or was refused by the engine."""

    status = 502
    code = "engine_request_failed"


class SleepNotSupported(Conflict):
    code = "sleep_not_supported"


class WakeRefused(Conflict):
    """Waking would take back memory that is not free now (or whose freeness is unknown)."""

    code = "insufficient_memory_to_wake"


class MemoryFractionRefused(InvalidInput):
    """vLLM's --gpu-memory-utilization cannot be derived from the reservation (missing or too large)."""

    code = "gpu_memory_fraction_refused"
