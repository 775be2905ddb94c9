"""Console forms of the tenancy app."""
