"""The node agent: what ``manage.py agent`` runs on every machine with engines, the control plane's
own included (over loopback: one code path). It holds the server's URL and this node's credential
(``serving.node.client``), and nothing else of the cluster.

At start-up it sends a first heartbeat — the control plane adopts what an earlier agent left and
takes back that agent's leases — before it claims any job, so a start it is about to receive is
never mistaken for an interrupted one. Then a beat every few seconds, and ``concurrency`` workers
that long-poll for the node's jobs (``POST /api/node/jobs/claim/``), keep their leases alive while
they work, and report. A control plane away is waited out, retrying; a revoked credential ends the
agent, saying so.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

from serving.node import lifecycle
from serving.node.client import NodeApiError, NodeClient, ServerUnreachable
from serving.node.heartbeat import Heartbeat

log = logging.getLogger(__name__)
CLAIM_WAIT_SECONDS = 10  # how long a claim waits server-side for a job to come
RETRY_SECONDS = (0.5, 1, 2, 5)  # the waits between attempts while the control plane is away
REFUSED = ("node_revoked", "node_credential_invalid")


class Revoked(Exception):
    """The control plane no longer accepts this node's credential."""


class Agent:
    def __init__(self, client: NodeClient, node_name: str, *, concurrency: int = 4):
        self.client = client
        self.node_name = node_name
        self.concurrency = concurrency
        self.instance = uuid.uuid4().hex  # this run of the agent: a claim a dead run left polling is told apart
        self.heartbeat = Heartbeat(client, node_name, self.instance)
        self.stop = threading.Event()
        self.refusal: str | None = None
        self._jobs: dict[str, lifecycle.Job] = {}
        self._jobs_lock = threading.Lock()

    def run(self) -> None:
        """Until ``stop`` is set (a signal) or the credential is refused. Raises ``Revoked`` then."""
        self._until_through(lambda: self.heartbeat.send(first=True), "the first heartbeat")
        log.info("agent of %s ready: %d worker(s) claiming jobs from %s", self.node_name, self.concurrency,
                 self.client.server)
        threads = [threading.Thread(target=self._guarded, args=(self.heartbeat.forever,), name="berth-heartbeat",
                                    daemon=True),
                   threading.Thread(target=self._guarded, args=(self._keep_leases,), name="berth-leases", daemon=True)]
        threads += [threading.Thread(target=self._guarded, args=(self._work,), name=f"berth-worker-{n}", daemon=True)
                    for n in range(self.concurrency)]
        for thread in threads:
            thread.start()
        self.stop.wait()
        if self.refusal:
            raise Revoked(self.refusal)

    def _guarded(self, loop) -> None:
        try:
            loop(self.stop)
        except Revoked as refusal:
            self.refusal = str(refusal)
            self.stop.set()

    def _until_through(self, call, what: str):
        for attempt in range(1_000_000):
            try:
                return call()
            except ServerUnreachable as error:
                wait = RETRY_SECONDS[min(attempt, len(RETRY_SECONDS) - 1)]
                log.warning("%s: %s; trying again in %ss", what, error, wait)
            except NodeApiError as error:
                if error.code in REFUSED:
                    raise Revoked(f"{error.message} ({error.code})") from error
                raise
            if self.stop.wait(wait):
                return None
        return None

    def _work(self, stop: threading.Event) -> None:
        attempt = 0
        while not stop.is_set():
            try:
                data = self.client.post("jobs/claim/", {"wait": CLAIM_WAIT_SECONDS, "agent": self.instance},
                                        timeout=CLAIM_WAIT_SECONDS + 20)
                attempt = 0
            except ServerUnreachable as error:
                wait = RETRY_SECONDS[min(attempt, len(RETRY_SECONDS) - 1)]
                attempt += 1
                log.warning("no job claimed: %s; trying again in %ss", error, wait)
                stop.wait(wait)
                continue
            except NodeApiError as error:
                if error.code in REFUSED:
                    raise Revoked(f"{error.message} ({error.code})") from error
                log.warning("no job claimed: %s (%s)", error.message, error.code)
                stop.wait(RETRY_SECONDS[-1])
                continue
            if data and data.get("job"):
                self._do(lifecycle.Job(self.client, data["job"]))

    def _do(self, job: lifecycle.Job) -> None:
        replica = (job.payload.get("handle") or {}).get("replica_id") or job.payload.get("replica") or ""
        with self._jobs_lock:
            self._jobs[job.id] = job
            if replica:
                self.heartbeat.busy.add(replica)
        started = time.monotonic()
        try:
            lifecycle.run(job, self.node_name)
        except NodeApiError as error:
            if error.code in REFUSED:
                raise Revoked(f"{error.message} ({error.code})") from error
            log.warning("%s: the control plane refused a report: %s (%s)", job, error.message, error.code)
        except ServerUnreachable as error:
            log.warning("%s: the control plane is away (%s); its lease will lapse and the job return", job, error)
        except Exception:  # a bug in one job must not end the worker
            log.exception("%s failed on the node", job)
            try:
                job.fail("the agent failed while doing this job; see the agent's log")
            except (NodeApiError, ServerUnreachable):
                pass
        finally:
            with self._jobs_lock:
                self._jobs.pop(job.id, None)
                self.heartbeat.busy.discard(replica)
            log.info("%s done in %.2fs", job, time.monotonic() - started)

    def _keep_leases(self, stop: threading.Event) -> None:
        """Every few seconds, each job in hand has its lease extended; one the control plane took
        back (expired meanwhile, or returned) is marked lost, and its worker lets it go."""
        while not stop.wait(3):
            with self._jobs_lock:
                jobs = list(self._jobs.values())
            for job in jobs:
                try:
                    self.client.post(f"jobs/{job.id}/lease/", {"lease": job.lease})
                except NodeApiError as error:
                    if error.code in REFUSED:
                        raise Revoked(f"{error.message} ({error.code})") from error
                    log.warning("%s: lease lost (%s)", job, error.code)
                    job.lost = True
                except ServerUnreachable as error:
                    log.warning("%s: lease not extended (%s)", job, error)
