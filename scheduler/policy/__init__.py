"""The scheduler's pure decisions: dataclasses in, dataclasses out, no database."""
