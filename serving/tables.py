"""Console tables of the serving app (``berth.tables.Table``)."""
