"""Error codes of the serving app."""

from berth.errors import BerthError, InvalidInput


class UnknownEngine(InvalidInput):
    code = "unknown_engine"


class EngineBuildFailed(BerthError):
    status = 500
    code = "engine_build_failed"
