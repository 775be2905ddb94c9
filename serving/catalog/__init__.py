"""The model catalog and its mirror (floor 1, beside ``deployments``, never importing it): entries and
their profiles, fetching from the hub and verifying, servability, measured speed, placement fields
(``placing``) and the room a model has (``room``)."""
