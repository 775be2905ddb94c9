"""Error codes of the catalog and mirror."""

from berth.errors import BerthError, Conflict, InvalidInput, NotFound


class InvalidModelEntry(InvalidInput):
    """``details["problems"]`` lists every problem found as {field, message}."""

    code = "invalid_model_entry"


class HubUnreachable(BerthError):
    status = 503
    code = "hub_unreachable"


class HubRefused(BerthError):
    """The hub answered a 4xx Berth has no better word for (``details["status"]``)."""

    status = 502
    code = "hub_refused"


class RepositoryNotFound(NotFound):
    code = "repository_not_found"


class FetchRefused(BerthError):
    """Refused before anything was downloaded; ``details["reason"]`` is a stable word:
    gated, disk, pickle_only, remote_code, no_files."""

    status = 409
    code = "fetch_refused"


class NoMatchingFiles(InvalidInput):
    code = "no_matching_files"


class FileInUse(Conflict):
    code = "model_file_in_use"


class ImportFailed(InvalidInput):
    code = "import_failed"


class NotServable(BerthError):
    status = 409
    code = "not_servable"


class ScalingRefused(Conflict):
    """A minimum placement cannot meet; ``details`` has what runs, how many more fit and where."""

    code = "scaling_refused"


class NothingToRestart(Conflict):
    """A rolling restart of a model with no replica running or starting."""

    code = "nothing_to_restart"
