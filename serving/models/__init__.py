"""Serving's tables: deployments and their replicas (``deployments``), the model catalog
(``catalog``), the jobs of the nodes' agents (``node_jobs``), and the replica states with every set
of them a rule depends on (``states``)."""

from serving.models.catalog import FetchJob, ModelEntry, ModelFile, ProfileSpeed
from serving.models.deployments import Deployment, DeploymentEvent, Operation, Replica
from serving.models.node_jobs import NodeJob
from serving.models.states import HOLDING, DeploymentState

__all__ = ["Deployment", "DeploymentEvent", "DeploymentState", "FetchJob", "HOLDING", "ModelEntry", "ModelFile",
           "NodeJob", "Operation", "ProfileSpeed", "Replica"]
