"""Settings come from the environment and refuse malformed values loudly."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from berth import env

ROOT = Path(__file__).resolve().parent.parent


def load_settings(tmp_path, **overrides):
    """Import the settings in a fresh interpreter with exactly these variables set."""
    environment = {k: v for k, v in os.environ.items()
                   if not k.startswith(("BERTH_", "DATABASE_URL", "REDIS_URL"))}
    environment.update({"BERTH_DATA_DIR": str(tmp_path / "data"), "DJANGO_SETTINGS_MODULE": "berth.settings"})
    environment.update(overrides)
    return subprocess.run(
        [sys.executable, "-c", "import django; django.setup(); from django.conf import settings; print(settings.SECRET_KEY)"],
        cwd=ROOT, env=environment, capture_output=True, text=True, timeout=60,
    )


def test_malformed_boolean_stops_start_up_with_a_clear_message(tmp_path):
    result = load_settings(tmp_path, BERTH_DEBUG="maybe")
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr
    assert "BERTH_DEBUG='maybe' is not a boolean" in result.stderr


def test_malformed_database_url_is_refused_without_leaking_its_password(tmp_path):
    result = load_settings(tmp_path, DATABASE_URL="mysql://berth:hunter2@db/berth", BERTH_SECRET_KEY="x" * 40)
    assert result.returncode != 0
    assert "DATABASE_URL must be a URL starting with postgres://" in result.stderr
    assert "hunter2" not in result.stderr


def test_secret_key_is_required_outside_the_embedded_mode(tmp_path):
    result = load_settings(tmp_path, DATABASE_URL="postgres://postgres@127.0.0.1:5432/berth")
    assert result.returncode != 0
    assert "BERTH_SECRET_KEY (or BERTH_SECRET_KEY_FILE) is required" in result.stderr


def test_embedded_mode_generates_the_secret_key_once_and_keeps_it_private(tmp_path):
    first = load_settings(tmp_path)
    second = load_settings(tmp_path)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == second.stdout.strip()
    assert len(first.stdout.strip()) >= 50
    key_file = tmp_path / "data" / "secret_key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600


def test_secret_can_be_read_from_a_file(tmp_path):
    secret = tmp_path / "key"
    secret.write_text("k" * 48 + "\n")
    result = load_settings(tmp_path, BERTH_SECRET_KEY_FILE=str(secret))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "k" * 48


@pytest.mark.parametrize("value, expected", [("1", True), ("yes", True), ("Off", False), ("", False)])
def test_boolean_accepts_the_usual_spellings(monkeypatch, value, expected):
    monkeypatch.setenv("BERTH_FLAG", value)
    assert env.boolean("BERTH_FLAG", False) is expected


def test_integer_out_of_range_names_the_bound(monkeypatch):
    monkeypatch.setenv("BERTH_WORKERS", "0")
    with pytest.raises(ImproperlyConfigured, match="BERTH_WORKERS=0 is below the minimum of 1"):
        env.integer("BERTH_WORKERS", 2, minimum=1)
    monkeypatch.setenv("BERTH_WORKERS", "two")
    with pytest.raises(ImproperlyConfigured, match="BERTH_WORKERS='two' is not a whole number"):
        env.integer("BERTH_WORKERS", 2)


def test_list_with_an_empty_item_is_refused(monkeypatch):
    monkeypatch.setenv("BERTH_ALLOWED_HOSTS", "a.example,,b.example")
    with pytest.raises(ImproperlyConfigured, match="has an empty item"):
        env.words("BERTH_ALLOWED_HOSTS", [])


def test_value_and_file_together_are_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("BERTH_TOKEN", "a")
    monkeypatch.setenv("BERTH_TOKEN_FILE", str(tmp_path / "t"))
    with pytest.raises(ImproperlyConfigured, match="Set BERTH_TOKEN or BERTH_TOKEN_FILE, not both"):
        env.string("BERTH_TOKEN")
