"""The control loop (floor 2, beside ``node``): it decides what should run and asks the agents.

``placement`` builds the policy's snapshot and applies its plans; ``ondemand`` loads a model on its
first request; ``reconcile`` is the beat's pass; ``serve_model`` is the fetch → catalog → deploy →
smoke-test workflow; ``routing`` is the gateway's read model of what serves each name. The nodes'
side: ``node_jobs`` is the queue of leased jobs the agents claim through the node API; ``node_work``
says what each kind of job means and what its reports record; ``node_reports`` takes heartbeats;
``adopt`` takes over what a restarted agent or a node back from lost finds; ``failures`` records a
failed replica's evidence and what a load teaches; ``watchdog`` watches each node's memory.
"""
