"""Models of the serving app (see the issue that builds it)."""
