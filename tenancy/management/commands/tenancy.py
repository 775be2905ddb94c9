"""Tenancy for an administrator without a browser: trees, members, clients and keys, contracts."""

from __future__ import annotations

from datetime import timedelta

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from berth.errors import BerthError
from tenancy.audit import Actor
from tenancy.models import Membership, Scope
from tenancy.services import clients, contracts, members, tree
from tenancy.services.contracts import FIELDS


class Command(BaseCommand):
    help = "Manage organisations, members, service clients, API keys and contracts."

    def add_arguments(self, parser):
        parser.add_argument("--as", dest="acting_user", metavar="USER",
                            help="Act as this user (their roles apply). Default: Berth itself, as an administrator.")
        sub = parser.add_subparsers(dest="action", required=True)

        create = sub.add_parser("create-tree", help="Create a scope and any missing scopes above it.")
        create.add_argument("scope", help="e.g. project:acme/ml/search")
        create.add_argument("--name", default="", help="Name of the last scope (default: its slug).")

        member = sub.add_parser("add-member", help="Give a user a role on a scope.")
        member.add_argument("username")
        member.add_argument("scope")
        member.add_argument("role", choices=["owner", "admin", "member", "viewer"])
        member.add_argument("--create-user", action="store_true",
                            help="Create the user when missing (with an unusable password: set one with changepassword).")

        client = sub.add_parser("create-client", help="Create a service client of a project and print a key once.")
        client.add_argument("project", help="e.g. project:acme/ml/search")
        client.add_argument("name")
        client.add_argument("--environment", default="development", choices=["production", "staging", "development"])
        client.add_argument("--access", default="inference", choices=["inference", "management", "both"])
        client.add_argument("--models", default="", help="Comma-separated models it may call (default: all).")
        client.add_argument("--priority", default="normal", choices=["critical", "high", "normal", "low", "batch"])
        client.add_argument("--key-lifetime-days", type=int, default=None, help="Key expiry (default: none).")
        client.add_argument("--no-key", action="store_true", help="Create the client only.")
        client.add_argument("--approval", default=None, help="Approval id (production keys need one).")

        contract = sub.add_parser("set-contract", help="Set figures of a scope's contract.")
        contract.add_argument("scope")
        contract.add_argument("--approval", default=None, help="Approval id, when a limit is raised.")
        for field in FIELDS:
            contract.add_argument(f"--{field.replace('_', '-')}", dest=field, default=None,
                                  help="hard or soft" if field == "budget_mode" else "a number; 'none' clears it")

    def handle(self, *args, action, acting_user=None, **options):
        actor = self._actor(acting_user)
        try:
            getattr(self, "do_" + action.replace("-", "_"))(actor, **options)
        except BerthError as error:
            details = f" {error.details}" if error.details else ""
            raise CommandError(f"{error.message} [{error.code}]{details}") from error

    def _actor(self, username):
        if not username:
            return Actor(system="cli")
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise CommandError(f"No user {username!r}.")
        return Actor(user=user)

    def do_create_tree(self, actor, scope, name, **_):
        kind, _, path = scope.partition(":")
        parts = [p for p in path.strip().strip("/").lower().split("/") if p]
        kinds = ["org", "team", "project"]
        if kind not in kinds or len(parts) != kinds.index(kind) + 1:
            raise CommandError("Write the scope as org:ORG, team:ORG/TEAM or project:ORG/TEAM/PROJECT.")
        parent = None
        with transaction.atomic():
            for depth, slug in enumerate(parts):
                path_so_far = "/".join(parts[:depth + 1])
                existing = Scope.objects.filter(path=path_so_far).first()
                if existing is not None:
                    parent = existing
                    continue
                last = depth == len(parts) - 1
                parent = tree.create_scope(actor, kinds[depth], slug, name if last and name else slug, parent=parent)
                self.stdout.write(f"created {parent.written} ({parent.public_id})")
        self.stdout.write(self.style.SUCCESS(f"{parent.written} is ready."))

    def do_add_member(self, actor, username, scope, role, create_user, **_):
        User = get_user_model()
        user = User.objects.filter(username=username).first()
        if user is None:
            if not create_user:
                raise CommandError(f"No user {username!r} (add --create-user to create one).")
            user = User.objects.create_user(username)  # unusable password until `changepassword`
            self.stdout.write(f"created user {username} (set a password with `manage.py changepassword {username}`)")
        target = tree.resolve_scope(scope)
        existing = Membership.objects.filter(user=user, scope=target).first()
        if existing:
            members.change_role(actor, existing, role)
        else:
            members.add_member(actor, target, user, role)
        self.stdout.write(self.style.SUCCESS(f"{username} is {role} of {target.written}."))

    def do_create_client(self, actor, project, name, environment, access, models, priority, key_lifetime_days,
                         no_key, approval, **_):
        allowed = [m.strip() for m in models.split(",") if m.strip()]
        if key_lifetime_days is not None and key_lifetime_days < 1:
            raise CommandError("--key-lifetime-days must be at least 1.")
        target = tree.resolve_scope(project)
        client = clients.create_client(actor, target, name, environment=environment, access=access,
                                       all_models=not allowed, allowed_models=allowed, priority=priority)
        self.stdout.write(f"created client {client} ({client.public_id})")
        if no_key:
            return
        lifetime = timedelta(days=key_lifetime_days) if key_lifetime_days else None
        credential, plaintext = clients.create_credential(actor, client, name="cli", lifetime=lifetime,
                                                          approval=approval)
        self.stdout.write("API key (shown once; Berth keeps only a hash of it):")
        self.stdout.write(plaintext)

    def do_set_contract(self, actor, scope, approval, **options):
        figures = {}
        for field in FIELDS:
            value = options.get(field)
            if value is not None:
                figures[field] = None if str(value).lower() == "none" else value
        if not figures:
            raise CommandError("Give at least one figure, e.g. --gpu-memory-gib-limit 160.")
        target = tree.resolve_scope(scope)
        contract = contracts.set_contract(actor, target, approval=approval, **figures)
        shown = ", ".join(f"{f}={getattr(contract, f)}" for f in FIELDS if getattr(contract, f) is not None)
        self.stdout.write(self.style.SUCCESS(f"contract of {target.written}: {shown}"))
