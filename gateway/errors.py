"""Error codes of the gateway app: subclasses of ``berth.errors.BerthError``."""
