"""The node agent: everything that touches engines on one machine (floor 2, beside ``control``).

``manage.py agent --node NAME`` runs a Celery worker on the queue ``node.NAME``; the tasks in
``serving.tasks`` land in ``lifecycle`` (start, watch, stop, drain, sleep, wake). ``failures`` keeps
a failed engine's evidence and what it teaches; ``adopt`` takes over what an earlier agent left;
``heartbeat`` re-registers the node, checks that engines which should run still do and runs the
memory ``watchdog``. Engines run in their own sessions (or containers) and outlive the agent.
"""
