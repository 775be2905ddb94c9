"""Rate limits, concurrency and budgets up the tree, in Redis, across gateway processes.

A burst here may straddle a minute boundary, and need not wait to keep clear of one: the window
slides exactly (a log of the last 60 s), so a quick burst across a boundary counts as one
(test_redis_limiter.py drives the clock across boundaries to show it; test_limiter_faults.py covers
Redis lost or stalled)."""

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tenancy.services import contracts
from tests.assets.waiting import wait_until

pytestmark = [pytest.mark.llama, pytest.mark.django_db(transaction=True)]


def complete(gateway, key, **extra):
    return httpx.post(f"{gateway.base_url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                      json={"model": "tiny", "prompt": "a", "max_tokens": 1, **extra})


def test_rate_limit_429_with_retry_after_and_headers_on_success_and_refusal(gateway, tiny_engine, deploy,
                                                                            make_key, tree):
    deploy("tiny", tiny_engine, task="completion")
    contracts.set_contract(tree.actor, tree.team, rpm_limit=10, tpm_limit=100000)
    caller = make_key(rpm_limit=3)
    answers = [complete(gateway, caller.key) for _ in range(4)]
    assert [a.status_code for a in answers] == [200, 200, 200, 429]
    first, refused = answers[0], answers[3]
    # The client's 3/min binds before the team's 10/min: it is the level reported.
    assert first.headers["x-ratelimit-limit-requests"] == "3"
    assert first.headers["x-ratelimit-remaining-requests"] == "2"
    assert first.headers["x-ratelimit-reset-requests"].endswith("s")
    assert first.headers["x-ratelimit-limit-tokens"] == "100000"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert int(refused.headers["retry-after"]) >= 1
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"


def test_a_key_without_limits_sends_no_rate_headers(gateway, tiny_engine, deploy, make_key):
    deploy("tiny", tiny_engine, task="completion")
    answer = complete(gateway, make_key().key)
    assert answer.status_code == 200 and not any(h.startswith("x-ratelimit") for h in answer.headers)


def test_project_limit_holds_across_two_gateway_processes(gateway, gateway_b, tiny_engine, deploy, make_key, tree):
    deploy("tiny", tiny_engine, task="completion")
    contracts.set_contract(tree.actor, tree.project, rpm_limit=8)
    keys = [make_key().key for _ in range(2)]
    jobs = [(g, k) for g in (gateway, gateway_b) for k in keys] * 5  # 20 requests against a limit of 8
    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(lambda job: complete(*job).status_code, jobs))
    assert statuses.count(200) == 8 and statuses.count(429) == 12


def test_concurrency_limit(gateway, chat_engine, deploy, make_key):
    deploy("smollm2", chat_engine)
    caller = make_key(concurrency_limit=1)

    def chat(max_tokens):
        return httpx.post(f"{gateway.base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {caller.key}"},
                          timeout=120, json={"model": "smollm2", "max_tokens": max_tokens, "ignore_eos": True,
                                             "messages": [{"role": "user", "content": "Write a long story."}]})

    admitted = threading.Event()

    def slow():  # streamed, so the test knows when it holds the one slot
        with httpx.stream("POST", f"{gateway.base_url}/v1/chat/completions", timeout=120,
                          headers={"Authorization": f"Bearer {caller.key}"},
                          json={"model": "smollm2", "max_tokens": 300, "ignore_eos": True, "stream": True,
                                "messages": [{"role": "user", "content": "Write a long story."}]}) as response:
            assert response.status_code == 200
            admitted.set()
            response.read()

    worker = threading.Thread(target=slow)
    worker.start()
    try:
        assert admitted.wait(60)

        def refused():
            answer = chat(1)
            return answer if answer.status_code == 429 else None

        answer = wait_until(refused, 20, interval=0.05, what="a second request refused while the first runs")
        assert answer.json()["error"]["code"] == "concurrency_limit_exceeded"
    finally:
        worker.join()
    # The lease is released just after the answer's last byte (settlements are batched): promptly.
    wait_until(lambda: chat(1).status_code == 200, 5, what="the slot free again")


def softening_approved(tree):
    """Turning a hard budget soft needs a second person's approval: two admins of the org, one asks."""
    from django.contrib.auth import get_user_model

    from tenancy.audit import Actor
    from tenancy.models import Membership
    from tenancy.services import approvals

    asker, decider = (get_user_model().objects.create_user(f"{tree.org.slug}-{n}") for n in ("asker", "decider"))
    for user in (asker, decider):
        Membership.objects.create(user=user, scope=tree.org, role="admin")
    evidence = contracts.raise_limit_evidence(tree.org, budget_mode="soft")
    approval = approvals.request_approval(Actor(user=asker), "contract.raise_limit", tree.org, tree.org, evidence,
                                          "warn only")
    return approvals.decide(Actor(user=decider), approval, True)


def test_hard_budget_refuses_once_spent_and_soft_budget_warns(gateway, gateway_b, tiny_engine, deploy, make_key,
                                                             tree):
    deploy("tiny", tiny_engine, task="completion")
    # Room for the first request's reservation (its prompt at most, and its 120 tokens of output).
    contracts.set_contract(tree.actor, tree.org, daily_token_budget=300, budget_mode="hard")
    caller = make_key()
    assert complete(gateway, caller.key, max_tokens=120, ignore_eos=True).status_code == 200
    # Charged from the engine's usage, seen by the other process too: what is left cannot hold
    # another 100 tokens of output.
    answer = wait_until(lambda: (a := complete(gateway_b, caller.key, max_tokens=100)).status_code == 429 and a, 10,
                        what="the budget refusal")
    assert answer.json()["error"]["code"] == "budget_exceeded" and int(answer.headers["retry-after"]) >= 1
    # Below what is spent (lowering takes no second person), then soft (which does): a warning only.
    contracts.set_contract(tree.actor, tree.org, daily_token_budget=20, budget_mode="hard")
    contracts.set_contract(tree.actor, tree.org, daily_token_budget=20, budget_mode="soft",
                           approval=softening_approved(tree))
    soft = make_key()  # a new key: its limits are read fresh
    answer = complete(gateway, soft.key)
    assert answer.status_code == 200 and "x-berth-budget-warning" in answer.headers


def test_a_keys_own_limit_binds_before_its_clients(gateway, tiny_engine, deploy, make_key, tree):
    from tenancy.services import clients

    deploy("tiny", tiny_engine, task="completion")
    caller = make_key(rpm_limit=10)
    _, tight = clients.create_credential(tree.actor, caller.client, rpm_limit=2)
    answers = [complete(gateway, tight) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 429]
    assert answers[0].headers["x-ratelimit-limit-requests"] == "2"
    assert complete(gateway, caller.key).status_code == 200  # the client's other key has room of its own
