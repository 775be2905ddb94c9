"""How a process the suite starts (a gateway, an agent, `serve`) opens the suite's own test database."""

from __future__ import annotations


def database_environ(db: dict, host: str | None = None, port: int | None = None) -> dict:
    """What a process of Berth needs to open the suite's test database: PostgreSQL's, or on the
    embedded default the SQLite file (with the secret key and pepper this process generated, which
    naming a database makes it ask for). ``host`` and ``port`` replace PostgreSQL's own (a proxy in
    front of it, ``tests.assets.tcp_proxy``); a SQLite file has neither."""
    from django.conf import settings

    if db["ENGINE"].endswith("sqlite3"):
        if host is not None or port is not None:
            raise ValueError("SQLite is a file: there is no host or port to reach it through")
        return {"DATABASE_URL": f"sqlite:///{db['NAME']}", "BERTH_SECRET_KEY": settings.SECRET_KEY,
                "BERTH_KEY_PEPPER": settings.KEY_PEPPER}
    host = host or db["HOST"]
    port = port or db["PORT"]
    return {"DATABASE_URL": f"postgres://{db['USER']}@{host}:{port}/{db['NAME']}"}


def through(proxy) -> dict:
    """``database_environ`` for a process that reaches the suite's PostgreSQL through ``proxy`` (the
    ``database_proxy`` fixture), which the test cuts and restores."""
    from django.db import connection

    return database_environ(connection.settings_dict, host=proxy.host, port=proxy.port)
