"""FilterSets of the tenancy app, shared by the console and the API."""
