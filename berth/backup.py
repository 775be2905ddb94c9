"""Back up and restore Berth: one archive holds a consistent database snapshot and the secrets that keep
its keys working.

A restore of the database alone would silently break every API key (hashed with ``BERTH_KEY_PEPPER``)
and everything signed with ``BERTH_SECRET_KEY``: both live outside the database, so the archive carries
them, and a restore refuses to run under a configuration whose secrets differ from the archive's.

The archive is a gzipped tar of ``manifest.json`` (format, vendor, when, fingerprints of the secrets),
``secrets.json`` (the secrets themselves) and the snapshot: ``database.pgdump`` (``pg_dump`` custom
format; the connection is passed through libpq's environment, never on the command line, where any
user of the machine could read the password) or ``database.sqlite3`` (``VACUUM INTO``). It is written
mode 0600 under a hidden temporary name and renamed, so a reader never sees half an archive; only files
named like Berth's archives are ever pruned.

Imports no app: it dumps the database and reads settings (``berth.tasks`` and the ``backup`` and
``restore`` commands wrap it).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import sqlite3
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from django.conf import settings
from django.db import connections

FORMAT = "berth-backup"
VERSION = 1
PREFIX = "berth-backup-"
SUFFIX = ".tar.gz"
ARCHIVE_NAME = re.compile(r"^berth-backup-\d{8}T\d{6}\d{6}Z\.tar\.gz$")
# The secrets an archive carries, by the setting that holds each and the variable that sets it.
SECRETS = {"SECRET_KEY": "BERTH_SECRET_KEY", "KEY_PEPPER": "BERTH_KEY_PEPPER"}
# In the embedded mode each secret is generated once into the data directory (berth/settings.py).
EMBEDDED_FILES = {"SECRET_KEY": "secret_key", "KEY_PEPPER": "key_pepper"}


class BackupError(Exception):
    """A backup or restore that cannot go on, with a stable ``code`` and what to do about it."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Restored:
    vendor: str
    database: str
    created_at: str


def fingerprint(secret: str) -> str:
    """A digest that tells two secrets apart without showing either (domain-separated from any other use)."""
    return hashlib.sha256(b"berth-backup-fingerprint\0" + secret.encode()).hexdigest()


def _database(alias: str = "default") -> dict:
    return settings.DATABASES[alias]


def _vendor(db: dict) -> str:
    if db["ENGINE"].endswith("sqlite3"):
        return "sqlite"
    if db["ENGINE"].endswith("postgresql"):
        return "postgresql"
    raise BackupError("backup_unsupported_database", f"Backups support PostgreSQL and SQLite, not {db['ENGINE']}.")


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise BackupError("backup_tool_missing",
                          f"{name} is not installed (or not on PATH): install the PostgreSQL client tools "
                          f"(`apt-get install postgresql-client`), of the server's major version or newer.")
    return found


def _libpq_environ(db: dict) -> dict:
    """The connection as libpq's environment: the password never appears in a process listing."""
    environ = dict(os.environ)  # a PGPASSFILE or PGSSLCERT of the operator's still applies
    for variable, key in (("PGHOST", "HOST"), ("PGPORT", "PORT"), ("PGUSER", "USER"), ("PGPASSWORD", "PASSWORD"),
                          ("PGDATABASE", "NAME")):
        if db.get(key):
            environ[variable] = str(db[key])
    options = db.get("OPTIONS") or {}
    for variable, key in (("PGSSLMODE", "sslmode"), ("PGSSLROOTCERT", "sslrootcert"),
                          ("PGCONNECT_TIMEOUT", "connect_timeout")):
        if options.get(key) is not None:
            environ[variable] = str(options[key])
    return environ


def _run(command: list[str], environ: dict, what: str) -> None:
    result = subprocess.run(command, env=environ, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        detail = (result.stderr or result.stdout).strip().splitlines()
        raise BackupError(f"{what.replace(' ', '_')}_failed",
                          f"{what} failed (exit {result.returncode}): {' / '.join(detail[-5:]) or 'no output'}")


def _snapshot(db: dict, vendor: str, into: Path) -> Path:
    if vendor == "postgresql":
        target = into / "database.pgdump"
        _run([_tool("pg_dump"), "--format=custom", "--no-owner", "--no-privileges", f"--file={target}"],
             _libpq_environ(db), "pg_dump")
        return target
    target = into / "database.sqlite3"
    # A connection of its own: VACUUM cannot run inside the caller's transaction, and INTO gives a
    # consistent copy while other processes keep writing.
    source = sqlite3.connect(str(db["NAME"]), timeout=30)
    try:
        source.execute("VACUUM INTO ?", (str(target),))
    finally:
        source.close()
    return target


def _add_bytes(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o600, int(datetime.now(UTC).timestamp())
    archive.addfile(info, io.BytesIO(data))


def archives(directory: Path) -> list[Path]:
    """Berth's archives in ``directory``, oldest first (their names sort by the time they were made)."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if ARCHIVE_NAME.match(p.name) and p.is_file())


def newest(directory: Path | None = None) -> tuple[Path, datetime] | None:
    """The newest archive and when it was made (for a backup-age metric), or None."""
    found = archives(Path(directory or settings.BACKUP_DIR or settings.DATA_DIR / "backups"))
    if not found:
        return None
    stamp = found[-1].name[len(PREFIX):-len(SUFFIX)]
    return found[-1], datetime.strptime(stamp, "%Y%m%dT%H%M%S%fZ").replace(tzinfo=UTC)


def create(directory: Path | None = None, keep: int | None = None, alias: str = "default") -> Path:
    """Write one archive into ``directory`` (BERTH_BACKUP_DIR, else the data directory's ``backups``)
    and keep the newest ``keep`` of Berth's archives there (BERTH_BACKUP_KEEP); nothing else is touched."""
    directory = Path(directory or settings.BACKUP_DIR or settings.DATA_DIR / "backups")
    keep = settings.BACKUP_KEEP if keep is None else keep
    if keep < 1:
        raise BackupError("backup_keep_invalid", "Keep at least one backup (BERTH_BACKUP_KEEP >= 1).")
    db = _database(alias)
    vendor = _vendor(db)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    now = datetime.now(UTC)
    final = directory / f"{PREFIX}{now:%Y%m%dT%H%M%S%f}Z{SUFFIX}"
    secrets = {variable: getattr(settings, name) for name, variable in SECRETS.items()}
    manifest = {"format": FORMAT, "version": VERSION, "created_at": now.isoformat(), "vendor": vendor,
                "fingerprints": {variable: fingerprint(value) for variable, value in secrets.items()}}
    with tempfile.TemporaryDirectory(dir=directory, prefix=".berth-backup-") as work:
        snapshot = _snapshot(db, vendor, Path(work))
        manifest["database"] = snapshot.name
        partial = Path(work) / "archive.partial"
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            with tarfile.open(fileobj=handle, mode="w:gz") as archive:
                _add_bytes(archive, "manifest.json", json.dumps(manifest, indent=2).encode())
                _add_bytes(archive, "secrets.json", json.dumps(secrets, indent=2).encode())
                info = archive.gettarinfo(str(snapshot), arcname=snapshot.name)
                info.mode = 0o600
                with snapshot.open("rb") as data:
                    archive.addfile(info, data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(partial, final)
    _fsync_directory(directory)
    for old in archives(directory)[:-keep]:
        old.unlink(missing_ok=True)
    return final


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read(archive: tarfile.TarFile, name: str) -> bytes:
    try:
        member = archive.getmember(name)
    except KeyError:
        raise BackupError("backup_archive_invalid", f"The archive has no {name}: it is not a Berth backup.") from None
    handle = archive.extractfile(member)
    if handle is None:
        raise BackupError("backup_archive_invalid", f"{name} in the archive is not a file.")
    return handle.read()


def _check_secrets(manifest: dict) -> None:
    recorded = manifest.get("fingerprints") or {}
    different = [name for name, variable in SECRETS.items() if recorded.get(variable) != fingerprint(getattr(settings, name))]
    if different:
        variables = " and ".join(SECRETS[name] for name in different)
        broken = " and ".join("every API key" if name == "KEY_PEPPER" else "every session and signed value"
                              for name in different)
        files = " and ".join(str(settings.DATA_DIR / EMBEDDED_FILES[name]) for name in different)
        raise BackupError(
            "backup_secrets_mismatch",
            f"This archive was made with a different {variables} than this configuration's: restored, {broken} "
            f"in it would stop working. Set {variables} (or the _FILE variants) to the archive's values — "
            f"`tar -xzOf ARCHIVE secrets.json` shows them — or, in the embedded mode, write them to {files}; "
            f"then run the restore again.")


def _postgres_tables(db: dict) -> list[str]:
    import psycopg  # Django's PostgreSQL driver: imported only when the database is PostgreSQL

    params = {"host": db.get("HOST"), "port": db.get("PORT"), "user": db.get("USER"), "password": db.get("PASSWORD"),
              "dbname": db["NAME"], "connect_timeout": (db.get("OPTIONS") or {}).get("connect_timeout", 5)}
    with psycopg.connect(**{k: v for k, v in params.items() if v}, autocommit=True) as connection:
        rows = connection.execute(
            "SELECT table_schema || '.' || table_name FROM information_schema.tables "
            "WHERE table_schema NOT IN ('pg_catalog', 'information_schema') ORDER BY 1").fetchall()
    return [row[0] for row in rows]


def _sqlite_tables(path: Path) -> list[str]:
    if not path.exists() or path.stat().st_size == 0:
        return []
    connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return [row[0] for row in connection.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY name")]
    finally:
        connection.close()


def _refuse_non_empty(tables: list[str], name: str) -> None:
    if tables:
        shown = ", ".join(tables[:5]) + (f" and {len(tables) - 5} more" if len(tables) > 5 else "")
        raise BackupError("restore_database_not_empty",
                          f"The database {name} is not empty: it has {len(tables)} table(s) ({shown}). Restore "
                          f"into a new, empty database (createdb, or a new SQLite file) and point DATABASE_URL at it.")


def restore(archive_path: Path, alias: str = "default") -> Restored:
    """Restore ``archive_path`` into the configured database, which must be empty; refuses first when the
    archive's secrets are not this configuration's."""
    archive_path = Path(archive_path)
    try:
        archive = tarfile.open(archive_path, mode="r:gz")  # noqa: SIM115  (the with below closes it)
    except FileNotFoundError:
        raise BackupError("backup_archive_missing", f"There is no archive at {archive_path}.") from None
    except (tarfile.TarError, OSError) as exc:
        raise BackupError("backup_archive_invalid", f"{archive_path} is not a Berth backup archive: {exc}.") from None
    with archive:
        try:
            manifest = json.loads(_read(archive, "manifest.json"))
        except json.JSONDecodeError:
            raise BackupError("backup_archive_invalid", "The archive's manifest.json is not JSON.") from None
        if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
            raise BackupError("backup_archive_invalid",
                              f"The archive is not a Berth backup of version {VERSION} "
                              f"(format {manifest.get('format')!r}, version {manifest.get('version')!r}).")
        _check_secrets(manifest)
        db = _database(alias)
        vendor = _vendor(db)
        if manifest.get("vendor") != vendor:
            raise BackupError("restore_wrong_database",
                              f"The archive holds a {manifest.get('vendor')} database; this configuration uses "
                              f"{vendor}. Point DATABASE_URL at a {manifest.get('vendor')} database.")
        expected = "database.pgdump" if vendor == "postgresql" else "database.sqlite3"
        if manifest.get("database") != expected:
            raise BackupError("backup_archive_invalid", f"The archive's manifest names no {expected}.")
        connections[alias].close()
        if vendor == "postgresql":
            _refuse_non_empty(_postgres_tables(db), db["NAME"])
        else:
            _refuse_non_empty(_sqlite_tables(Path(db["NAME"])), str(db["NAME"]))
        target = Path(db["NAME"]) if vendor == "sqlite" else None
        if target is not None:
            target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent if target else None, prefix=".berth-restore-") as work:
            snapshot = Path(work) / expected
            fd = os.open(snapshot, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as handle:
                source = archive.extractfile(archive.getmember(expected))
                if source is None:
                    raise BackupError("backup_archive_invalid", f"{expected} in the archive is not a file.")
                shutil.copyfileobj(source, handle)
            if vendor == "postgresql":
                # The database's name is no secret; the host, user and password go through the environment.
                _run([_tool("pg_restore"), "--no-owner", "--no-privileges", "--exit-on-error", "--single-transaction",
                      f"--dbname={db['NAME']}", str(snapshot)], _libpq_environ(db), "pg_restore")
            else:
                os.chmod(snapshot, 0o600)
                os.replace(snapshot, target)
    return Restored(vendor=vendor, database=str(db["NAME"]), created_at=str(manifest.get("created_at")))
