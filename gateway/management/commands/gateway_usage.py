"""``manage.py gateway_usage --retry``: write usage records parked after a database failure."""

from django.core.management.base import BaseCommand

from gateway import services


class Command(BaseCommand):
    help = "Write usage records the gateway parked on Redis when the database refused them."

    def add_arguments(self, parser):
        parser.add_argument("--retry", action="store_true", help="Write the parked records now.")

    def handle(self, *args, **options):
        if options["retry"]:
            self.stdout.write(f"wrote {services.retry_parked_usage()} parked usage records")
