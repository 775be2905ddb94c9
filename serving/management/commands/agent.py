import os
import socket
import sys

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError


class Command(BaseCommand):
    help = "Run this machine's node agent: a Celery worker on the queue node.NAME plus a heartbeat."

    def add_arguments(self, parser):
        parser.add_argument("--node", default=None, help="This node's name (default: BERTH_NODE_NAME or the host name).")
        parser.add_argument("--concurrency", type=int, default=4, help="Engine operations at once (default 4).")

    def handle(self, *args, node, concurrency, **options):
        name = node or settings.NODE_NAME or socket.gethostname()
        if not name or len(name) > 200 or any(c.isspace() for c in name):
            raise CommandError(f"{name!r} is not a node name.")
        if concurrency < 1:
            raise CommandError("--concurrency must be at least 1.")
        os.environ["BERTH_AGENT_NODE"] = name
        os.environ["BERTH_NODE_NAME"] = name
        # Threads, not forked children: engines are started by long-lived workers whose runtime
        # objects keep their handles, and a recycled child would orphan its engines' bookkeeping.
        argv = [sys.executable, "-m", "celery", "-A", "berth.celery", "worker", "-Q", f"node.{name}",
                "-n", f"agent@{name}", "--pool", "threads", "--concurrency", str(concurrency),
                "--loglevel", settings.LOG_LEVEL, "--without-mingle", "--without-gossip"]
        os.execv(sys.executable, argv)
