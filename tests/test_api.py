"""The management API: one error format, an OpenAPI schema, docs served without a CDN."""

import uuid

import pytest

from scheduler.services import NodeReport, register_node

pytestmark = pytest.mark.django_db


def test_anonymous_caller_gets_the_error_format(client):
    response = client.get("/api/scheduler/nodes/")
    assert response.status_code == 401
    assert response["WWW-Authenticate"] == "Bearer"
    assert response.json() == {"error": {"code": "not_authenticated",
                                         "message": "Authentication credentials were not provided.",
                                         "details": {}}}


def test_nodes_are_listed_and_looked_up_by_public_id(client, admin_user):
    node = register_node(NodeReport(name="gpu-01", address="127.0.0.1", cpu_count=64))
    client.force_login(admin_user)
    listing = client.get("/api/scheduler/nodes/").json()
    assert listing["count"] == 1
    assert listing["results"][0]["id"] == str(node.public_id)
    assert listing["results"][0]["memory_total_bytes"] is None  # not reported is absent, not 0
    detail = client.get(f"/api/scheduler/nodes/{node.public_id}/")
    assert detail.json()["name"] == "gpu-01"


def test_unknown_object_is_a_404_in_the_error_format(client, admin_user):
    client.force_login(admin_user)
    response = client.get(f"/api/scheduler/nodes/{uuid.uuid4()}/")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"


def test_invalid_filter_is_refused_with_details(client, admin_user):
    client.force_login(admin_user)
    response = client.get("/api/scheduler/nodes/?state=melted")
    assert response.status_code == 400
    body = response.json()["error"]
    assert body["code"] == "invalid"
    assert "state" in body["details"]


def test_wrong_method_has_a_stable_code(client, admin_user):
    client.force_login(admin_user)
    response = client.delete("/api/scheduler/nodes/")
    assert response.status_code == 405
    assert response.json()["error"]["code"] == "method_not_allowed"


def test_schema_and_docs_are_served_locally(client, admin_user):
    client.force_login(admin_user)
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/json")
    assert schema.status_code == 200
    assert "/api/scheduler/nodes/" in schema.json()["paths"]
    docs = client.get("/api/docs/")
    assert docs.status_code == 200
    html = docs.content.decode()
    assert "swagger-ui" in html
    assert "cdn." not in html and "jsdelivr" not in html


def test_the_schema_generates_without_a_warning(tmp_path):
    from django.core.management import call_command

    call_command("spectacular", "--fail-on-warn", "--validate", "--file", str(tmp_path / "schema.yml"))
    assert (tmp_path / "schema.yml").read_text().count("DeploymentStateEnum:") == 1


def test_unknown_api_url_is_a_404_in_the_error_format(client):
    response = client.get("/api/no-such-thing/")
    assert response.status_code == 404
    assert response.json() == {"error": {"code": "not_found", "message": "No such endpoint or object.", "details": {}}}


def test_unexpected_failure_is_a_500_in_the_error_format(client, admin_user, monkeypatch):
    from scheduler.api.views import NodeViewSet

    def explode(self, request, *args, **kwargs):
        raise RuntimeError("bug")

    monkeypatch.setattr(NodeViewSet, "list", explode)
    client.raise_request_exception = False
    client.force_login(admin_user)
    response = client.get("/api/scheduler/nodes/")
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "internal_error"


def test_a_database_that_does_not_answer_is_a_503_to_try_again(client, admin_user, monkeypatch):
    from django.db import OperationalError

    from scheduler.api.views import NodeViewSet

    def away(self, request, *args, **kwargs):
        raise OperationalError("connection refused")

    monkeypatch.setattr(NodeViewSet, "list", away)
    client.force_login(admin_user)
    response = client.get("/api/scheduler/nodes/")
    assert response.status_code == 503 and response["Retry-After"] == "5"
    assert response.json()["error"]["code"] == "database_unavailable"
    assert "connection refused" not in response.content.decode()  # the database's own words stay in the log


def test_the_whole_schema_generates_without_errors(tmp_path, capsys):
    # An error means drf-spectacular could not describe a view at all and left it out of the docs.
    from django.core.management import call_command

    call_command("spectacular", "--validate", "--file", str(tmp_path / "schema.yaml"))
    errors = [line for line in capsys.readouterr().err.splitlines() if " Error [" in line]
    assert errors == []
