from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from berth import backup


class Command(BaseCommand):
    help = ("Restore an archive written by `manage.py backup` into the configured database, which must be empty; "
            "refuses when the archive's secrets are not this configuration's.")

    def add_arguments(self, parser):
        parser.add_argument("archive", type=Path, help="The archive (berth-backup-….tar.gz).")

    def handle(self, *args, archive, **options):
        try:
            restored = backup.restore(archive)
        except backup.BackupError as exc:
            raise CommandError(f"[{exc.code}] {exc}") from exc
        self.stdout.write(f"Restored the {restored.vendor} backup of {restored.created_at} into {restored.database}.")
        self.stdout.write("Start the web, worker and beat processes.")
