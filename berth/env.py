"""Read settings from the environment, failing loudly on what is malformed.

Each helper either returns a well-formed value or raises ``ImproperlyConfigured`` naming the
variable, what it holds and what it should hold: a typo in production must stop the process at
start-up, not turn into a silent default. ``NAME_FILE`` is read in place of ``NAME`` for secrets
(Docker and systemd credentials).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

TRUE = {"1", "true", "yes", "on"}
FALSE = {"0", "false", "no", "off"}


def _raw(name: str) -> str | None:
    value = os.environ.get(name)
    file_name = os.environ.get(f"{name}_FILE")
    if value is not None and file_name is not None:
        raise ImproperlyConfigured(f"Set {name} or {name}_FILE, not both.")
    if file_name is not None:
        try:
            return Path(file_name).read_text().strip()
        except OSError as exc:
            raise ImproperlyConfigured(f"{name}_FILE={file_name!r} cannot be read: {exc.strerror}.") from exc
    return value


def string(name: str, default: str | None = None) -> str | None:
    value = _raw(name)
    if value is None or value.strip() == "":
        return default
    return value.strip()


def boolean(name: str, default: bool) -> bool:
    value = _raw(name)
    if value is None or value.strip() == "":
        return default
    lowered = value.strip().lower()
    if lowered in TRUE:
        return True
    if lowered in FALSE:
        return False
    raise ImproperlyConfigured(
        f"{name}={value!r} is not a boolean: use one of {', '.join(sorted(TRUE | FALSE))}."
    )


def integer(name: str, default: int, minimum: int | None = None, maximum: int | None = None) -> int:
    value = _raw(name)
    if value is None or value.strip() == "":
        return default
    try:
        number = int(value.strip())
    except ValueError:
        raise ImproperlyConfigured(f"{name}={value!r} is not a whole number.") from None
    if minimum is not None and number < minimum:
        raise ImproperlyConfigured(f"{name}={number} is below the minimum of {minimum}.")
    if maximum is not None and number > maximum:
        raise ImproperlyConfigured(f"{name}={number} is above the maximum of {maximum}.")
    return number


def words(name: str, default: list[str]) -> list[str]:
    """A comma-separated list; empty items are refused rather than ignored."""
    value = _raw(name)
    if value is None or value.strip() == "":
        return list(default)
    items = [item.strip() for item in value.split(",")]
    if any(not item for item in items):
        raise ImproperlyConfigured(f"{name}={value!r} has an empty item: separate values with single commas.")
    return items


def url(name: str, schemes: tuple[str, ...]) -> str | None:
    value = string(name)
    if value is None:
        return None
    scheme = value.split("://", 1)[0] if "://" in value else ""
    if scheme not in schemes:
        raise ImproperlyConfigured(
            f"{name} must be a URL starting with {' or '.join(s + '://' for s in schemes)}; got {_redact(value)!r}."
        )
    return value


def path(name: str, default: Path, base: Path) -> Path:
    value = string(name)
    chosen = Path(value).expanduser() if value else default
    return chosen if chosen.is_absolute() else (base / chosen).resolve()


def persistent_secret(file: Path) -> str:
    """A secret generated once into ``file`` (mode 0600) and read back on every later start."""
    try:
        existing = file.read_text().strip()
    except FileNotFoundError:
        existing = ""
    if existing:
        return existing
    file.parent.mkdir(parents=True, exist_ok=True)
    generated = secrets.token_urlsafe(50)
    # O_EXCL: if two processes start at once, one writes and the other reads what it wrote.
    try:
        fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return file.read_text().strip()
    with os.fdopen(fd, "w") as handle:
        handle.write(generated)
    return generated


def _redact(value: str) -> str:
    """Hide a password in a URL before it goes into an error message."""
    if "@" in value and "://" in value:
        scheme, rest = value.split("://", 1)
        credentials, host = rest.rsplit("@", 1)
        user = credentials.split(":", 1)[0]
        return f"{scheme}://{user}:***@{host}"
    return value
