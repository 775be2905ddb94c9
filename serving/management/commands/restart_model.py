"""A rolling restart of catalog models from the shell (``serving.catalog.restarts``)."""

import time

from django.core.management.base import BaseCommand, CommandError

from berth.errors import BerthError
from serving.catalog import restarts
from serving.models import ModelEntry
from tenancy.audit import Actor


class Command(BaseCommand):
    help = ("Replace each replica of MODEL by a fresh one, one at a time, the new one ready before the old stops. "
            "With --wait, follow it until every replica is replaced, printing where it stands when that changes.")

    def add_arguments(self, parser):
        parser.add_argument("model", help="the catalog model's name")
        parser.add_argument("--wait", action="store_true", help="follow it until it is done (Ctrl-C stops following)")
        parser.add_argument("--timeout", type=float, default=1800, help="with --wait: give up following after this "
                                                                        "many seconds (the restart goes on)")

    def handle(self, *args, model, wait, timeout, **options):
        entry = ModelEntry.objects.filter(name=model).first()
        if entry is None:
            raise CommandError(f"no catalog model is named {model!r}")
        try:
            entry = restarts.restart(Actor(system="restart_model"), entry)
        except BerthError as error:
            raise CommandError(f"{error.code}: {error.message}") from error
        self.stdout.write(f"{entry.name}: a rolling restart is under way")
        said, deadline = None, time.monotonic() + timeout
        while wait:
            entry.refresh_from_db()
            where = restarts.progress(entry)
            if where is None:
                self.stdout.write(self.style.SUCCESS(f"{entry.name}: every replica is replaced"))
                return
            line = f"{where['replicas_left']} left · {where['state']}: {where['detail']}"
            if line != said:
                self.stdout.write(line)
                said = line
            if time.monotonic() > deadline:
                raise CommandError(f"still under way after {timeout:.0f} s: {line}")
            time.sleep(2)
