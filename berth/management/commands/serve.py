import sys
import urllib.request

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from berth.supervisor import Supervisor
from berth.web import uvicorn_command
from serving.models import Deployment


class Command(BaseCommand):
    help = "Run the web server (uvicorn), a Celery worker, Celery beat and the node agent as one group; Ctrl-C stops all."

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1", help="Address the web server binds (default 127.0.0.1).")
        parser.add_argument("--port", type=int, default=8000, help="Port of the web server (default 8000).")
        parser.add_argument("--concurrency", type=int, default=2, help="Worker processes of the Celery worker.")
        parser.add_argument("--no-worker", action="store_true", help="Do not run the Celery worker.")
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
        if not no_beat:
            programs["beat"] = [*celery, "beat", "--loglevel", level,
                                "--scheduler", "django_celery_beat.schedulers:DatabaseScheduler"]

        if not no_agent:
            programs["agent"] = [python, str(settings.BASE_DIR / "manage.py"), "agent"]

        shown_host = f"[{host}]" if ":" in host else host
        url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else shown_host}:{port}/"
        announced = False
        ready_models: set[str] = set()
        ticks = 0

        def announce_when_up():
            nonlocal announced, ticks
            ticks += 1
            if not announced:
                try:
                    with urllib.request.urlopen(url + "healthz", timeout=1) as response:
                        announced = response.status == 200
                except OSError:
                    return
                if announced:
                    self.stdout.write(self.style.SUCCESS(f"\n  Berth console: {url}\n  Press Ctrl-C to stop.\n"))
            if ticks % 8 == 0:  # every two seconds: say when a model becomes ready to serve
                self._announce_models(ready_models)

        status = Supervisor(programs, out=self.stdout).run(on_tick=announce_when_up)
        if status:
            raise CommandError(f"Berth stopped because a program failed (status {status}); see its output above.",
                               returncode=status)

    def _announce_models(self, already: set[str]) -> None:
        from django.db import close_old_connections

        close_old_connections()
        for name in Deployment.objects.filter(state="ready").values_list("name", flat=True):
            if name not in already:
                already.add(name)
                self.stdout.write(self.style.SUCCESS(f"\n  Model {name} is ready.\n"))
