"""The mirror's tabs and API: Held, Explore (the only one that calls the hub) and Fetch (a refusal
returns to the form with the reason)."""

from __future__ import annotations

import pytest

from serving.catalog import entries, fetch
from serving.models import FetchJob
from tenancy.audit import Actor
from tests.assets.gguf_models import ModelShape, write_gguf
from tests.assets.hub_server import HubServer, hub, mirror_root  # noqa: F401  (fixtures)

pytestmark = pytest.mark.django_db


@pytest.fixture
def held(mirror_root, tiny_model):
    return entries.import_local(Actor(system="tests"), tiny_model, name="tiny-held")


def test_held_lists_each_model_on_one_line_and_opens_its_card(client, admin_user, held, hub):
    client.force_login(admin_user)
    page = client.get("/models/held/")
    assert page.status_code == 200 and b"tiny-held" in page.content and b"1 held" in page.content
    assert "0–1 · opportunistic (automatic)" in page.content.decode()  # what placement is asked to keep
    card = client.get(f"/models/held/{held.public_id}/")
    assert card.status_code == 200 and b"llama" in card.content and b"Always running" in card.content
    assert not [r for r in hub.requests]  # Held never calls the hub


def test_the_card_refuses_a_minimum_above_the_maximum(client, admin_user, held):
    client.force_login(admin_user)
    response = client.post(f"/models/held/{held.public_id}/", {"scaling_min": "3", "scaling_max": "1"}, follow=True)
    assert b"At least the minimum" in response.content
    held.refresh_from_db()
    assert (held.scaling_min, held.scaling_max) == (0, 1)


def test_explore_searches_and_lists_files_with_a_remote_estimate(client, admin_user, hub, tmp_path, mirror_root):
    data = write_gguf(tmp_path / "e.gguf", ModelShape()).read_bytes()
    hub.add("acme/Explore-GGUF", {"explore-Q4_K_M.gguf": data}, downloads=9)
    client.force_login(admin_user)
    found = client.get("/models/explore/", {"q": "explore"})
    assert b"acme/Explore-GGUF" in found.content
    files = client.get("/models/explore/", {"repo": "acme/Explore-GGUF", "estimate": "explore-Q4_K_M.gguf"})
    assert b"Q4_K_M" in files.content and b"Estimated memory" in files.content


def test_an_unreachable_hub_is_said_plainly_and_the_other_tabs_keep_working(client, admin_user, held, monkeypatch):
    gone = HubServer().start()
    monkeypatch.setenv("HF_ENDPOINT", gone.url)
    gone.stop()
    client.force_login(admin_user)
    explore = client.get("/models/explore/", {"q": "anything"})
    assert explore.status_code == 503 and b"The hub is unreachable" in explore.content
    assert client.get("/models/held/").status_code == 200
    assert client.get("/models/fetch/").status_code == 200


def test_a_refused_fetch_returns_to_the_form_with_the_reason(client, admin_user, hub, mirror_root):
    hub.add("acme/Gated-GGUF", {"g-Q4_K_M.gguf": b"x"}, gated=True)
    client.force_login(admin_user)
    response = client.post("/models/fetch/", {"repo": "acme/Gated-GGUF", "revision": "main"})
    assert response.status_code == 409
    assert b"is gated" in response.content and b'value="acme/Gated-GGUF"' in response.content
    assert not FetchJob.objects.exists()


def test_api_starts_a_fetch_and_reads_the_hub(client, admin_user, hub, mirror_root, tmp_path,
                                               django_capture_on_commit_callbacks):
    data = write_gguf(tmp_path / "a.gguf", ModelShape()).read_bytes()
    hub.add("acme/Api-GGUF", {"api-Q4_K_M.gguf": data})
    client.force_login(admin_user)
    listing = client.get("/api/serving/hub/files/", {"repo": "acme/Api-GGUF"}).json()
    assert listing["sets"][0]["quantisation"] == "Q4_K_M" and listing["sets"][0]["size"] == len(data)
    with django_capture_on_commit_callbacks(execute=False):
        created = client.post("/api/serving/catalog/fetches/", {"repo": "acme/Api-GGUF"}, content_type="application/json")
    assert created.status_code == 202, created.content
    job = fetch.run(FetchJob.objects.get())
    assert job.status == "done"
    models = client.get("/api/serving/catalog/models/").json()
    rows = models["results"] if isinstance(models, dict) else models
    assert [m["name"] for m in rows] == ["api"] and rows[0]["files"][0]["verified"]
    refused = client.post("/api/serving/catalog/fetches/", {"repo": "acme/Nope"}, content_type="application/json")
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "repository_not_found"


def test_a_fetch_or_serve_body_with_a_field_they_do_not_take_is_refused_naming_it(client, admin_user, hub,
                                                                                   mirror_root, tmp_path):
    hub.add("acme/Api-GGUF", {"api-Q4_K_M.gguf": write_gguf(tmp_path / "a.gguf", ModelShape()).read_bytes()})
    client.force_login(admin_user)
    for url, body in (("/api/serving/catalog/fetches/", {"repo": "acme/Api-GGUF", "quantisation": "Q4_K_M"}),
                      ("/api/serving/serve/", {"repo": "acme/Api-GGUF", "replicas": 2})):
        refused = client.post(url, body, content_type="application/json")
        assert refused.status_code == 400, refused.content
        unknown = next(name for name in body if name != "repo")
        assert refused.json()["error"]["details"] == {unknown: ["This field is not accepted here."]}
    assert not FetchJob.objects.exists() and not hub.requests


def test_the_card_and_a_job_of_another_tenant_are_404_as_ones_that_do_not_exist(client, personas, mirror_root,
                                                                                 tiny_model):
    import uuid

    theirs = entries.import_local(Actor(system="tests"), tiny_model, name="tiny-globex",
                                  owner=personas.globex.project)
    job = FetchJob.objects.create(repo="globex/secret", owner=personas.globex.project, status="failed")
    client.force_login(personas.max)
    for url in (f"/models/held/{theirs.public_id}/", f"/models/jobs/{job.public_id}/",
                f"/models/held/{uuid.uuid4()}/", f"/models/jobs/{uuid.uuid4()}/"):
        assert client.get(url).status_code == 404, url
    assert b"tiny-globex" not in client.get("/models/held/").content
    for url in (f"/api/serving/catalog/models/{theirs.public_id}/", f"/api/serving/catalog/fetches/{job.public_id}/",
                "/api/serving/catalog/models/tiny-globex/", f"/api/serving/catalog/fetches/{job.pk}/"):
        assert client.get(url).status_code == 404, url
    client.force_login(personas.oscar)
    assert client.get(f"/models/held/{theirs.public_id}/").status_code == 200
    assert client.get(f"/models/jobs/{job.public_id}/").status_code == 200
