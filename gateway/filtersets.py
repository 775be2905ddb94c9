"""FilterSets of the gateway app, shared by the console and the API."""
