"""A real llama-server, built from the pinned llama.cpp tree, serves real (generated and shipped) models."""

import httpx
import pytest

pytestmark = pytest.mark.llama


def test_generated_model_gives_a_completion(llama_server):
    response = httpx.post(f"{llama_server.base_url}/v1/completions", timeout=60, json={
        "prompt": "hello world", "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion"
    assert isinstance(body["choices"][0]["text"], str)
    assert body["usage"]["completion_tokens"] == 8


def test_generated_model_of_another_shape_loads(llama_server_binary, gguf_model, tmp_path):
    from tests.assets.llama_server import LlamaServer

    model = gguf_model("qwen2.gguf", architecture="qwen2", layers=3, heads=8, kv_heads=2, embedding=128,
                       context=1024)
    server = LlamaServer(llama_server_binary, model, tmp_path / "server.log", context=1024)
    try:
        server.wait_ready()
        props = httpx.get(f"{server.base_url}/props", timeout=10).json()
        assert props["default_generation_settings"]["n_ctx"] == 1024
    finally:
        server.stop()
    assert server.process.returncode is not None  # stopped by its PID


def test_smollm2_answers_a_chat_question_behind_its_key(smollm2_server):
    refused = httpx.post(f"{smollm2_server.base_url}/v1/chat/completions", timeout=30, json={"messages": []})
    assert refused.status_code == 401  # the engine accepts only callers holding its key
    response = httpx.post(f"{smollm2_server.base_url}/v1/chat/completions", timeout=120,
                          headers=smollm2_server.headers(), json={
                              "messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
                              "max_tokens": 16, "temperature": 0})
    assert response.status_code == 200, response.text
    answer = response.json()["choices"][0]["message"]["content"]
    assert "paris" in answer.lower()


def test_streaming_completion_arrives_as_server_sent_events(llama_server):
    events = []
    with httpx.stream("POST", f"{llama_server.base_url}/v1/completions", timeout=60, json={
            "prompt": "the", "max_tokens": 4, "stream": True, "ignore_eos": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    assert len(events) >= 2
