from django.apps import AppConfig


class ServingConfig(AppConfig):
    """How a model runs: the model catalog and mirror, engines and runtimes, deployments and their replicas."""

    name = "serving"
    verbose_name = "Serving"

    def ready(self):
        # Imported here, once the apps are loaded: the placement loop reads every app's models.
        from scheduler import snapshot
        from serving.control import placement

        # Explain and headroom dry runs see the running system's replicas, as the reconcile loop does.
        snapshot.register_provider(placement.snapshot)
