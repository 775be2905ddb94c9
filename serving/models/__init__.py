"""Serving's tables: deployments and their replicas (``deployments``), the model catalog
(``catalog``), and the replica states with every set of them a rule depends on (``states``)."""

from serving.models.catalog import FetchJob, ModelEntry, ModelFile, ProfileSpeed
from serving.models.deployments import Deployment, DeploymentEvent, Operation, Replica
from serving.models.states import HOLDING, DeploymentState

__all__ = ["Deployment", "DeploymentEvent", "DeploymentState", "FetchJob", "HOLDING", "ModelEntry", "ModelFile",
           "Operation", "ProfileSpeed", "Replica"]
