"""How a process the suite starts (a gateway, an agent, `serve`) opens the suite's own test database."""

from __future__ import annotations


def database_environ(db: dict) -> dict:
    """What a process of Berth needs to open the suite's test database: PostgreSQL's, or on the
    embedded default the SQLite file (with the secret key and pepper this process generated, which
    naming a database makes it ask for)."""
    from django.conf import settings

    if db["ENGINE"].endswith("sqlite3"):
        return {"DATABASE_URL": f"sqlite:///{db['NAME']}", "BERTH_SECRET_KEY": settings.SECRET_KEY,
                "BERTH_KEY_PEPPER": settings.KEY_PEPPER}
    return {"DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"}
