"""Deployments (floor 1, beside ``catalog``, never importing it): what one is asked to be
(``request``), the verbs that drive it (``service``), the state machine (``states``), the start-up
gate, ports, and switch/reconfigure with rollback (``operations``)."""
