"""Console tables of the gateway app (``berth.tables.Table``)."""
