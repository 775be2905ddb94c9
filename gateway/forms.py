"""Console forms of the gateway app."""
