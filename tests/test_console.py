"""The console shell: login, the four areas, one URL for page and HTMX fragment."""

import pytest
from django.conf import settings
from django.urls import reverse

from scheduler.services import EngineReport, NodeReport, register_node

pytestmark = pytest.mark.django_db


def test_anonymous_visitor_is_sent_to_login(client):
    response = client.get("/")
    assert response.status_code == 302
    assert response["Location"] == "/login/?next=/"


def test_login_with_the_right_password_opens_the_dashboard(client, admin_user, admin_password):
    response = client.post("/login/", {"username": "ada", "password": admin_password}, follow=True)
    assert response.redirect_chain == [("/", 302)]
    page = response.content.decode()
    for label in ("Gateway", "Models", "Fleet", "Organisations"):
        assert f">{label}</a>" in page
    assert "Models satisfied" in page and "No model yet" in page  # an empty dashboard says what to do next


def test_login_with_a_wrong_password_is_refused(client, admin_user):
    response = client.post("/login/", {"username": "ada", "password": "wrong"})
    assert response.status_code == 200
    assert "do not match an account" in response.content.decode()
    assert "_auth_user_id" not in client.session


def test_logout_needs_a_post_and_ends_the_session(client, admin_user):
    client.force_login(admin_user)
    assert client.get("/logout/").status_code == 405
    assert client.post("/logout/").status_code == 302
    assert client.get("/").status_code == 302


def test_fleet_page_and_its_fragment_come_from_one_url(client, admin_user):
    register_node(NodeReport(name="cpu-01", address="127.0.0.1", cpu_count=16,
                             engines=(EngineReport(kind="llamacpp", version="b1 (abc)"),)))
    client.force_login(admin_user)
    url = reverse("scheduler:index")
    page = client.get(url)
    fragment = client.get(url, HTTP_HX_REQUEST="true")
    assert "<html" in page.content.decode()
    body = fragment.content.decode()
    assert "<html" not in body and body.lstrip().startswith('<div id="fleet-table"')
    assert "cpu-01" in body and "llama.cpp b1 (abc)" in body
    assert "HX-Request" in page["Vary"] and "HX-Request" in fragment["Vary"]


def test_boosted_navigation_gets_the_whole_page(client, admin_user):
    client.force_login(admin_user)
    response = client.get(reverse("scheduler:index"), HTTP_HX_REQUEST="true", HTTP_HX_BOOSTED="true")
    assert "<html" in response.content.decode()


def test_fleet_filter_narrows_the_table(client, admin_user):
    for name in ("gpu-a", "gpu-b", "cpu-a"):
        register_node(NodeReport(name=name, address="127.0.0.1"))
    client.force_login(admin_user)
    body = client.get(reverse("scheduler:index") + "?q=gpu", HTTP_HX_REQUEST="true").content.decode()
    assert "gpu-a" in body and "gpu-b" in body and "cpu-a" not in body


def test_htmx_is_served_from_our_own_static_files(client):
    response = client.get("/static/vendor/htmx/htmx.min.js")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/javascript")
    assert int(response["Content-Length"]) == (settings.BASE_DIR / "static/vendor/htmx/htmx.min.js").stat().st_size
