import http.client
import socket
import sys
import urllib.request
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import InterfaceError, OperationalError, close_old_connections

from berth.supervisor import Supervisor
from berth.web import uvicorn_command
from scheduler import enrolment
from serving.node.client import CLUSTER_SETTINGS, Credential
from serving.models import Deployment, DeploymentState
from tenancy.audit import Actor


class Command(BaseCommand):
    help = ("Run the web server (uvicorn), a Celery worker, Celery beat and the node agent as one group: a program "
            "that exits is started again (with backoff) and the others run on; Ctrl-C stops all.")

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1", help="Address the web server binds (default 127.0.0.1).")
        parser.add_argument("--port", type=int, default=8000, help="Port of the web server (default 8000).")
        parser.add_argument("--concurrency", type=int, default=2, help="Worker processes of the Celery worker.")
        parser.add_argument("--no-worker", action="store_true",
                            help="Do not run the Celery workers (the control one and the batch one).")
        parser.add_argument("--no-beat", action="store_true", help="Do not run Celery beat.")
        parser.add_argument("--no-agent", action="store_true", help="Do not run this machine's node agent.")

    def handle(self, *args, host, port, concurrency, no_worker, no_beat, no_agent, **options):
        if not 0 < port < 65536:
            raise CommandError(f"--port {port} is not a TCP port (1-65535).")
        if concurrency < 1:
            raise CommandError("--concurrency must be at least 1.")
        python = sys.executable
        programs = {"web": uvicorn_command(host, port)}
        celery = [python, "-m", "celery", "-A", "berth.celery"]
        level = settings.LOG_LEVEL
        if not no_worker:
            programs["worker"] = [*celery, "worker", "-Q", settings.CELERY_TASK_DEFAULT_QUEUE, "-n", "control@%h",
                                  "--concurrency", str(concurrency), "--loglevel", level, "--without-mingle",
                                  "--without-gossip"]
            # The Batch API's runs (gateway.batch.runner): threads, each waiting on the gateway most of the time.
            programs["batches"] = [*celery, "worker", "-Q", settings.BATCH_QUEUE, "-n", "batch@%h", "--pool", "threads",
                                   "--concurrency", "4", "--loglevel", level, "--without-mingle", "--without-gossip"]
        if not no_beat:
            programs["beat"] = [*celery, "beat", "--loglevel", level,
                                "--scheduler", "django_celery_beat.schedulers:DatabaseScheduler"]

        shown_host = f"[{host}]" if ":" in host else host
        url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else shown_host}:{port}/"
        if not no_agent:
            # This machine's agent talks to this web server over loopback, with a credential of its own
            # (the same node API, the same code path, as every other node's).
            credential = local_agent_credential(url.rstrip("/"), self.stderr)
            unset = [arg for name in CLUSTER_SETTINGS for arg in ("-u", name, "-u", f"{name}_FILE")]
            programs["agent"] = ["env", *unset, python, str(settings.BASE_DIR / "manage.py"), "agent",
                                 "--credential-file", str(credential)]
        supervisor = Supervisor(programs, out=self.stdout)
        supervisor.run(on_tick=Announcer(url, supervisor.write, self.style))


def local_agent_credential(server: str, err) -> Path:
    """A fresh credential for this machine's own node, written where its agent reads it (mode 0600).
    With the database away the one written before is used (the agent waits for the server anyway)."""
    path = Path(settings.NODE_CREDENTIAL_FILE)
    name = settings.NODE_NAME or socket.gethostname()
    try:
        secret = enrolment.issue_credential(Actor(system="serve"), name, address=settings.NODE_ADDRESS)
    except (InterfaceError, OperationalError) as error:
        if not path.is_file():
            raise CommandError(f"The database does not answer ({error}), and this machine's agent has no credential "
                               f"yet at {path}: start serve again once the database is up.") from None
        err.write(f"The database does not answer ({error}); this machine's agent uses its credential of before.")
        return path
    Credential(server=server, node=name, credential=secret).save(path)
    return path


def ready_model_names() -> list[str]:
    return list(Deployment.objects.filter(state=DeploymentState.READY).values_list("name", flat=True))


class Announcer:
    """What `serve` says while its programs run, called by the supervisor every quarter second:
    the console's URL once the web server answers, and each model as it becomes ready to serve.

    A database that does not answer is said once per outage and asked again every two seconds:
    `serve` waits it out and every program keeps running (one that exits meanwhile is restarted
    by the supervisor).
    """

    MODELS_EVERY = 8  # ticks: every two seconds

    def __init__(self, url: str, write, style):
        self.url = url
        self.write = write
        self.style = style
        self.announced = False
        self.ready: set[str] = set()
        self.ticks = 0
        self.database_away = False

    def __call__(self) -> None:
        self.ticks += 1
        if not self.announced and self._web_answers():
            self.announced = True
            self.write(self.style.SUCCESS(f"\n  Berth console: {self.url}\n  Press Ctrl-C to stop.\n"))
        if self.ticks % self.MODELS_EVERY == 0:
            self.check_models()

    def _web_answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "healthz", timeout=1) as response:
                return response.status == 200
        except (OSError, http.client.HTTPException):
            return False

    def check_models(self) -> None:
        try:
            close_old_connections()  # one the outage broke is replaced, not reused
            names = ready_model_names()
        except (OperationalError, InterfaceError) as exc:
            if not self.database_away:
                first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                self.write(self.style.WARNING(f"\n  The database does not answer ({first_line}); waiting for it. "
                                              f"Every program keeps running.\n"))
            self.database_away = True
            return
        if self.database_away:
            self.database_away = False
            self.write(self.style.SUCCESS("\n  The database answers again.\n"))
        for name in names:
            if name not in self.ready:
                self.ready.add(name)
                self.write(self.style.SUCCESS(f"\n  Model {name} is ready.\n"))
