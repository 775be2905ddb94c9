"""Console tables of the tenancy app (``berth.tables.Table``)."""
