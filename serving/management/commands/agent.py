import logging
import signal
import socket
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from serving.node import agent as node_agent
from serving.node.client import Credential, NodeApiError, NodeClient, ServerUnreachable, enrol

log = logging.getLogger("serving.node.agent")


class Command(BaseCommand):
    help = ("Run this machine's node agent. It talks to the control plane through the node API with this node's "
            "own credential and nothing else: enrol it once with --server and --token, then run it as is.")

    def add_arguments(self, parser):
        parser.add_argument("--server", default=None,
                            help="The control plane's URL (default: the one in the credential file).")
        parser.add_argument("--token", default=None, help="A one-time enrolment token (manage.py nodes enrol): "
                                                           "exchanged for this node's credential, then spent.")
        parser.add_argument("--credential-file", default=None,
                            help=f"Where this node's credential is kept, mode 0600 (default: "
                                 f"BERTH_NODE_CREDENTIAL_FILE, {settings.NODE_CREDENTIAL_FILE}).")
        parser.add_argument("--ca-file", default=None,
                            help="CA certificates to verify an https server with (default: the system's).")
        parser.add_argument("--node", default=None,
                            help="This node's name when it enrols (default: BERTH_NODE_NAME or the host name).")
        parser.add_argument("--concurrency", type=int, default=4, help="Jobs worked on at once (default 4).")
        parser.add_argument("--enrol-only", action="store_true",
                            help="Exchange --token for this node's credential, keep it, and exit (the service "
                                 "runs the agent from then on).")

    def handle(self, *args, server, token, credential_file, ca_file, node, concurrency, enrol_only, **options):
        if concurrency < 1:
            raise CommandError("--concurrency must be at least 1.")
        path = Path(credential_file or settings.NODE_CREDENTIAL_FILE)
        ca_file = ca_file or settings.NODE_CA_FILE or None
        if ca_file and not Path(ca_file).is_file():
            raise CommandError(f"--ca-file {ca_file} is not a file.")
        if enrol_only and not token:
            raise CommandError("--enrol-only needs --token (and --server).")
        credential = self._credential(path, server, token, node, ca_file)
        if enrol_only:
            return
        client = NodeClient(credential, ca_file=ca_file)
        agent = node_agent.Agent(client, credential.node, concurrency=concurrency)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: agent.stop.set())
        try:
            agent.run()
        except node_agent.Revoked as refusal:
            raise CommandError(f"The control plane refuses this node's credential: {refusal}. Enrol it again "
                               f"(manage.py nodes enrol --existing {credential.node}).") from None
        finally:
            client.close()

    def _credential(self, path: Path, server: str | None, token: str | None, node: str | None,
                    ca_file: str | None) -> Credential:
        if token:
            if not server:
                raise CommandError("--token needs --server: the control plane it enrols with.")
            name = node or settings.NODE_NAME or socket.gethostname()
            try:
                credential = enrol(server, token, name=name, address=settings.NODE_ADDRESS, ca_file=ca_file)
            except NodeApiError as error:
                raise CommandError(f"Enrolment refused: {error.message} ({error.code})") from None
            except ServerUnreachable as error:
                raise CommandError(f"Enrolment not done: {error}") from None
            credential.save(path)
            self.stdout.write(f"Enrolled as node {credential.node}; its credential is in {path} (mode 0600).")
            return credential
        if not path.is_file():
            raise CommandError(f"No credential at {path}: enrol this node first (manage.py agent --server URL "
                               "--token TOKEN, with a token from manage.py nodes enrol).")
        try:
            credential = Credential.load(path)
        except (OSError, ValueError, KeyError) as error:
            raise CommandError(f"The credential file {path} cannot be read: {error}") from None
        if server:
            credential = Credential(server=server.rstrip("/"), node=credential.node, credential=credential.credential)
        if not credential.server:
            raise CommandError(f"The credential file {path} names no server: give --server URL.")
        return credential
