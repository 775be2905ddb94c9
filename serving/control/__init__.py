"""The control loop (floor 2, beside ``node``): it decides what should run and asks the agents.

``placement`` builds the policy's snapshot and applies its plans; ``ondemand`` loads a model on its
first request; ``reconcile`` is the beat's pass; ``serve_model`` is the fetch → catalog → deploy →
smoke-test workflow; ``routing`` is the gateway's read model of what serves each name.
"""
