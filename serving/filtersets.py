"""FilterSets of the serving app, shared by the console and the API."""
