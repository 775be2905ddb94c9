from django.apps import AppConfig


class ServingConfig(AppConfig):
    """How a model runs: the model catalog and mirror, engines and runtimes, deployments and their replicas."""

    name = "serving"
    verbose_name = "Serving"
