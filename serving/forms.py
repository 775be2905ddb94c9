"""Console forms of the serving app."""
