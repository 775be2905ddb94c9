"""The project package's one table: leases (``berth.lease``), which no app owns because any may need one."""

from django.db import models


class Lease(models.Model):
    """Who runs a loop that must have one runner at a time, until when. Times are the database's
    clock, so two contenders on machines whose clocks differ still agree on when it expires."""

    name = models.CharField(max_length=100, primary_key=True)
    holder = models.CharField(max_length=255, help_text="host:pid of the process that holds it.")
    acquired_at = models.DateTimeField(help_text="When this holder took it.")
    renewed_at = models.DateTimeField(help_text="When this holder last renewed it.")
    expires_at = models.DateTimeField(help_text="When another may take it, unless renewed before.")

    def __str__(self) -> str:
        return f"{self.name} held by {self.holder}"
