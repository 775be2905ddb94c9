"""Serve in one command from the console and the API: the same job as ``manage.py serve_model``,
on the control queue, followed on a job page whose polling stops when the job ends; and a fetch
still running keeps its files through garbage collection."""

from __future__ import annotations

import pytest

from serving.catalog import entries, fetch, paths

from serving.control import serve_model as serve

from serving import queues
from serving.catalog.fetch import FetchRequest
from serving.models import FetchJob, ModelFile
from tenancy.audit import Actor
from tests.assets.gguf_models import ModelShape, write_gguf
from tests.assets.hub_server import hub, mirror_root  # noqa: F401  (fixtures)

ADMIN = Actor(system="tests")
REPO = "acme/Serve-GGUF"
pytestmark = pytest.mark.django_db


@pytest.fixture
def repo(hub, tmp_path, mirror_root):
    hub.add(REPO, {"serve-Q4_K_M.gguf": write_gguf(tmp_path / "s.gguf", ModelShape()).read_bytes()})
    return hub


@pytest.fixture
def queued(monkeypatch):
    """What was handed to the worker: (job id, queue)."""
    sent = []
    monkeypatch.setattr(queues, "to_control", lambda task, job_id: sent.append((job_id, queues.CONTROL)))
    return sent


def test_the_console_serves_in_one_job_followed_on_its_page(client, admin_user, repo, queued,
                                                            django_capture_on_commit_callbacks):
    client.force_login(admin_user)
    form = client.get("/models/fetch/", {"repo": REPO})
    assert b'action="/models/serve/"' in form.content and b"Serve in one command" in form.content
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post("/models/serve/", {"repo": REPO, "revision": "main", "quant": "Q4_K_M",
                                                  "on_demand": "on"})
    job = FetchJob.objects.get()
    assert response.status_code == 302 and response["Location"] == f"/models/jobs/{job.public_id}/"
    assert job.kind == "serve" and job.options["on_demand"] and queued == [(str(job.public_id), "control")]

    page = client.get(response["Location"])
    assert page.status_code == 200 and b'hx-trigger="every 2s"' in page.content
    assert b'data-step="resolve" data-state="done"' in page.content
    assert b'data-step="fetch" data-state="waiting"' in page.content
    polled = client.get(response["Location"], HTTP_HX_REQUEST="true")
    assert polled.status_code == 200 and b'hx-trigger="every 2s"' in polled.content  # still running: keep polling

    job = serve.run(job)  # what the worker does
    assert job.status == "done", job.error
    ended = client.get(response["Location"], HTTP_HX_REQUEST="true")
    assert ended.status_code == 286 and b"hx-trigger" not in ended.content  # ended: htmx stops
    assert b'data-step="catalog" data-state="done"' in ended.content
    assert b'data-step="deploy" data-state="skipped"' in ended.content and b"serve" in ended.content


def test_a_refused_serve_returns_to_the_form_with_the_reason(client, admin_user, hub, mirror_root, queued):
    hub.add("acme/Gated-GGUF", {"g-Q4_K_M.gguf": b"x"}, gated=True)
    client.force_login(admin_user)
    response = client.post("/models/serve/", {"repo": "acme/Gated-GGUF", "revision": "main"})
    assert response.status_code == 409
    assert b"is gated" in response.content and b'value="acme/Gated-GGUF"' in response.content
    assert not FetchJob.objects.exists() and not queued


def test_the_api_serves_in_one_command(client, admin_user, repo, queued, django_capture_on_commit_callbacks):
    client.force_login(admin_user)
    with django_capture_on_commit_callbacks(execute=True):
        created = client.post("/api/serving/serve/", {"repo": REPO, "quant": "Q4_K_M", "on_demand": True,
                                                      "context": 2048}, content_type="application/json")
    assert created.status_code == 202, created.content
    body = created.json()
    assert body["kind"] == "serve" and body["status"] == "queued" and len(body["commit"]) == 40
    assert [s["name"] for s in body["steps"]] == list(serve.STEPS) and body["steps"][0]["state"] == "done"
    assert queued == [(body["public_id"], "control")]
    job = FetchJob.objects.get()
    assert job.options["context"] == 2048 and job.options["on_demand"] is True
    followed = client.get(f"/api/serving/catalog/fetches/{body['public_id']}/").json()
    assert followed["steps"] == body["steps"]
    refused = client.post("/api/serving/serve/", {"repo": "acme/Nope"}, content_type="application/json")
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "repository_not_found"
    assert client.post("/api/serving/serve/", {}, content_type="application/json").status_code == 400


def test_garbage_collection_spares_the_files_of_a_fetch_still_running(repo, mirror_root):
    job = fetch.start(ADMIN, FetchRequest(repo=REPO), enqueue=False)
    FetchJob.objects.filter(pk=job.pk).update(status=FetchJob.Status.RUNNING)
    # The fetch has verified its file and recorded it; the row gets its model only when the job ends.
    job.refresh_from_db()
    fetch._fetch_file(job, 0, job.files[0])
    arrived = ModelFile.objects.get()
    assert arrived.model is None and arrived.verified
    orphan = mirror_root / "orphan.gguf"
    orphan.write_bytes(b"x" * 10)
    ModelFile.objects.create(path=str(orphan), repo_path="orphan.gguf", size=10)

    assert entries.garbage_collect(ADMIN) == {"files": 1, "bytes": 10}
    assert ModelFile.objects.filter(pk=arrived.pk).exists() and paths.local_path(REPO, job.commit,
                                                                                  job.files[0]["path"]).exists()
    # Once the job has failed for good and nothing claims the file, it is garbage like any other.
    FetchJob.objects.filter(pk=job.pk).update(status=FetchJob.Status.FAILED)
    assert entries.garbage_collect(ADMIN)["files"] == 1 and not ModelFile.objects.exists()


# --- the smoke test goes through the gateway, or to the replica's node: never the control plane's loopback

class _Recorder:
    """An OpenAI-shaped server on one loopback address that keeps what it was sent (path, bearer, body)."""

    def __init__(self, host: str):
        import http.server
        import json
        import socket
        import threading

        seen = self.seen = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                seen.append((self.path, self.headers["Authorization"], body))
                answer = json.dumps({"choices": [{"message": {"content": "hello"}}],
                                     "usage": {"completion_tokens": 2}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server_class = type("Server", (http.server.ThreadingHTTPServer,), {"address_family": family})
        self.server = server_class((host, 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.fixture
def recorder():
    made = []
    yield lambda host: made.append(_Recorder(host)) or made[-1]
    for server in made:
        server.stop()


def ready_replica(address: str, port: int, owner=None):
    from scheduler.services import NodeReport, register_node
    from serving.models import Deployment, Replica

    node = register_node(NodeReport(name="smoke-node", address=address))
    deployment = Deployment.objects.create(name="smoked", task="chat", model_path="/models/x.gguf", node=node,
                                           state="ready", owner=owner)
    return Replica.objects.create(deployment=deployment, node=node, port=port, state="ready")


def test_a_model_with_no_owner_project_is_smoke_tested_at_its_nodes_address_with_the_engine_key(recorder):
    from serving.keys import replica_key

    engine = recorder("::1")  # the node's own address: nothing answers on 127.0.0.1 at this port
    replica = ready_replica("::1", engine.port)
    answer, rate, via = serve.smoke_test(replica)
    assert (answer, via) == ("hello", f"http://[::1]:{engine.port}") and rate > 0
    [(path, bearer, body)] = engine.seen
    assert path == "/v1/chat/completions" and bearer == f"Bearer {replica_key(replica.public_id)}"
    assert body["model"] == "smoked" and body["messages"][0]["content"] == "Say hello."


def test_a_project_models_smoke_request_goes_to_the_gateway_with_a_short_key_revoked_after(recorder, settings):
    from tenancy.models import AuditEvent, Credential
    from tenancy.services.tree import create_scope

    org = create_scope(ADMIN, "org", "smokers", "Smokers")
    project = create_scope(ADMIN, "project", "app", "App", create_scope(ADMIN, "team", "ml", "ML", org))
    gateway = recorder("127.0.0.1")
    settings.SERVING_GATEWAY_URL = f"http://127.0.0.1:{gateway.port}/"
    replica = ready_replica("::1", 1, owner=project)  # nothing listens at the replica itself: not asked
    answer, _, via = serve.smoke_test(replica, ADMIN)
    assert (answer, via) == ("hello", f"http://127.0.0.1:{gateway.port}")
    [(path, bearer, body)] = gateway.seen
    assert path == "/v1/chat/completions" and body["model"] == "smoked"
    credential = Credential.objects.get(client__project=project, client__name=serve.SMOKE_CLIENT)
    assert bearer.removeprefix("Bearer ").startswith(credential.prefix)
    assert credential.revoked_at is not None  # answered: the key is gone
    assert abs((credential.expires_at - credential.created_at) - serve.SMOKE_KEY_LIFETIME).total_seconds() < 1
    assert AuditEvent.objects.filter(action="credential.create").exists()
    serve.smoke_test(replica, ADMIN)  # the next job reuses the client, with a key of its own
    assert Credential.objects.filter(client__name=serve.SMOKE_CLIENT).count() == 2
    assert not Credential.objects.filter(client__name=serve.SMOKE_CLIENT, revoked_at__isnull=True).exists()
