import secrets

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.db import transaction

from serving.node.registration import register_local_node


class Command(BaseCommand):
    help = "First-run setup: create the first administrator (password printed once) and register this machine."

    def add_arguments(self, parser):
        parser.add_argument("--username", default="admin", help="User name of the first administrator.")

    def handle(self, *args, username, **options):
        User = get_user_model()
        with transaction.atomic():
            existing = User.objects.select_for_update().filter(is_superuser=True).order_by("pk").first()
            if existing is None:
                password = secrets.token_urlsafe(18)
                User.objects.create_superuser(username=username, email="", password=password)
        if existing is None:
            # Straight to the terminal, never through logging: it is shown this once and stored hashed.
            self.stdout.write(self.style.SUCCESS("First administrator created. Keep this password; it is not shown again:"))
            self.stdout.write(f"  user name: {username}\n  password:  {password}")
        else:
            self.stdout.write(f"An administrator exists ({existing.get_username()}); "
                              f"reset a password with `manage.py changepassword {existing.get_username()}`.")
        node = register_local_node()
        engines = ", ".join(f"{e.kind} {e.version}" for e in node.engines.all()) or "no engines yet"
        self.stdout.write(f"Node {node.name} registered ({node.cpu_count or '?'} CPUs; {engines}).")
