"""Serve a model from the hub in one command: one job, each step printed as it changes."""

import time

from django.core.management.base import BaseCommand, CommandError

from berth.errors import BerthError
from serving.catalog import fetch
from serving.control import serve_model as serve
from serving.models import FetchJob
from tenancy.audit import Actor

MARKS = {"running": "..", "done": "ok", "failed": "!!", "skipped": "--"}


class Command(BaseCommand):
    help = "Fetch OWNER/REPO from the hub, verify it, add it to the catalog, deploy it and smoke-test it."

    def add_arguments(self, parser):
        parser.add_argument("repo", help="owner/name on the hub (HF_ENDPOINT)")
        parser.add_argument("--revision", default="main")
        parser.add_argument("--quant", default=None, help="quantisation (Q4_K_M by default for GGUF)")
        parser.add_argument("--file", default=None, help="a file set or file of the repository")
        parser.add_argument("--name", default=None, help="the model name clients ask for")
        parser.add_argument("--node", default="", help="the node to run it on (default: the first)")
        parser.add_argument("--context", type=int, default=4096)
        parser.add_argument("--on-demand", action="store_true", help="add it to the catalog without a replica")
        parser.add_argument("--here", action="store_true",
                            help="run the job in this process instead of the control queue's worker")

    def handle(self, *args, **options):
        request = fetch.FetchRequest(repo=options["repo"], revision=options["revision"], quant=options["quant"],
                                     file=options["file"], name=options["name"])
        try:
            job = serve.start(Actor(system="serve_model"), request, on_demand=options["on_demand"],
                              node=options["node"], context=options["context"], enqueue=not options["here"])
        except BerthError as error:
            raise CommandError(f"!! resolve: {error.message}") from error
        printed: dict[str, str] = {}
        self._print(job, printed)
        if options["here"]:
            job = serve.run(job)
        else:
            self.stdout.write(f"job {job.public_id} runs on the control queue; Ctrl-C stops following, not the job")
            while job.status in (FetchJob.Status.QUEUED, FetchJob.Status.RUNNING):
                time.sleep(2)
                job.refresh_from_db()
                self._print(job, printed)
        self._print(job, printed)
        if job.status != FetchJob.Status.DONE:
            raise CommandError(f"{job.repo} is not served: {job.error}")
        self.stdout.write(self.style.SUCCESS(f"{job.result.get('model')} is served."))

    def _print(self, job, printed):
        job.refresh_from_db()
        for step in job.steps:
            key = f"{step['state']}:{step['detail']}"
            if step["state"] != "waiting" and printed.get(step["name"]) != key:
                printed[step["name"]] = key
                self.stdout.write(f"{MARKS.get(step['state'], '  ')} {step['name']}: {step['detail']}".rstrip(": "))
