"""`manage.py backup` and `restore`: a populated database and its secrets go into one archive, come back
into a fresh database where the API still answers and every key still authenticates; a restore under
other secrets, or into a database that is not empty, refuses and says why. Runs on PostgreSQL and on the
embedded SQLite (tests/conftest.py EMBEDDED)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tarfile
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection

from berth import backup
from tests.assets.database import database_environ
from tests.assets.world import build_world

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.django_db(transaction=True)

# Run in the restored database: every key authenticates, and the management API lists what it listed before.
READ_CHECKS = """
import json, sys
from django.test import Client
from tenancy.services import clients
keys = json.loads(sys.stdin.read())
result = {"authenticated": [clients.authenticate(key).lookup for key in keys["all"]], "scopes": {}}
for key in keys["management"]:
    response = Client().get("/api/tenancy/scopes/", HTTP_AUTHORIZATION=f"Bearer {key}", HTTP_HOST="localhost")
    assert response.status_code == 200, (response.status_code, response.content[:300])
    result["scopes"][key[:12]] = sorted(scope["path"] for scope in response.json()["results"])
print("RESULT " + json.dumps(result))
"""


def _manage(args: list[str], environ: dict, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env={**os.environ, **environ},
                          input=stdin, capture_output=True, text=True, timeout=120, check=False)


@contextmanager
def fresh_database(tmp_path):
    """A new, empty database of the suite's own kind, as the environment a process needs to use it."""
    db = connection.settings_dict
    if connection.vendor == "sqlite":
        yield database_environ({**db, "NAME": str(tmp_path / "restored.sqlite3")})
        return
    name = f"berth_restore_{uuid.uuid4().hex[:12]}"
    with connection.cursor() as cursor:
        cursor.execute(f'CREATE DATABASE "{name}"')
    try:
        yield database_environ({**db, "NAME": name})
    finally:
        connection.close()  # no connection of ours may hold it
        with connection.cursor() as cursor:
            cursor.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _scopes_seen_with(key: str) -> list[str]:
    from django.test import Client

    response = Client().get("/api/tenancy/scopes/", HTTP_AUTHORIZATION=f"Bearer {key}")
    assert response.status_code == 200
    return sorted(scope["path"] for scope in response.json()["results"])


def test_a_restored_backup_answers_the_api_and_keeps_every_key(personas, tmp_path):
    from tenancy.services import clients

    world = build_world(personas)
    client = clients.create_client(personas.olivia_actor, personas.acme.project, "restored-robot")
    _, inference_key = clients.create_credential(personas.olivia_actor, client, name="after-restore")
    keys = {"all": [world.globex_key, world.sibling_key, inference_key],
            "management": [world.globex_key, world.sibling_key]}
    before = {key[:12]: _scopes_seen_with(key) for key in keys["management"]}
    lookups = sorted(clients.authenticate(key).lookup for key in keys["all"])

    made = _manage(["backup", "--dir", str(tmp_path / "backups")], database_environ(connection.settings_dict))
    assert made.returncode == 0, made.stderr
    archive = Path(made.stdout.split("Backup written: ", 1)[1].splitlines()[0])

    with fresh_database(tmp_path) as environ:
        restored = _manage(["restore", str(archive)], environ)
        assert restored.returncode == 0, restored.stderr
        assert "Restored the" in restored.stdout
        checked = _manage(["shell", "-c", READ_CHECKS], {**environ, "BERTH_ALLOWED_HOSTS": "localhost"},
                          stdin=json.dumps(keys))
        assert checked.returncode == 0, checked.stderr
        result = json.loads(checked.stdout.split("RESULT ", 1)[1])
        assert sorted(result["authenticated"]) == lookups
        assert result["scopes"] == before
        assert all(before.values())  # each key saw scopes: the comparison is not of empty lists

        again = _manage(["restore", str(archive)], environ)
        assert again.returncode != 0
        assert "restore_database_not_empty" in again.stderr and "table(s)" in again.stderr


def test_a_restore_under_another_pepper_refuses_and_names_the_setting(personas, tmp_path, settings):
    archive = backup.create(tmp_path)
    settings.KEY_PEPPER = "another-pepper-than-the-archives-0123456789abcdef"
    with pytest.raises(backup.BackupError) as refused:
        backup.restore(archive)
    assert refused.value.code == "backup_secrets_mismatch"
    assert "BERTH_KEY_PEPPER" in str(refused.value) and "secrets.json" in str(refused.value)
    assert settings.KEY_PEPPER not in str(refused.value)  # never shows a secret
    assert "BERTH_SECRET_KEY" not in str(refused.value)  # names only what differs


def test_the_mismatch_is_checked_before_the_database_is_touched(personas, tmp_path):
    archive = backup.create(tmp_path)
    with fresh_database(tmp_path) as environ:
        refused = _manage(["restore", str(archive)],
                          {**environ, "BERTH_SECRET_KEY": "a-secret-key-that-is-not-the-archives-0123456789"})
        assert refused.returncode != 0
        assert "backup_secrets_mismatch" in refused.stderr and "BERTH_SECRET_KEY" in refused.stderr
        if connection.vendor == "sqlite":
            assert not Path(environ["DATABASE_URL"].removeprefix("sqlite:///")).exists()
        else:
            count = "from django.db import connection; print(len(connection.introspection.table_names()))"
            tables = _manage(["shell", "-c", count], environ)
            assert tables.stdout.strip().splitlines()[-1] == "0", tables.stderr


def test_a_restore_into_a_database_with_tables_refuses_and_names_them(personas, tmp_path):
    archive = backup.create(tmp_path)
    with pytest.raises(backup.BackupError) as refused:
        backup.restore(archive)  # the suite's own database, migrated
    assert refused.value.code == "restore_database_not_empty"
    assert "auth_user" in str(refused.value) or "more" in str(refused.value)


def test_the_archive_is_private_holds_the_secrets_and_only_the_newest_are_kept(personas, tmp_path):
    directory = tmp_path / "backups"
    directory.mkdir()
    (directory / "notes.txt").write_text("mine")
    (directory / "berth-backup-handmade.tar.gz").write_text("not Berth's naming: left alone")
    made = [backup.create(directory, keep=2) for _ in range(4)]

    assert sorted(p.name for p in directory.iterdir()) == sorted(
        ["notes.txt", "berth-backup-handmade.tar.gz", made[2].name, made[3].name])
    assert (directory / "notes.txt").read_text() == "mine"
    for path in made[2:]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with tarfile.open(made[3]) as archive:
        names = archive.getnames()
        secrets = json.loads(archive.extractfile("secrets.json").read())
        manifest = json.loads(archive.extractfile("manifest.json").read())
    assert secrets == {"BERTH_SECRET_KEY": settings.SECRET_KEY, "BERTH_KEY_PEPPER": settings.KEY_PEPPER}
    assert manifest["vendor"] == ("sqlite" if connection.vendor == "sqlite" else "postgresql")
    assert manifest["database"] in names
    assert backup.newest(directory)[0] == made[3]


def test_the_snapshot_tool_is_checked_with_a_clear_error(personas, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    if connection.vendor == "sqlite":
        assert backup.create(tmp_path / "backups").is_file()  # VACUUM INTO needs no tool
        return
    with pytest.raises(backup.BackupError) as missing:
        backup.create(tmp_path / "backups")
    assert missing.value.code == "backup_tool_missing"
    assert "pg_dump" in str(missing.value) and "postgresql-client" in str(missing.value)
    assert not any((tmp_path / "backups").iterdir())  # no partial archive left


def test_the_daily_beat_entry_runs_the_backup_task_only_when_a_directory_is_set():
    from berth import tasks

    entries = {entry["task"] for entry in settings.CELERY_BEAT_SCHEDULE.values()}
    assert ("berth.backup" in entries) == (settings.BACKUP_DIR is not None)
    assert tasks.take_backup.name == "berth.backup"
    environ = {"BERTH_BACKUP_DIR": "/tmp/berth-backups-probe", "BERTH_BACKUP_KEEP": "3"}
    script = ("import django; django.setup(); from django.conf import settings; print(settings.BACKUP_KEEP, "
              "[e['schedule'] for e in settings.CELERY_BEAT_SCHEDULE.values() if e['task'] == 'berth.backup'])")
    probe = subprocess.run([sys.executable, "-c", script], check=False, cwd=ROOT, env={**os.environ, **database_environ(connection.settings_dict), **environ},
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == "3 [86400.0]"


def test_the_database_password_reaches_pg_dump_through_the_environment_never_its_arguments(tmp_path, monkeypatch):
    calls = []

    def run(command, env, **options):
        calls.append((command, env))
        Path(command[-1].split("=", 1)[1]).write_bytes(b"PGDMP")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(backup.subprocess, "run", run)
    if connection.vendor == "sqlite":
        assert backup._snapshot(connection.settings_dict, "sqlite", tmp_path).stat().st_size > 0
        assert calls == []  # VACUUM INTO, no process
        return
    db = {**connection.settings_dict, "PASSWORD": "pw-that-must-stay-hidden"}
    backup._snapshot(db, "postgresql", tmp_path)
    [(command, env)] = calls
    assert not any("pw-that-must-stay-hidden" in part or db["NAME"] in part for part in command)
    assert env["PGPASSWORD"] == "pw-that-must-stay-hidden" and env["PGDATABASE"] == db["NAME"]
    assert env["PGHOST"] == db["HOST"] and env["PGUSER"] == db["USER"]
