"""Error codes of the tenancy app: subclasses of ``berth.errors.BerthError``."""
