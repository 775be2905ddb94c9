"""Deployments: their state machine, the start-up gate, and the verbs that drive them."""
