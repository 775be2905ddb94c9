"""Models of the tenancy app (see the issue that builds it)."""
