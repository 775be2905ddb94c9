"""``manage.py status [--json] [--user NAME]``: the fleet at a glance, the figures of
``GET /api/serving/status/`` (``serving.api.status.figures``). Run on the server it reads as Berth
itself (everything); ``--user`` narrows it to what that account may see."""

from __future__ import annotations

import json

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from serving.api.status import figures
from tenancy.audit import SYSTEM

BAR_WIDTH = 20


def bar(used: int, total: int, width: int = BAR_WIDTH) -> str:
    """``[#####---------------]``: the used share of ``total`` in ``width`` cells (rounded up, so any use shows)."""
    filled = 0 if not total else min(width, -(-used * width // total))
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def render(data: dict) -> str:
    lines = ["Capacity"]
    if not data["capacity"]:
        lines.append("  no accelerators")
    for row in data["capacity"]:
        lines.append(f"  {row['accelerator_class']:<20} {bar(row['in_use'], row['total'])} {row['in_use']}/"
                     f"{row['total']} in use, {row['free']} free"
                     + (f", {row['unavailable']} unavailable" if row["unavailable"] else ""))
    lines.append(f"Free whole nodes: {', '.join(data['free_nodes']) or 'none'}")
    lines.append("Watchdog")
    if not data["nodes"]:
        lines.append("  no nodes")
    for node in data["nodes"]:
        lines.append(f"  {node['name']:<20} {node['state']:<10} memory {node['watchdog'] or 'not known'}")
    got = data["satisfied"]
    lines.append(f"Models satisfied: {got['satisfied']}/{got['total']}")
    for model in data["models"]:
        if not model["satisfied"]:
            lines.append(f"  {model['name']}: {model['ready']}/{model['wanted']} ready, {model['state']}"
                         + (f" ({model['reason']})" if model["reason"] else ""))
    for title, key in (("Parked", "parked"), ("Unplaceable", "unplaceable")):
        lines.append(f"{title}: {len(data[key]) or 'none'}")
        lines.extend(f"  {row['name']}: {row['reason'] or 'no reason recorded'}" for row in data[key])
    lines.append(f"Unused for a day: {len(data['idle_replicas']) or 'none'}")
    lines.extend(f"  {row['model']} on {row['node']} ({row['state']}), idle {row['idle_seconds'] // 3600} h"
                 for row in data["idle_replicas"])
    lines.append(f"Failures (24 h): {len(data['failures']) or 'none'}")
    lines.extend(f"  {row['at']} {row['deployment']} on {row['node']}: {row['message'] or row['from_state']}"
                 for row in data["failures"])
    return "\n".join(lines)


class Command(BaseCommand):
    help = ("The fleet at a glance: capacity per accelerator class, free nodes, the watchdog per node, models "
            "satisfied, parked and unplaceable ones, replicas unused for a day, recent failures.")

    def add_arguments(self, parser):
        parser.add_argument("--json", action="store_true", help="The figures as JSON (those of the API).")
        parser.add_argument("--user", default="", help="Show only what this account may see.")

    def handle(self, *args, **options):
        caller = SYSTEM
        if options["user"]:
            try:
                caller = get_user_model().objects.get(username=options["user"], is_active=True)
            except get_user_model().DoesNotExist:
                raise CommandError(f"no active user {options['user']!r}") from None
        data = figures(caller)
        self.stdout.write(json.dumps(data, indent=2) if options["json"] else render(data))
