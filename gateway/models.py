"""Models of the gateway app (see the issue that builds it)."""
