from django.apps import AppConfig


class SchedulerConfig(AppConfig):
    """What runs where: the fleet inventory, estimates, the fit planner and the placement policy."""

    name = "scheduler"
    verbose_name = "Scheduler"
