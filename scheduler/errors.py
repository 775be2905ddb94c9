from berth.errors import Conflict, InvalidInput, NotFound, PermissionDenied


class InvalidNodeReport(InvalidInput):
    code = "invalid_node_report"


class InvalidNodeState(Conflict):
    """Cordon, uncordon or drain asked of a node whose state does not allow it."""

    code = "invalid_node_state"


class InvalidNodeLabels(InvalidInput):
    """Node labels that are not Kubernetes-style labels (``details["problems"]`` says which)."""

    code = "invalid_node_labels"


class FleetFilesForStaff(PermissionDenied):
    """Reading a model directory's files by path (the estimate of a path) is staff's: a file there
    may be behind another tenant's catalog entry."""

    code = "fleet_files_for_staff"


class InvalidEstimateRequest(InvalidInput):
    code = "invalid_estimate_request"


class UnreadableModel(InvalidInput):
    """The model's files exist but their header or config cannot be read as a model."""

    code = "unreadable_model"


class ModelNotFound(NotFound):
    code = "model_not_found"


class ModelOutsideRoots(InvalidInput):
    """A path outside the directories Berth may read models from (``BERTH_MODEL_ROOTS``)."""

    code = "model_outside_roots"


class ModelQuarantined(InvalidInput):
    """A file the mirror set aside (it failed verification): never estimated, never deployed."""

    code = "model_quarantined"


class InsufficientMemory(Conflict):
    """A fit check under the node's lock found too little free memory; details carry the fit and plans."""

    code = "insufficient_memory"


class NotPlaceable(Conflict):
    """The accelerator (or node) cannot take work: unhealthy, MIG card with nothing carved, not ready."""

    code = "not_placeable"


class InvalidCalibration(InvalidInput):
    code = "invalid_calibration"


class ModelNotParked(NotFound):
    """A retry asked for a model that has no failure memory, or is not parked."""

    code = "model_not_parked"
