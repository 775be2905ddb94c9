"""Weights to a node that does not hold them: a replica placed there fetches the mirror's files into
its own model root from the control plane (a signed link per file and node, a resumable byte range),
checks SHA-256 against the catalog and starts; a corrupted transfer is quarantined and nothing
starts; free disk is checked first, and copies no catalog model needs are freed for room.

The "remote" node is this machine under another name, with a model directory of its own (a
folder the control plane's files are not in); the control plane is Django's live server, and the
node's agent is played in this process (``tests.assets.node_inline``): it claims the start job, whose
payload lists the files to fetch and the copies it may free, and reports each copy as it arrives."""

from __future__ import annotations

import dataclasses
from collections import namedtuple
import uuid
from pathlib import Path

import pytest
from django.core import signing

from scheduler.models import Node
from scheduler.reports import HeldWeightReport, ModelDirectoryReport
from scheduler.services import register_node
from serving import queues
from serving.catalog import entries, transfer
from serving.control import node_work, placement
from serving.deployments import service
from serving.models import Deployment, ModelFile, Replica
from serving.node import discovery, runtime as node_runtime, weights
from serving.runtimes.base import Handle
from serving.runtimes.process import ProcessRuntime
from tenancy.audit import Actor
from tests.assets.node_inline import InlineClient, claim, run_next

ADMIN = Actor(system="tests")


@pytest.fixture
def control_root(tmp_path, settings):
    root = (tmp_path / "control").resolve()
    root.mkdir()
    settings.SCHEDULER_MODEL_ROOTS = [root]
    return root


@pytest.fixture
def held(control_root, tiny_model):
    return entries.import_local(ADMIN, tiny_model, name="tiny-remote")


@pytest.fixture
def remote(tmp_path, db):
    """A node with its own model directory, holding nothing yet."""
    root = (tmp_path / "remote-root").resolve()
    root.mkdir()
    return register_node(dataclasses.replace(discovery.local_node_report(), name="remote",
                                             model_directories=(ModelDirectoryReport(path=str(root)),)))


@pytest.fixture
def agent(tmp_path, settings, monkeypatch):
    """This process as the node's agent's runtime; every engine it launched stopped after."""
    settings.SERVING_ENGINE_DIR = tmp_path / "engines"
    settings.SERVING_DRAIN_SECONDS = 0
    runtime = ProcessRuntime(tmp_path / "engines")
    monkeypatch.setattr(node_runtime, "_runtimes", {"process": runtime})
    yield runtime
    for handle in runtime.managed():
        runtime.stop(handle, grace_seconds=5)


@pytest.fixture
def on_remote(remote, agent, live_server):
    """The remote node's agent, fetching from the live server: ``on_remote()`` claims the node's next
    job (a start) and does it with the agent's own code."""
    client = InlineClient(remote, server=live_server.url)
    return lambda: run_next(client, "start")


def place_on(entry, node) -> Replica:
    request = placement.deploy_request(entry, node)
    request = dataclasses.replace(request, config={**request.config, "context": 256})
    return service.deploy(ADMIN, request).replica_set.get()


def source_of(entry) -> ModelFile:
    return ModelFile.objects.get(model=entry, node__isnull=True)


def events(replica) -> list[str]:
    return list(replica.events.order_by("at", "id").values_list("message", flat=True))


@pytest.mark.django_db(transaction=True)
def test_a_node_that_holds_the_files_fetches_nothing_and_one_that_does_not_plans_each_file(held, remote, control_root):
    source = source_of(held)
    path = Path(source.path)
    node_path, moves = transfer.plan(held, remote, path)
    relative = path.relative_to(control_root)
    assert node_path == str(Path(remote.model_directories.get().path) / relative)
    assert moves == [{"file": str(source.public_id), "to": node_path, "size": source.size, "sha256": source.sha256,
                      "repo_path": source.repo_path}]
    # This machine as the control plane sees it: its model directory is the control plane's, and holds the file.
    local = register_node(dataclasses.replace(discovery.local_node_report(), name="local", model_directories=(
        ModelDirectoryReport(path=str(control_root), weights=(HeldWeightReport(path=str(relative)),)),)))
    assert transfer.plan(held, local, path) == ("", [])
    bare = register_node(dataclasses.replace(discovery.local_node_report(), name="bare", model_directories=()))
    assert transfer.plan(held, bare, path) == ("", [])  # reports no directory: shares the control plane's disk


@pytest.mark.llama
@pytest.mark.django_db(transaction=True)
def test_a_replica_on_a_node_without_the_files_fetches_verifies_and_starts(held, remote, agent, on_remote,
                                                                          llama_server_binary):
    replica = place_on(held, remote)
    deployment = replica.deployment
    assert deployment.transfers and deployment.node_path.startswith(remote.model_directories.get().path)
    on_remote()
    replica.refresh_from_db()
    assert replica.state == "ready", events(replica)
    copy = Path(deployment.node_path)
    assert copy.read_bytes() == Path(source_of(held).path).read_bytes()
    assert not copy.with_name(copy.name + ".partial").exists()
    record = ModelFile.objects.get(node=remote, path=str(copy))
    assert record.verified and not record.quarantined and record.sha256 == source_of(held).sha256
    said = events(replica)
    assert any(m.startswith("fetching weights: ") for m in said) and any("SHA-256 verified" in m for m in said)
    assert agent.status(Handle(**replica.handle)).running


@pytest.mark.django_db(transaction=True)
def test_a_corrupted_transfer_is_quarantined_and_the_replica_does_not_start(held, remote, agent, on_remote):
    replica = place_on(held, remote)
    served = Path(source_of(held).path)
    served.write_bytes(served.read_bytes()[:-16] + b"\0" * 16)  # the bytes on the wire are not the catalog's
    on_remote()
    replica.refresh_from_db()
    assert replica.state == "failed" and "the copy is quarantined and the replica does not start" in replica.exit_reason
    copy = Path(replica.deployment.node_path)
    assert not copy.exists() and not copy.with_name(copy.name + ".partial").exists()
    record = ModelFile.objects.get(node=remote, path=str(copy))
    assert record.quarantined and not record.verified and "arrived with SHA-256" in record.quarantine_reason
    assert not agent.managed()  # no engine was started


@pytest.mark.llama
@pytest.mark.django_db(transaction=True)
def test_a_broken_transfer_resumes_where_it_stopped(held, remote, agent, on_remote, llama_server_binary):
    replica = place_on(held, remote)
    copy = Path(replica.deployment.node_path)
    copy.parent.mkdir(parents=True)
    half = Path(source_of(held).path).read_bytes()[:100_000]
    copy.with_name(copy.name + ".partial").write_bytes(half)
    on_remote()
    replica.refresh_from_db()
    assert replica.state == "ready", events(replica)
    assert any("resumed at" in m for m in events(replica))
    assert copy.read_bytes() == Path(source_of(held).path).read_bytes()


@pytest.mark.django_db(transaction=True)
def test_too_little_disk_fails_naming_the_node_and_the_figures(held, remote, agent, on_remote, monkeypatch):
    replica = place_on(held, remote)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(weights.shutil, "disk_usage", lambda path: usage(10 * 2**30, 10 * 2**30, 1024))
    on_remote()
    replica.refresh_from_db()
    assert replica.state == "failed"
    said = replica.events.get(to_state="failed").message
    assert said.startswith("weights not on remote: ") and "has 0.00 GiB of disk free under" in said
    assert "the weights need" in said and not agent.managed()


@pytest.mark.django_db(transaction=True)
def test_garbage_collection_frees_copies_no_model_needs_oldest_first_never_one_in_use(remote, tmp_path):
    """The control plane lists the node's freeable copies in a start job (never one in use); the
    agent frees them oldest first until it has room, and says which, so their records go."""
    root = Path(remote.model_directories.get().path)
    files = []
    for name in ("old", "newer", "used"):
        path = root / f"{name}.gguf"
        path.write_bytes(b"x" * 1000)
        files.append(ModelFile.objects.create(node=remote, path=str(path), repo_path=path.name, size=1000,
                                              sha256="0" * 64, verified=True))
    used = Deployment.objects.create(name="user", model_path="/x", node=remote, state="ready",
                                     transfers=[{"to": files[2].path}])
    Replica.objects.create(deployment=used, node=remote, port=20999, state="ready")
    lacking = {"file": str(uuid.uuid4()), "to": str(root / "new.gguf"), "sha256": "1" * 64, "size": 10,
               "repo_path": "new.gguf"}  # a start that fetches weights is told what it may free for them
    starting = Deployment.objects.create(name="starting", model_path="/y", node=remote, state="planned",
                                         transfers=[lacking])
    queues.to_node("start", Replica.objects.create(deployment=starting, node=remote, port=20998, state="planned"))
    job = claim(InlineClient(remote))
    assert job.kind == "start" and job.payload["freeable"] == [files[0].path, files[1].path]  # not the one in use
    assert weights.collect_garbage(job, job.payload["freeable"], 1500) == 2000  # oldest first, until enough is freed
    assert not Path(files[0].path).exists() and not Path(files[1].path).exists()
    assert Path(files[2].path).exists()  # in use: kept
    assert list(ModelFile.objects.filter(node=remote).values_list("repo_path", flat=True)) == ["used.gguf"]


@pytest.mark.django_db(transaction=True)
def test_the_weights_link_is_the_only_way_in(client, held, remote):
    source = source_of(held)
    url = f"/api/serving/mirror/files/{source.public_id}/content/"
    assert client.get(url).status_code == 403
    forged = signing.dumps({"file": str(source.public_id), "node": str(remote.public_id)}, key="not-the-secret",
                           salt=transfer.SALT)
    assert client.get(url, HTTP_AUTHORIZATION=f"Bearer {forged}").status_code == 403
    other = ModelFile.objects.create(model=held, node=None, path=str(Path(source.path).with_name("other.gguf")),
                                     repo_path="other.gguf", verified=True)
    wrong = client.get(f"/api/serving/mirror/files/{other.public_id}/content/",
                       HTTP_AUTHORIZATION=f"Bearer {transfer.link_for(str(source.public_id), remote)}")
    assert wrong.status_code == 403 and wrong.json()["error"]["code"] == "permission_denied"
    link = f"Bearer {transfer.link_for(str(source.public_id), remote)}"
    whole = client.get(url, HTTP_AUTHORIZATION=link)
    data = Path(source.path).read_bytes()
    assert whole.status_code == 200 and b"".join(whole.streaming_content) == data
    assert whole["X-Checksum-SHA256"] == source.sha256
    rest = client.get(url, HTTP_AUTHORIZATION=link, HTTP_RANGE="bytes=1000-")
    assert rest.status_code == 206 and rest["Content-Range"] == f"bytes 1000-{len(data) - 1}/{len(data)}"
    assert b"".join(rest.streaming_content) == data[1000:]
    bad = client.get(url, HTTP_AUTHORIZATION=link, HTTP_RANGE="bytes=0-10,20-30")
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_range"
    assert client.get(url, HTTP_AUTHORIZATION=link, HTTP_RANGE=f"bytes={len(data)}-").status_code == 416
    ModelFile.objects.filter(pk=source.pk).update(quarantined=True)
    assert client.get(url, HTTP_AUTHORIZATION=link).status_code == 404
    Node.objects.filter(pk=remote.pk).delete()
    assert client.get(url, HTTP_AUTHORIZATION=link).status_code == 403  # its node is gone


@pytest.mark.django_db(transaction=True)
def test_a_node_whose_root_is_the_control_planes_uses_the_catalogs_file_and_records_no_copy(held, control_root,
                                                                                          settings):
    """This machine before its next heartbeat reports the new file: the plan names the catalog's own
    path, and the agent finds the file there — nothing fetched, nothing recorded, never collected."""
    settings.SERVING_CONTROL_URL = "http://127.0.0.1:9"  # nothing listens: a fetch would fail
    local = register_node(dataclasses.replace(discovery.local_node_report(), name="local", model_directories=(
        ModelDirectoryReport(path=str(control_root)),)))
    source = source_of(held)
    node_path, moves = transfer.plan(held, local, Path(source.path))
    assert node_path == source.path and [m["to"] for m in moves] == [source.path]
    deployment = Deployment.objects.create(name="tiny-remote", model_path=source.path, node=local, state="planned",
                                           node_path=node_path, transfers=moves)
    queues.to_node("start", Replica.objects.create(deployment=deployment, node=local, port=20998, state="planned"))
    job = claim(InlineClient(local, server=settings.SERVING_CONTROL_URL))
    [move] = job.payload["transfers"]
    assert move["catalogs_own"] and not move["recorded"]
    weights.fetch(job, move, job.payload["freeable"])  # found there: fetching would fail
    assert list(ModelFile.objects.filter(model=held).values_list("node", flat=True)) == [None]
    ModelFile.objects.filter(pk=source.pk).update(model=None)  # even once the catalog forgets it
    ModelFile.objects.create(node=local, path=source.path, repo_path="tiny", size=source.size, sha256=source.sha256)
    freeable = node_work._freeable(local)  # what the next start job on the node would list
    assert source.path not in freeable
    assert weights.collect_garbage(job, freeable, 10**12) == 0 and Path(source.path).exists()
