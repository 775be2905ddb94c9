"""Every record's page (``ROUTES``' pages of one object) shows a trail above its h1: the area, the list
the record belongs to, its parents (a scope's: organisation, team, project), then the record itself,
current and not a link (``berth/breadcrumbs.html``). A tenant member's trail names only the scopes
they may see: a role holds from its scope down, so what lies above it is left out."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest
from django.test import Client

from tests.assets.world import build_world
from tests.test_console_walk import ROUTES, Page, url_of

pytestmark = pytest.mark.django_db

STREAM = "models/deployments/<uuid:public_id>/stream/"  # an event stream: no page
NODE_JOBS = "models/nodes/<uuid:public_id>/jobs/"  # a fragment of the node's page: no page of its own
CONTRACT = "organisations/scopes/<uuid:public_id>/contract/"  # a form's route, and a scope's page when opened

MODELS, FLEET, ORGS = ("Models", "/models/held/"), ("Fleet", "/fleet/"), ("Organisations", "/organisations/")
TREE = ("Tree", "/organisations/")


def scope(s) -> tuple[str, str]:
    return (s.name, f"/organisations/scopes/{s.public_id}/")


def tree(w) -> list:
    acme = w.personas.acme
    return [scope(acme.org), scope(acme.team), scope(acme.project)]


# What an administrator's trail is on each record's page: (label, link), the last one current (None).
TRAILS = {
    "models/deployments/<uuid:public_id>/": lambda w: [MODELS, ("Deployments", "/models/"), (w.deployment.name, None)],
    "models/held/<uuid:public_id>/": lambda w: [MODELS, ("Catalog", "/models/held/"), (w.model.name, None)],
    "models/jobs/<uuid:public_id>/": lambda w: [MODELS, ("Catalog", "/models/held/"), (f"Fetch {w.fetch.repo}", None)],
    "fleet/nodes/<uuid:public_id>/": lambda w: [FLEET, ("Nodes", "/fleet/"), (w.node.name, None)],
    "gateway/batches/<str:public_id>/": lambda w: [("Gateway", "/gateway/"), ("Batches", "/gateway/batches/"),
                                                   (w.batch.public_id, None)],
    "organisations/scopes/<uuid:public_id>/": lambda w: [ORGS, TREE, *tree(w)[:-1], (w.scope.name, None)],
    CONTRACT: lambda w: [ORGS, TREE, *tree(w), ("Contract", None)],
    "organisations/clients/<uuid:public_id>/": lambda w: [ORGS, ("Service clients", "/organisations/clients/"),
                                                          *tree(w), (w.client.name, None)],
    "organisations/approvals/<uuid:public_id>/": lambda w: [
        ORGS, ("Approvals", "/organisations/approvals/"), (f"contract.raise_limit on {w.approval.subject_repr}", None)],
}


class TrailParser(HTMLParser):
    """The crumbs of ``<nav class="breadcrumbs">``: (label, href, current) each, and how many such navs."""

    def __init__(self):
        super().__init__()
        self.navs, self.crumbs, self._in_nav, self._crumb = 0, [], False, None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "nav" and "breadcrumbs" in (attrs.get("class") or "").split():
            assert attrs.get("aria-label") == "Breadcrumb"
            self.navs += 1
            self._in_nav = True
        elif self._in_nav and tag in ("a", "span"):
            self._crumb = [attrs.get("title", ""), attrs.get("href"), attrs.get("aria-current") == "page", ""]

    def handle_data(self, data):
        if self._crumb is not None:
            self._crumb[3] += data

    def handle_endtag(self, tag):
        if tag == "nav":
            self._in_nav = False
        elif self._crumb is not None and tag in ("a", "span"):
            title, href, current, text = self._crumb
            assert title == text, "a crumb's title is its whole label, for when it is clipped"
            self.crumbs.append((text, href, current))
            self._crumb = None


def trail(html: str) -> list[tuple[str, str | None]]:
    """The page's crumbs as (label, link), the current one's link None; checks that there is one trail, above
    the h1, and that only its last crumb is current."""
    parser = TrailParser()
    parser.feed(html)
    assert parser.navs == 1, "one breadcrumb trail"
    nav = html.index('class="breadcrumbs"')
    assert html.index("</nav>", nav) < html.index("<h1"), "the trail comes above the h1"
    assert [current for _, _, current in parser.crumbs] == [False] * (len(parser.crumbs) - 1) + [True]
    assert all(href is None for _, href, current in parser.crumbs if current), "the current crumb is no link"
    return [(label, href) for label, href, _ in parser.crumbs]


def page(user, url) -> str:
    client = Client()
    client.force_login(user)
    response = client.get(url)
    assert response.status_code == 200, (url, response.status_code)
    return response.content.decode()


@pytest.fixture
def world(personas):
    return build_world(personas)


def test_every_records_page_has_a_trail_declared():
    records = {route for route, spec in ROUTES.items() if isinstance(spec, Page) and spec.target} - {STREAM, NODE_JOBS}
    assert sorted(records | {CONTRACT}) == sorted(TRAILS)


@pytest.mark.parametrize("route", sorted(TRAILS))
def test_an_administrator_sees_the_whole_trail(route, world, admin_user):
    spec = ROUTES[route]
    url = url_of(route, Page("scope") if route == CONTRACT else spec, world)
    html = page(admin_user, url)
    assert trail(html) == TRAILS[route](world)
    # The first crumb is the area the top bar marks.
    areas = html[html.index('aria-label="Areas"'):]
    href, label = re.search(r'<a href="([^"]*)" class="active"[^>]*>([^<]+)</a>', areas).groups()
    assert (label, href) == trail(html)[0]


def test_an_organisations_page_is_its_trails_end(world, admin_user):
    org = world.personas.acme.org
    assert trail(page(admin_user, scope(org)[1])) == [ORGS, TREE, (org.name, None)]


def test_a_team_member_sees_no_crumb_of_the_organisation_above_their_team(world, personas):
    acme = personas.acme
    assert trail(page(personas.max, scope(acme.project)[1])) == [ORGS, TREE, scope(acme.team), ("Search", None)]
    assert trail(page(personas.max, f"/organisations/clients/{world.client.public_id}/")) == [
        ORGS, ("Service clients", "/organisations/clients/"), scope(acme.team), scope(acme.project),
        (world.client.name, None)]


def test_a_project_viewer_sees_only_their_project_in_the_trail(world, personas):
    acme = personas.acme
    assert trail(page(personas.vera, scope(acme.project)[1])) == [ORGS, TREE, ("Search", None)]
    crumbs = trail(page(personas.vera, f"/organisations/clients/{world.client.public_id}/"))
    assert crumbs == [ORGS, ("Service clients", "/organisations/clients/"), scope(acme.project),
                      (world.client.name, None)]
    above = {scope(acme.org)[1], scope(acme.team)[1]}
    assert not above & {href for _, href in crumbs} and not {"Acme", "ML"} & {label for label, _ in crumbs}


def test_another_organisations_owner_gets_no_trail_into_acme(world, personas):
    client = Client()
    client.force_login(personas.oscar)
    response = client.get(scope(personas.acme.project)[1])
    assert response.status_code == 404 and 'class="breadcrumbs"' not in response.content.decode()
