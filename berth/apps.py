from django.apps import AppConfig

from berth import broker


class BerthConfig(AppConfig):
    """The project package as an app: its management commands (bootstrap, serve) and templates."""

    name = "berth"
    verbose_name = "Berth"

    def ready(self) -> None:
        broker.prepare()
