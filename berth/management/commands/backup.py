from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from berth import backup


class Command(BaseCommand):
    help = ("Write one archive of the database and the secrets that keep its keys working (BERTH_SECRET_KEY, "
            "BERTH_KEY_PEPPER), mode 0600, and keep the newest BERTH_BACKUP_KEEP there.")

    def add_arguments(self, parser):
        parser.add_argument("--dir", type=Path, default=None,
                            help="Where to write (default BERTH_BACKUP_DIR, else the data directory's backups/).")
        parser.add_argument("--keep", type=int, default=None,
                            help=f"How many of the newest archives to keep (default BERTH_BACKUP_KEEP={settings.BACKUP_KEEP}).")

    def handle(self, *args, dir, keep, **options):
        try:
            path = backup.create(dir, keep)
        except backup.BackupError as exc:
            raise CommandError(f"[{exc.code}] {exc}") from exc
        self.stdout.write(f"Backup written: {path}")
        self.stdout.write("It holds the secret key and the key pepper: keep it where the database's secrets may be.")
