from berth.views import AreaPlaceholderView


class IndexView(AreaPlaceholderView):
    title = "Gateway"
    summary = "How a request reaches a model: the OpenAI-compatible API under /v1/, limits and budgets, routing, usage."
    coming = (
        "/v1/chat/completions, /v1/completions, /v1/embeddings, /v1/rerank, /v1/models",
        "Rate limits and token budgets up the tenancy tree",
        "Routing and admission while a model loads",
        "Usage records and access logs",
    )
