"""The states of a replica (and of a deployment, which speaks for its replicas), and every set of
them that a rule depends on, each named once. Code that asks "does this replica count as …"
takes the set from here; a new state is added here, with the sets it belongs to."""

from django.db import models


class DeploymentState(models.TextChoices):
    PLANNED = "planned", "Planned"
    QUEUED = "queued", "Queued"
    STARTING = "starting", "Starting"
    LOADING = "loading", "Loading"
    READY = "ready", "Ready"
    SLEEPING = "sleeping", "Sleeping"
    STOPPING = "stopping", "Stopping"
    STOPPED = "stopped", "Stopped"
    FAILED = "failed", "Failed"
    UNKNOWN = "unknown", "Unknown"  # a running managed engine found without a record


S = DeploymentState

# Ended for good: what it held is given back, and starting the deployment again makes a fresh replica.
TERMINAL = (S.STOPPED, S.FAILED)
# Not started yet: a stop cancels it at once, with no engine to stop.
BEFORE_START = (S.PLANNED, S.QUEUED)
# Holding one of the node's start-up slots (the start-up gate).
STARTING_UP = (S.STARTING, S.LOADING)
# On its way up: planned, waiting at the gate, or starting.
COMING_UP = BEFORE_START + STARTING_UP
# Serving, or able to serve again without a load (a sleeping engine wakes in seconds).
UP = (S.READY, S.SLEEPING)
# An engine that runs (or ran until it was found) on the node: what a node's memory holds now.
RESIDENT = (S.READY, S.SLEEPING, S.UNKNOWN)
# Has (or will have once admitted) an engine on the node.
ACTIVE = (S.QUEUED, *STARTING_UP, *RESIDENT)
# Its name is taken: a second deployment of the same name is refused while one is in these states.
SERVING = (S.PLANNED, *ACTIVE)
# Comes up (or is up) by itself, or on a request, without a person acting: routing waits for it.
LOADABLE = COMING_UP + UP
# Listed by /v1/models: a stopping, stopped or failed deployment still names its model.
LISTED = LOADABLE + (S.STOPPING,) + TERMINAL
# Counts towards a catalog model's replicas for the placement policy (a sleeping one is not serving).
COUNTING = COMING_UP + (S.READY,)
# Holds its port and its memory on the node, from the moment it is planned until it has ended
# (SERVING and STOPPING, in the order the port constraint's migration names them).
HOLDING = (S.PLANNED, S.QUEUED, S.STARTING, S.LOADING, S.READY, S.SLEEPING, S.STOPPING, S.UNKNOWN)
# When replicas (or a model's deployments) disagree, the state that speaks for them: the most telling first.
PRECEDENCE = (S.READY, S.LOADING, S.STARTING, S.QUEUED, S.PLANNED, S.SLEEPING, S.UNKNOWN, S.STOPPING) + TERMINAL
# A deployment at rest: nothing is about to change unless someone acts.
SETTLED = UP + TERMINAL
