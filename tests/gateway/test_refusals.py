"""Every refusal in OpenAI's error shape, with the request id, before the engine is involved."""

import httpx
import openai
import pytest

from tenancy.services import clients

pytestmark = [pytest.mark.llama, pytest.mark.django_db(transaction=True)]


def post(gateway, path="/v1/chat/completions", key=None, headers=None, **body):
    sent = dict(headers or {})
    if key:
        sent["Authorization"] = f"Bearer {key}"
    return httpx.post(f"{gateway.base_url}{path}", headers=sent, timeout=60, json=body or None)


def assert_error(response, status, code, param=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["message"] and error["type"]
    assert error.get("param") == param
    assert response.headers["x-request-id"]


def test_no_key_malformed_header_and_wrong_key_are_401(gateway):
    assert_error(post(gateway, model="x", messages=[]), 401, "missing_api_key")
    assert_error(post(gateway, headers={"Authorization": "Basic abc"}, model="x"), 401, "malformed_authorization")
    assert_error(post(gateway, key="brk_0123456789ab_" + "x" * 43, model="x"), 401, "invalid_api_key")
    assert_error(post(gateway, key="sk-not-ours", model="x"), 401, "invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        gateway.openai("brk_0123456789ab_" + "y" * 43).models.list()


def test_a_refusal_carries_the_callers_request_id(gateway):
    response = post(gateway, headers={"X-Request-Id": "mine-123"}, model="x")
    assert response.status_code == 401 and response.headers["x-request-id"] == "mine-123"


def test_revoked_key_stops_working_within_the_cache_window(gateway, tiny_engine, deploy, make_key, tree):
    deploy("tiny", tiny_engine, task="completion")
    caller = make_key()
    assert post(gateway, "/v1/completions", caller.key, model="tiny", prompt="a", max_tokens=1).status_code == 200
    clients.revoke_credential(tree.actor, caller.credential)
    # The gateway caches keys for 30 s here: only the published revocation can explain a refusal now.
    from tests.assets.waiting import wait_until
    wait_until(lambda: post(gateway, "/v1/completions", caller.key, model="tiny", prompt="a",
                            max_tokens=1).status_code == 401, 5, what="the revoked key refused")
    assert_error(post(gateway, "/v1/completions", caller.key, model="tiny", prompt="a"), 401, "api_key_revoked")


def test_model_rules_and_inference_access(gateway, tiny_engine, deploy, make_key):
    deploy("tiny", tiny_engine, task="completion")
    restricted = make_key(all_models=False, allowed_models=["other"])
    assert_error(post(gateway, "/v1/completions", restricted.key, model="tiny", prompt="a"), 403, "model_not_allowed")
    anyone = make_key()
    assert_error(post(gateway, "/v1/completions", anyone.key, model="no-such-model", prompt="a"), 404,
                 "model_not_found")
    manager = make_key(access="management")
    assert_error(post(gateway, "/v1/completions", manager.key, model="tiny", prompt="a"), 403,
                 "inference_not_allowed")
    disabled = make_key(is_active=False)
    assert_error(post(gateway, "/v1/completions", disabled.key, model="tiny", prompt="a"), 403, "client_disabled")


def test_bad_requests_name_the_field(gateway, make_key):
    key = make_key().key
    assert_error(post(gateway, "/v1/chat/completions", key, messages=[]), 400, "invalid_request", "model")
    assert_error(post(gateway, "/v1/chat/completions", key, model="m"), 400, "invalid_request", "messages")
    response = httpx.post(f"{gateway.base_url}/v1/chat/completions", content=b"{not json",
                          headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert_error(response, 400, "invalid_request")
    huge = httpx.post(f"{gateway.base_url}/v1/embeddings", content=b"x" * (9 * 1024 * 1024),
                      headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert_error(huge, 413, "request_too_large")
    assert_error(httpx.get(f"{gateway.base_url}/v1/nothing-here", timeout=10), 404, "unknown_endpoint")
    assert_error(httpx.get(f"{gateway.base_url}/v1/chat/completions", timeout=10), 405, "method_not_allowed")


def test_the_key_is_checked_before_the_body_is_read(gateway):
    """A caller without a key is refused at once, even while its body is still on the way."""
    import socket

    with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000000\r\n\r\n{")
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 401")
