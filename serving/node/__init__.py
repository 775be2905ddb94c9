"""The node agent: everything that touches engines on one machine (floor 2, beside ``control``).

``manage.py agent`` runs ``agent``: with the server's URL and this node's own credential, and nothing
else of the cluster, it talks to the control plane through the node API (``client``). ``heartbeat``
sends the node's report and what it sees of its engines; the jobs it claims land in ``lifecycle``
(start, watch, stop, sleep, wake), ``weights`` fetches what a start lacks. What those reports mean —
every state change, reservation and lesson — is the control side's (``serving.control.node_work``,
``node_reports``, ``adopt``, ``failures``, ``watchdog``). Engines run in their own sessions (or
containers) and outlive the agent. ``registration`` is the control-plane machine's own: it registers
this machine from ``bootstrap`` and after an engine build.
"""
