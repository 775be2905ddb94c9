from berth.views import AreaPlaceholderView


class IndexView(AreaPlaceholderView):
    title = "Models"
    summary = "How a model runs: the model catalog and mirror, engines and runtimes, deployments and their replicas."
    coming = (
        "The model catalog and mirror (Held, Explore, Fetch)",
        "Deployments of llama-server and vLLM, as processes or Docker containers",
        "Start-up gate, health, sleep/wake, switch with rollback, the memory watchdog",
        "The node agent and the reconcile loop",
    )
