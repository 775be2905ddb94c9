from django.apps import AppConfig


class GatewayConfig(AppConfig):
    """How a request reaches a model: the OpenAI-compatible API under /v1/, limits and budgets, routing, usage."""

    name = "gateway"
    verbose_name = "Gateway"
