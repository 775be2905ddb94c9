from berth.errors import Conflict, InvalidInput, NotAuthenticated, NotFound, PermissionDenied


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


class NodeNotFound(NotFound):
    code = "node_not_found"


# --- node trust: enrolment and the node's own credential (scheduler.enrolment) ---------------------

class NodeTrustForStaff(PermissionDenied):
    """Enrolment tokens, node credentials and revocations are the fleet operators' (staff's)."""

    code = "node_trust_for_staff"


class InvalidEnrolmentRequest(InvalidInput):
    """A token asked for with an expiry out of bounds, or both a name and an existing node."""

    code = "invalid_enrolment_request"


class EnrolmentTokenInvalid(NotAuthenticated):
    """Not an enrolment token (``bne_…``), or none Berth issued: never says which."""

    code = "enrolment_token_invalid"


class EnrolmentTokenExpired(NotAuthenticated):
    code = "enrolment_token_expired"


class EnrolmentTokenSpent(NotAuthenticated):
    """The token was exchanged for a credential already: it works once."""

    code = "enrolment_token_spent"


class EnrolmentTokenUsed(Conflict):
    """Withdrawing a token that was used already: there is nothing left to withdraw (revoke the node)."""

    code = "enrolment_token_used"


class NodeNameTaken(Conflict):
    """A node of that name holds a credential (live or revoked), and the token is not one issued for it."""

    code = "node_name_taken"


class NodeCredentialInvalid(NotAuthenticated):
    code = "node_credential_invalid"


class NodeRevoked(NotAuthenticated):
    code = "node_revoked"


class NodeOwnershipMismatch(PermissionDenied):
    """A node read or reported what belongs to another node (``scheduler.api.node_auth.refuse_foreign``)."""

    code = "node_ownership_mismatch"
