"""`manage.py doctor [--json]`: what is wrong with this control plane or node, and what to do about it.

Each check has a verdict (ok / warning / failed), what it found and what to do. The exit status is 1
when any check failed. Run it on the control plane (database, broker, control loop, clock) and on a
node (engines, GPUs, model roots, where engines listen); every check runs on both.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import connection

from berth import broker, health
from scheduler import nvml
from serving.engines import installed
from serving.node.client import Credential, NodeApiError, NodeClient, ServerUnreachable
from serving.runtimes.process import ProcessRuntime

OK, WARNING, FAILED = "ok", "warning", "failed"
SKEW_WARNING_S, SKEW_FAILED_S = 2.0, 30.0
DISK_WARNING_BYTES, DISK_FAILED_BYTES = 10 * 1024**3, 1024**3
LISTEN = "0A"  # the TCP state of a listening socket in /proc/net/tcp


def _check(name, verdict, found, advice=""):
    return {"name": name, "verdict": verdict, "found": found, "advice": advice}


def database():
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except Exception as exc:  # noqa: BLE001 - any failure is the finding
        return _check("database", FAILED, f"{connection.vendor} does not answer: {exc}",
                      "Start the database or fix DATABASE_URL / BERTH_DATA_DIR, then run `manage.py migrate`.")
    return _check("database", OK, f"{connection.vendor} answers")


def broker_check():
    url = settings.CELERY_BROKER_URL.split("://")[0]
    try:
        broker.check()
    except Exception as exc:  # noqa: BLE001 - any failure is the finding
        return _check("broker", FAILED, f"the {url} broker cannot be reached: {exc}",
                      "Start Redis (or fix REDIS_URL); without the broker no task runs and nothing is placed.")
    return _check("broker", OK, f"the {url} broker accepts connections")


def control_loop():
    try:
        status, detail = health.control_loop(started_at=0)  # doctor's own start says nothing of beat's
    except Exception as exc:  # noqa: BLE001 - the cache is down: the loop's mark cannot be read
        return _check("control_loop", FAILED, f"its last pass cannot be read from the cache: {exc}",
                      "Start Redis (or fix REDIS_URL): the control loop records its passes there.")
    age, stale = detail.get("last_pass_age_s"), detail.get("stale_after_s")
    holder = f"; the control loop's lease is held by {detail['holder']}" if detail.get("holder") else ""
    if status == "ok":
        return _check("control_loop", OK, f"last pass {age} s ago (stale after {stale} s){holder}")
    if status == "starting":
        return _check("control_loop", WARNING, f"no pass recorded yet (this process started under {stale} s ago)",
                      "Wait one beat interval, then run doctor again.")
    if status == "not_scheduled":
        return _check("control_loop", FAILED, f"CELERY_BEAT_SCHEDULE has no {health.CONTROL_TASK!r} entry",
                      "Restore the serving.reconcile beat entry in settings.")
    found = ("no pass was ever recorded (a Berth started under a minute ago may not have passed yet)"
             if status == "never_ran"
             else f"last pass {age} s ago, more than {stale} s ({health.MISSED_PASSES} missed passes){holder}")
    return _check("control_loop", FAILED, found,
                  "Start Celery beat and a worker on the control queue (`manage.py serve` runs both); "
                  "check their logs, and check the beat entry is not paused in the admin.")


def engines():
    try:
        reports = installed.local_engines()
    except Exception as exc:  # noqa: BLE001 - an engine that cannot be asked its version is the finding
        return _check("engines", FAILED, f"the engines could not be read: {exc}",
                      "Rebuild with `manage.py engines build llamacpp --force`.")
    cache = settings.ENGINE_CACHE_DIR
    if not reports:
        return _check("engines", FAILED, f"no engine installed under {cache}",
                      "Build llama-server with `manage.py engines build llamacpp` "
                      "(or point BERTH_ENGINE_CACHE at the cache that has it).")
    broken = [r for r in reports if getattr(r, "state", "") == "broken"]
    found = ", ".join(f"{r.kind} {r.version} ({r.path})" for r in reports)
    if broken:
        return _check("engines", FAILED, found + "; " + "; ".join(r.detail for r in broken),
                      "Rebuild with `manage.py engines build llamacpp --force`.")
    return _check("engines", OK, found)


def gpus():
    found = nvml.discover_gpus()
    if not found.gpus:
        return _check("gpus", OK, f"no GPU found: {found.note or 'nothing to read'}",
                      "Nothing to do on a CPU-only machine; on a GPU node install the NVIDIA driver and pynvml.")
    lines, unhealthy = [], []
    for gpu in found.gpus:
        mig = (f"MIG on, {len(gpu.mig_instances)} instance(s): "
               + ", ".join(i.profile for i in gpu.mig_instances)) if gpu.mig_enabled else "MIG off"
        lines.append(f"GPU {gpu.index} {gpu.name}: {mig}")
        if gpu.healthy is False:
            unhealthy.append(f"GPU {gpu.index}: {gpu.health_reason}")
    driver = f" (driver {found.driver_version}, via {found.source})" if found.driver_version else f" (via {found.source})"
    if unhealthy:
        return _check("gpus", WARNING, "; ".join(lines + unhealthy) + driver,
                      "Look at `nvidia-smi -q` for the unhealthy card; cordon the node if it keeps failing.")
    if any(gpu.mig_enabled and not gpu.mig_instances for gpu in found.gpus):
        return _check("gpus", WARNING, "; ".join(lines) + driver,
                      "MIG is on with no instances: create them (`nvidia-smi mig -cgi ... -C`) or turn MIG off.")
    return _check("gpus", OK, "; ".join(lines) + driver)


def model_roots():
    found, verdict, advice = [], OK, ""
    for root in settings.SCHEDULER_MODEL_ROOTS:
        root = Path(root)
        where = root
        while not where.exists() and where != where.parent:
            where = where.parent
        free = shutil.disk_usage(where).free
        found.append(f"{root}: {free / 1024**3:.1f} GiB free" + ("" if root.exists() else " (missing)"))
        if free < DISK_FAILED_BYTES:
            verdict, advice = FAILED, "Free space in the model roots or add a root (BERTH_MODEL_ROOTS)."
        elif (free < DISK_WARNING_BYTES or not root.exists()) and verdict == OK:
            verdict = WARNING
            advice = ("Create the missing model root." if not root.exists()
                      else "Less than 10 GiB free: a new model may not fit.")
    return _check("model_roots", verdict, "; ".join(found) or "no model roots configured", advice)


def clock_skew():
    try:
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                cursor.execute("SELECT extract(epoch FROM clock_timestamp())")
            else:
                cursor.execute("SELECT (julianday('now') - 2440587.5) * 86400.0")
            before, (theirs,), after = time.time(), cursor.fetchone(), time.time()
    except Exception as exc:  # noqa: BLE001 - the database check says why
        return _check("clock_skew", FAILED, f"the database's clock cannot be read: {exc}", "Fix the database first.")
    skew = float(theirs) - (before + after) / 2
    found = f"the database's clock is {skew:+.2f} s from this machine's"
    if abs(skew) >= SKEW_FAILED_S:
        return _check("clock_skew", FAILED, found, "Run NTP (chrony or systemd-timesyncd) on both machines: "
                      "heartbeats and the control loop's staleness are judged by the clock.")
    if abs(skew) >= SKEW_WARNING_S:
        return _check("clock_skew", WARNING, found, "Run NTP (chrony or systemd-timesyncd) on both machines.")
    return _check("clock_skew", OK, found)


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process ``pid`` listens on, from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").glob("*"):
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] != LISTEN or fields[9] not in inodes:
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            # /proc writes each 32-bit word in host (little-endian) order.
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found.append((socket.inet_ntop(family, raw), int(port, 16)))
    return found


def engine_listeners(handles=None):
    handles = ProcessRuntime().managed() if handles is None else handles
    if not handles:
        return _check("engine_listeners", OK, "no managed engine runs on this machine")
    allowed = {"127.0.0.1", "::1", settings.NODE_ADDRESS}
    found, wide = [], []
    for handle in handles:
        for address, port in listening_sockets(handle.pid):
            found.append(f"replica {handle.replica_id} (pid {handle.pid}) on {address}:{port}")
            if address not in allowed:
                wide.append(f"{address}:{port}")
    if wide:
        return _check("engine_listeners", FAILED, "; ".join(found),
                      f"Engines must bind the node address ({settings.NODE_ADDRESS}) or loopback, not "
                      f"{', '.join(wide)}: set BERTH_NODE_ADDRESS and restart the replicas.")
    return _check("engine_listeners", OK, "; ".join(found) or "managed engines run but listen on nothing yet")


def node_credential():
    """This machine's agent: its credential file, and whether the control plane it names answers and
    accepts it (``GET /api/node/self/``)."""
    path = Path(settings.NODE_CREDENTIAL_FILE)
    if not path.is_file():
        return _check("node_credential", WARNING, f"no node credential at {path}",
                      "On a node, enrol it: `manage.py agent --server URL --token T` (a token from `manage.py nodes "
                      "enrol` on the control plane). Nothing to do on a control plane that runs no agent.")
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        return _check("node_credential", FAILED, f"{path} is readable by others (mode {mode:o})",
                      f"chmod 600 {path}: the credential is this node's only key to the control plane.")
    try:
        credential = Credential.load(path)
        client = NodeClient(credential, ca_file=settings.NODE_CA_FILE or None)
        try:
            found = client.get("self/")
        finally:
            client.close()
    except (OSError, ValueError, KeyError) as exc:
        return _check("node_credential", FAILED, f"{path} cannot be read: {exc}", "Enrol the node again.")
    except ServerUnreachable as exc:
        return _check("node_credential", FAILED, str(exc),
                      "Start the control plane's web server, or fix the server URL (enrol again with --server), "
                      "the network or the CA file (BERTH_NODE_CA_FILE).")
    except NodeApiError as exc:
        return _check("node_credential", FAILED,
                      f"{credential.server} refuses the credential: {exc.message} ({exc.code})",
                      f"Enrol the node again: `manage.py nodes enrol --existing {credential.node}` on the control "
                      "plane, then `manage.py agent --server URL --token T` here.")
    return _check("node_credential", OK, f"{credential.server} knows this node as {found['name']} ({found['state']})")


CHECKS = [database, broker_check, control_loop, engines, gpus, model_roots, clock_skew, engine_listeners,
          node_credential]


def run_checks() -> list[dict]:
    results = []
    for check in CHECKS:
        try:
            results.append(check())
        except Exception as exc:  # noqa: BLE001 - one broken check must not hide the others
            results.append(_check(check.__name__, FAILED, f"the check itself failed: {exc}", "Report this as a bug."))
    return results


class Command(BaseCommand):
    help = "Check the database, broker, control loop, engines, GPUs, model roots, clock and engine ports."

    def add_arguments(self, parser):
        parser.add_argument("--json", action="store_true", help="Print the checks as JSON.")

    def handle(self, *args, **options):
        results = run_checks()
        failed = [r["name"] for r in results if r["verdict"] == FAILED]
        if options["json"]:
            self.stdout.write(json.dumps({"ok": not failed, "checks": results}, indent=2))
        else:
            marks = {OK: "ok     ", WARNING: "warning", FAILED: "FAILED "}
            for r in results:
                self.stdout.write(f"{marks[r['verdict']]} {r['name']}: {r['found']}")
                if r["advice"] and r["verdict"] != OK:
                    self.stdout.write(f"        → {r['advice']}")
        if failed:
            raise CommandError(f"{len(failed)} check(s) failed: {', '.join(failed)}", returncode=1)

