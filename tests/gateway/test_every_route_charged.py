"""Every inference route, old and new, is charged to the same limits and budgets: one key's request limit
counts requests on all of them together, a hard budget spent through any one refuses all, and the usage
records name each route. (LiteLLM's budgets skip /v1/responses and /v1/messages; Berth's must not.)"""

from __future__ import annotations

import httpx
import pytest

from gateway.models import UsageRecord
from tenancy.services import contracts
from tests.assets.waiting import wait_until

pytestmark = [pytest.mark.llama, pytest.mark.django_db(transaction=True)]

HI = [{"role": "user", "content": "hi"}]
# route -> (model, body). Anthropic's routes are sent the key as Anthropic's clients do (x-api-key).
ROUTES = {
    "/v1/chat/completions": ("smollm2", {"messages": HI, "max_tokens": 2}),
    "/v1/completions": ("smollm2", {"prompt": "Once upon a time", "max_tokens": 2}),
    "/v1/embeddings": ("tiny-embed", {"input": "hello world"}),
    "/v1/rerank": ("tiny-embed", {"query": "sea", "documents": ["the sea", "a hill"]}),
    "/v1/responses": ("smollm2", {"input": "hi", "max_output_tokens": 2}),
    "/v1/responses/input_tokens": ("smollm2", {"input": "hi"}),
    "/v1/messages": ("smollm2", {"messages": HI, "max_tokens": 2}),
    "/v1/messages/count_tokens": ("smollm2", {"messages": HI}),
}
ANTHROPIC = {"/v1/messages", "/v1/messages/count_tokens"}


def send(gateway, path, key, **extra):
    model, body = ROUTES[path]
    headers = {"x-api-key": key} if path in ANTHROPIC else {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{gateway.base_url}{path}", headers=headers, timeout=120, json={"model": model, **body, **extra})


def error_of(response, path):
    """The error's code, in the route's own shape (Anthropic's on its routes)."""
    body = response.json()
    if path in ANTHROPIC:
        assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error"
    else:
        assert "type" not in body and body["error"]["type"] == "rate_limit_error"
    return body["error"]["code"]


@pytest.fixture
def models(chat_engine, embedding_engine, deploy):
    deploy("smollm2", chat_engine)
    deploy("tiny-embed", embedding_engine, task="embedding")


def test_one_request_limit_counts_every_route_and_the_next_on_any_is_refused(gateway, models, make_key):
    caller = make_key(rpm_limit=len(ROUTES))
    admitted = {path: send(gateway, path, caller.key) for path in ROUTES}
    # Each was let through the limits (rerank reaches an engine that ranks nothing: its refusal is the engine's).
    assert all(answer.status_code != 429 for answer in admitted.values()), {p: a.text for p, a in admitted.items()}
    assert all(admitted[path].status_code == 200 for path in ROUTES if path != "/v1/rerank")
    for path in ROUTES:  # the limit is spent, whichever route spent it
        refused = send(gateway, path, caller.key)
        assert refused.status_code == 429, (path, refused.text)
        assert error_of(refused, path) == "rate_limit_exceeded" and int(refused.headers["retry-after"]) >= 1
    endpoints = {path.removeprefix("/v1/") for path in ROUTES}

    def recorded():
        rows = list(UsageRecord.objects.filter(client_id=caller.client.pk).values_list("endpoint", "status"))
        return rows if len(rows) == 2 * len(ROUTES) else None

    rows = wait_until(recorded, 20, what="a usage record of every request")
    assert {endpoint for endpoint, status in rows if status != 429} == endpoints
    assert {endpoint for endpoint, status in rows if status == 429} == endpoints


BUDGET = 400
# Counting a prompt's tokens runs no model and costs nothing: refused only once a budget is used up
# (which a budget that reserves never quite is), not while a generating request's reservation fails.
COUNTING = {"/v1/responses/input_tokens", "/v1/messages/count_tokens"}
SPENDING = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/messages"]


@pytest.mark.parametrize("path", SPENDING)
def test_a_hard_budget_spent_through_any_route_refuses_every_route(gateway, models, make_key, tree, path):
    # Room for the first request's reservation (its prompt as estimated, and its output), not many more.
    contracts.set_contract(tree.actor, tree.project, daily_token_budget=BUDGET, budget_mode="hard")
    caller = make_key()
    more = {"/v1/embeddings": {"input": "the sea and the hills " * 8},
            "/v1/responses": {"max_output_tokens": 8, "ignore_eos": True}}.get(path, {"max_tokens": 8, "ignore_eos": True})
    spent = send(gateway, path, caller.key, **more)
    assert spent.status_code == 200, spent.text
    record = wait_until(lambda: UsageRecord.objects.filter(client_id=caller.client.pk).first(), 20,
                        what="the spending request's usage record")
    assert record.endpoint == path.removeprefix("/v1/") and record.prompt_tokens + record.completion_tokens >= 8
    # Charged from the answer's usage (settled just after it): once what is left cannot hold a request's
    # reservation, nothing more passes, on any route, and the budget was never overshot.
    wait_until(lambda: send(gateway, path, caller.key).status_code == 429, 20, what="the budget refusal")
    for other in set(ROUTES) - COUNTING:
        refused = wait_until(lambda: (a := send(gateway, other, caller.key)).status_code == 429 and a, 20,
                             what=f"the budget refusal on {other}")
        assert error_of(refused, other) == "budget_exceeded", (other, refused.text)
    wait_until(lambda: UsageRecord.objects.filter(client_id=caller.client.pk, status=429).count()
               >= len(ROUTES) - len(COUNTING), 20, what="the refusals recorded")
    spent = sum((r.prompt_tokens or 0) + (r.completion_tokens or 0)
                for r in UsageRecord.objects.filter(client_id=caller.client.pk))
    assert 0 < spent <= BUDGET
