"""Node trust for an operator on the control plane: enrolment tokens, node credentials, revocation."""

from __future__ import annotations

import json
import os
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from berth.errors import BerthError
from scheduler import enrolment
from scheduler.models import EnrolmentToken, Node
from tenancy.audit import Actor

ACTOR = Actor(system="nodes")


def write_private(path: Path, text: str) -> None:
    """``text`` into ``path``, readable by its owner only (0600) from the first byte: written beside it
    and moved into place, so no reader ever finds a half-written or wider file."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(descriptor, 0o600)  # whatever the umask
        with os.fdopen(descriptor, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


class Command(BaseCommand):
    help = "Enrol nodes (one-time tokens), issue a node's credential, revoke one, list them."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)

        enrol = sub.add_parser("enrol", help="Issue a one-time enrolment token and print the agent's command line.")
        enrol.add_argument("--name", default="", help="The node it enrols (default: the agent says its own).")
        enrol.add_argument("--existing", default=None, metavar="NAME",
                           help="A registered node: the token issues a new credential for it (how a node from "
                                "before enrolment, or a revoked one, gets one).")
        enrol.add_argument("--expires-minutes", type=int, default=60, help="How long it is valid (default 60).")
        enrol.add_argument("--server", default=None,
                           help=f"The URL agents reach this server at (default BERTH_CONTROL_URL, "
                                f"{settings.SERVING_CONTROL_URL}).")

        credential = sub.add_parser("credential", help="Issue a node's credential (replacing any it had).")
        credential.add_argument("name")
        credential.add_argument("--write", default=None, metavar="PATH",
                                help='Write {"node", "credential"[, "server"]} to PATH, mode 0600, instead of '
                                     'printing the credential.')
        credential.add_argument("--server", default=None, help='Add "server": URL to the file.')
        credential.add_argument("--address", default="",
                                help="Register the node with this address when no node has the name yet.")

        revoke = sub.add_parser("revoke", help="Revoke a node's credential: its agent is refused from now on.")
        revoke.add_argument("name")

        sub.add_parser("list", help="The nodes with their credentials' state, and the tokens not yet used.")

    def handle(self, *args, action, **options):
        try:
            getattr(self, f"do_{action}")(**options)
        except BerthError as error:
            details = f" {error.details}" if error.details else ""
            raise CommandError(f"{error.message} [{error.code}]{details}") from error

    def do_enrol(self, name, existing, expires_minutes, server, **_):
        if expires_minutes < 1:
            raise CommandError("--expires-minutes must be at least 1.")
        token, plaintext = enrolment.issue_token(ACTOR, name=name, existing=existing,
                                                 ttl_seconds=expires_minutes * 60)
        server = (server or settings.SERVING_CONTROL_URL).rstrip("/")
        who = f"node {token.name}" if token.name else "a node the agent names"
        self.stdout.write(f"Enrolment token for {who}, valid once until {token.expires_at:%Y-%m-%d %H:%M %Z} "
                          f"(shown once; Berth keeps only a hash of it):")
        self.stdout.write(plaintext)
        self.stdout.write("On the node, run:")
        self.stdout.write(f"  manage.py agent --server {server} --token {plaintext}")

    def do_credential(self, name, write, server, address, **_):
        plaintext = enrolment.issue_credential(ACTOR, name, address=address)
        if write is None:
            self.stdout.write(f"Credential of node {name} (shown once; Berth keeps only a hash of it):")
            self.stdout.write(plaintext)
            return
        document = {"node": name, "credential": plaintext}
        if server:
            document["server"] = server.rstrip("/")
        path = Path(write).expanduser()
        write_private(path, json.dumps(document, indent=2) + "\n")
        self.stdout.write(self.style.SUCCESS(f"Wrote node {name}'s credential to {path} (mode 0600)."))

    def do_revoke(self, name, **_):
        node = enrolment.revoke(ACTOR, enrolment.node_named(name))
        self.stdout.write(self.style.SUCCESS(f"Node {node.name}'s credential is revoked "
                                             f"({node.revoked_at:%Y-%m-%d %H:%M:%S %Z})."))

    def do_list(self, **_):
        nodes = list(Node.objects.order_by("name"))
        width = max([len(n.name) for n in nodes] + [4])
        self.stdout.write(f"{'NAME':<{width}}  {'STATE':<9}  {'CREDENTIAL':<10}  SINCE")
        for node in nodes:
            since = node.revoked_at or node.credential_issued_at
            written = f"{since:%Y-%m-%d %H:%M}" if since else "-"
            self.stdout.write(f"{node.name:<{width}}  {node.state:<9}  {node.credential_state:<10}  {written}")
        pending = [t for t in EnrolmentToken.objects.select_related("node").filter(used_at__isnull=True)
                   if t.state() == "pending"]
        if pending:
            self.stdout.write("")
            self.stdout.write("Tokens not yet used:")
            now = timezone.now()
            for token in pending:
                minutes = int((token.expires_at - now).total_seconds() // 60)
                self.stdout.write(f"  bne_{token.lookup}_…  {token.name or '(the agent names it)'}  "
                                  f"expires in {minutes} min  by {token.created_by}")
