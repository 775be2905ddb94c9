"""The dashboard (the landing page): the figures of ``manage.py status`` (one function), memory per
node and accelerator class as bars, models satisfied with parked and unplaceable ones and why, the
last day's requests and tokens per hour and latency per model from the gateway's usage rows, the
watchdog, recent failures and the approvals waiting for the viewer — each linking to its page, each
narrowed to the viewer (another organisation's owner sees none of acme's; a viewer sees their
project's and decides nothing), the fleet's memory everyone's as on the Fleet page. Then the
navigation: every console page is reached by following links from the dashboard, and the current
area and section are marked."""

from __future__ import annotations

import re
from collections import deque
from datetime import timedelta
from html import unescape
from urllib.parse import urlsplit

import pytest
from django.contrib.auth import get_user_model
from django.core.cache import cache
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import Resolver404, resolve
from django.utils import timezone
from playwright.sync_api import sync_playwright

from berth import views
from gateway.models import UsageRecord
from scheduler.models import Accelerator, MemoryReservation, PlacementDecision, RecoveryState
from scheduler.services import NodeReport, register_node
from serving.api.status import figures
from serving.models import Deployment, DeploymentEvent, ModelEntry, Replica
from serving.control import watchdog
from tenancy.models import Membership
from tenancy.services import approvals, contracts
from tests.assets.world import build_world
from tests.test_browser import CHROMIUM_ARGS
from tests.test_console_walk import ROUTES, Page

pytestmark = pytest.mark.django_db
GIB = 2**30


def entry(name, owner, scaling_min=1):
    return ModelEntry.objects.create(name=name, owner=owner, source_kind="local", source_path=f"/models/{name}.gguf",
                                     format="gguf", task="chat", scaling_min=scaling_min,
                                     profiles=[{"name": "cpu", "engine": "llamacpp", "file": f"{name}.gguf"}])


def usage(project, model, started_at, *, status=200, total_ms=100.0, prompt=10, completion=20):
    return UsageRecord.objects.create(
        request_id=f"req-{UsageRecord.objects.count()}", started_at=started_at,
        finished_at=started_at + timedelta(milliseconds=total_ms), endpoint="chat/completions", model_asked=model,
        model_served=model, status=status, total_ms=total_ms, prompt_tokens=prompt, completion_tokens=completion,
        project=project, scope_path=project.path)


@pytest.fixture
def fleet(personas, settings):
    """gpu-01: two H100s, one holding a 10 GiB reservation and measuring 20 GiB in use, the other
    not read; cpu-01: no GPU, 32 GiB of which 8 in use and 2 reserved. acme-chat serves (1 of 1),
    acme-parked is parked, globex-stuck cannot be placed; acme-chat failed once today. acme's usage:
    three requests today (one refused) and one from yesterday; globex's: one. Olivia asked for more
    GPUs for acme's project: adam (an admin of acme) may decide it."""
    acme, globex = personas.acme.project, personas.globex.project
    gpu = register_node(NodeReport(name="gpu-01", address="127.0.0.1", memory_total_bytes=64 * GIB,
                                   memory_available_bytes=48 * GIB))
    cpu = register_node(NodeReport(name="cpu-01", address="127.0.0.1", memory_total_bytes=32 * GIB,
                                   memory_available_bytes=24 * GIB))
    held = Accelerator.objects.create(node=gpu, index=0, uuid="GPU-a", accelerator_class="H100-80GB",
                                      memory_total_bytes=80 * GIB, memory_used_bytes=20 * GIB)
    Accelerator.objects.create(node=gpu, index=1, uuid="GPU-b", accelerator_class="H100-80GB",
                               memory_total_bytes=80 * GIB)
    MemoryReservation.objects.create(node=gpu, accelerator=held, holder="replica:chat", bytes=10 * GIB)
    MemoryReservation.objects.create(node=cpu, holder="replica:cpu", bytes=2 * GIB)
    settings.SCHEDULER_SAFETY_MARGIN_UNIFIED_GIB = 1
    cache.delete_many([watchdog._level_key(node) for node in (gpu, cpu)])
    watchdog.check(gpu)
    watchdog.check(cpu)

    chat = entry("acme-chat", acme)
    entry("acme-parked", acme)
    stuck = entry("globex-stuck", globex)
    deployment = Deployment.objects.create(name="acme-chat", model_path="/models/acme-chat.gguf", node=gpu,
                                           owner=acme, state="ready", replicas=1)
    Replica.objects.create(deployment=deployment, node=gpu, port=20001, state="ready", ready_at=timezone.now())
    DeploymentEvent.objects.create(deployment=deployment, from_state="starting", to_state="failed",
                                   message="engine exited with 1 before it was ready")
    RecoveryState.objects.create(model="acme-parked", kind="crash", consecutive=5, parked=True,
                                 parked_at=timezone.now(), last_error="crashed five times")
    PlacementDecision.objects.create(model="globex-stuck", owner=globex, verdict="unschedulable",
                                     reason_codes=["no_fit"], detail="no node has 200 GiB free",
                                     inputs_digest="0" * 32, fingerprint="0" * 32)

    now = timezone.now()
    usage(acme, "acme-chat", now - timedelta(hours=2), total_ms=100.0)
    usage(acme, "acme-chat", now - timedelta(hours=2), total_ms=300.0)
    usage(acme, "acme-chat", now - timedelta(minutes=1), status=429, total_ms=5.0, prompt=None, completion=None)
    usage(acme, "acme-chat", now - timedelta(hours=30), total_ms=9000.0)  # yesterday: not in the day's figures
    usage(globex, "globex-stuck", now - timedelta(hours=1), total_ms=50.0, prompt=7, completion=1)

    adam = get_user_model().objects.create_user("adam", "adam@example.org", personas.password)
    Membership.objects.create(user=adam, scope=personas.acme.org, role="admin")
    contracts.set_contract(personas.olivia_actor, acme, gpus_limit=4)
    approval = approvals.request_approval(personas.olivia_actor, "contract.raise_limit", acme, acme,
                                          contracts.raise_limit_evidence(acme, gpus_limit=8), "more GPUs for search")
    return {"gpu": gpu, "cpu": cpu, "chat": chat, "stuck": stuck, "deployment": deployment, "adam": adam,
            "approval": approval}


def dashboard(user, **headers) -> str:
    client = Client()
    client.force_login(user)
    response = client.get("/", **headers)
    assert response.status_code == 200
    return response.content.decode()


def hrefs(html: str) -> list[str]:
    return [unescape(h) for h in re.findall(r'href="([^"]*)"', html)]


def panel(html: str, name: str) -> str:
    start = html.index(f'id="{name}"')
    return html[start:html.index("</section>", start)]


def test_memory_per_node_and_class_shows_reserved_measured_and_free(fleet, admin_user):
    html = dashboard(admin_user)
    memory = panel(html, "memory")
    # The class: 2 units, 160 GiB; 10 reserved; measured not known (one card not read): free rests on the reservations.
    assert "10.0 GiB reserved · not measured · 150.0 GiB free of 160.0 GiB" in memory
    # gpu-01's cards alike; cpu-01's system memory: 2 reserved, 8 measured (32 - 24), so 24 free.
    assert "2.0 GiB reserved · 8.0 GiB measured · 24.0 GiB free of 32.0 GiB" in memory
    assert 'style="width:6.2%"' in memory  # 2 of 32 reserved
    assert 'style="width:18.8%"' in memory  # 6 of 32 measured beyond the reservation
    assert 'style="left:25.0%"' in memory  # the measured use ends at 8 of 32
    assert f'href="/fleet/nodes/{fleet["gpu"].public_id}/"' in memory
    assert f'href="/fleet/nodes/{fleet["cpu"].public_id}/"' in memory
    # The same figures as the status (one function).
    data = figures(admin_user)
    [system] = [row for node in data["memory"] if node["node"] == "cpu-01" for row in node["memory"]]
    assert (system["reserved_bytes"], system["measured_bytes"], system["free_bytes"]) == (2 * GIB, 8 * GIB, 24 * GIB)
    [cards] = [row for node in data["memory"] if node["node"] == "gpu-01" for row in node["memory"]
               if row["kind"] == "accelerator"]
    assert (cards["units"], cards["reserved_bytes"], cards["measured_bytes"]) == (2, 10 * GIB, None)


def test_memory_bar_measured_beyond_the_reservation():
    row = {"kind": "accelerator", "device": "H100-80GB", "units": 1, "total_bytes": 80 * GIB,
           "reserved_bytes": 10 * GIB, "measured_bytes": 30 * GIB, "free_bytes": 50 * GIB}
    bar = views.memory_bar(row)
    assert (bar["reserved_pct"], bar["beyond_pct"], bar["measured_pct"]) == (12.5, 25.0, 37.5)
    # Measured under what is reserved: nothing beyond, the tick inside the reserved part.
    bar = views.memory_bar({**row, "measured_bytes": 4 * GIB})
    assert (bar["reserved_pct"], bar["beyond_pct"], bar["measured_pct"]) == (12.5, 0.0, 5.0)
    assert views.memory_bar({**row, "total_bytes": 0})["known"] is False


def test_models_satisfied_with_parked_and_unplaceable_and_their_reasons(fleet, admin_user):
    html = dashboard(admin_user)
    models = panel(html, "models")
    assert "1 of 3 satisfied" in models
    assert f'href="/models/held/{fleet["chat"].public_id}/"' in models
    assert "parked after 5 failure(s) in a row: crashed five times" in models
    assert "no node has 200 GiB free" in models
    assert 'href="/fleet/placement/?model=globex-stuck"' in models
    tiles = html[html.index('id="tile-models"'):html.index('id="tile-nodes"')]
    assert "1 of 3" in tiles and "1 parked, 1 unplaceable" in tiles
    assert 'href="/models/?state=ready">1 ready</a>' in models


def test_the_hourly_buckets_of_the_last_day(personas):
    acme = personas.acme.project
    now = timezone.now()
    end = now.replace(minute=0, second=0, microsecond=0)
    usage(acme, "m", end - timedelta(hours=2) + timedelta(minutes=5), prompt=1, completion=2)
    usage(acme, "m", end - timedelta(hours=2) + timedelta(minutes=50), status=500, prompt=3, completion=4)
    usage(acme, "m", end, prompt=5, completion=6)  # the current hour, however young
    usage(acme, "m", end - timedelta(hours=23) + timedelta(minutes=1))  # the first bucket
    usage(acme, "m", end - timedelta(hours=23, minutes=1))  # before it: not shown
    result = views.hourly_usage(UsageRecord.objects.all(), now)
    buckets = result["buckets"]
    assert len(buckets) == 24 and buckets[-1]["hour"] == end and buckets[0]["hour"] == end - timedelta(hours=23)
    assert [(b["requests"], b["refused"]) for b in buckets if b["requests"]] == [(1, 0), (2, 1), (1, 0)]
    assert buckets[21]["requests"] == 2 and (buckets[21]["prompt"], buckets[21]["completion"]) == (4, 6)
    assert buckets[23]["requests"] == 1 and buckets[0]["requests"] == 1
    assert result["totals"] == {"requests": 4, "refused": 1, "prompt": 19, "completion": 32, "tokens": 51}
    label = f"{end - timedelta(hours=2):%H}:00"
    assert f"<title>{label} answered: 1</title>" in result["requests_chart"]
    assert f"<title>{label} refused: 1</title>" in result["requests_chart"]
    assert f"<title>{label} completion: 6</title>" in result["tokens_chart"]
    assert result["requests_chart"].count("<text") >= 8  # hour labels and the axis


def test_requests_tokens_and_latency_of_the_day(fleet, admin_user):
    html = dashboard(admin_user)
    requests = html[html.index('id="tile-requests"'):html.index('id="tile-tokens"')]
    assert ">4<" in requests and "1 refused or failed" in requests  # three of acme's today, one of globex's
    tokens = html[html.index('id="tile-tokens"'):html.index('id="tile-watchdog"')]
    assert ">68<" in tokens  # 10+20 twice, 7+1
    assert '<svg class="chart"' in panel(html, "requests") and '<svg class="chart"' in panel(html, "tokens")
    latency = panel(html, "latency")
    assert 'href="/gateway/?model=acme-chat"' in latency and 'href="/gateway/?model=globex-stuck"' in latency
    assert "9000" not in latency  # yesterday's request is not in the day's percentiles
    [row] = [r for r in views.latency(UsageRecord.objects.all()) if r["model_served"] == "acme-chat"]
    assert row["requests"] == 3 and row["p50"] == pytest.approx(100.0) and row["p95"] == pytest.approx(280.0)


def test_watchdog_failures_and_approvals_link_to_their_pages(fleet, admin_user, personas):
    html = dashboard(admin_user)
    assert '<a class="tile level-ok" href="/fleet/" id="tile-watchdog">' in html
    failures = panel(html, "failures")
    assert "engine exited with 1 before it was ready" in failures
    assert f'href="/models/deployments/{fleet["deployment"].public_id}/"' in failures
    assert f'href="/organisations/approvals/{fleet["approval"].public_id}/"' in failures
    # Olivia asked: it waits for adam (another admin of acme), not for her.
    assert f'/organisations/approvals/{fleet["approval"].public_id}/' in dashboard(fleet["adam"])
    assert f'/organisations/approvals/{fleet["approval"].public_id}/' not in dashboard(personas.olivia)
    assert "Nothing waits for your decision" in dashboard(personas.olivia)


def test_another_orgs_owner_sees_none_of_acmes_models_usage_or_failures(fleet, personas):
    html = dashboard(personas.oscar)
    assert "acme" not in html
    assert "globex-stuck" in panel(html, "models") and "0 of 1 satisfied" in panel(html, "models")
    requests = html[html.index('id="tile-requests"'):html.index('id="tile-tokens"')]
    assert ">1<" in requests  # globex's one request
    assert "No deployment failed" in panel(html, "failures") and "Nothing waits for your decision" in html
    # The fleet's memory is everyone's, as on the Fleet page; no holder is named.
    assert "10.0 GiB reserved" in panel(html, "memory") and "replica:chat" not in html


def test_a_viewer_sees_their_projects_figures_and_decides_nothing(fleet, personas):
    html = dashboard(personas.vera)
    assert "globex" not in html
    assert "acme-chat" in panel(html, "models") and "1 of 2 satisfied" in panel(html, "models")
    requests = html[html.index('id="tile-requests"'):html.index('id="tile-tokens"')]
    assert ">3<" in requests
    assert "engine exited with 1" in panel(html, "failures")
    assert str(fleet["approval"].public_id) not in html


def test_empty_dashboard_says_what_to_do_next(admin_user):
    html = dashboard(admin_user)
    assert "No node has registered yet" in html and "make up" in html
    assert "No model yet" in html and 'href="/models/fetch/"' in html and 'href="/models/explore/"' in html
    assert "No request in the last 24 hours" in html and 'href="/gateway/playground/"' in html
    assert "none yet" in html and 'href="/models/deploy/"' in html


def test_the_fragment_polls_itself_and_every_link_opens(fleet, admin_user):
    fragment = dashboard(admin_user, HTTP_HX_REQUEST="true")
    assert "<html" not in fragment
    assert fragment.lstrip().startswith('<div id="dashboard" hx-get="/" hx-trigger="every 5s" hx-swap="outerHTML"')
    client = Client()
    client.force_login(admin_user)
    links = sorted({h for h in hrefs(fragment) if not h.startswith("#")})
    assert len(links) >= 15
    for link in links:
        response = client.get(link)
        assert response.status_code == 200, f"{link}: {response.status_code}"


def test_queries_do_not_grow_with_nodes_models_usage_and_approvals(fleet, personas):
    def count() -> int:
        client = Client()
        client.force_login(fleet["adam"])
        client.get("/")
        with CaptureQueriesContext(connection) as captured:
            assert client.get("/").status_code == 200
        return len(captured)

    def more(n):
        node = register_node(NodeReport(name=f"more-{n}", address="127.0.0.1", memory_total_bytes=GIB))
        Accelerator.objects.create(node=node, index=0, uuid=f"GPU-more-{n}", accelerator_class="A100-40GB",
                                   memory_total_bytes=40 * GIB, memory_used_bytes=GIB)
        model = entry(f"acme-more-{n}", personas.acme.project)
        deployment = Deployment.objects.create(name=model.name, model_path=f"/models/{model.name}.gguf", node=node,
                                               owner=personas.acme.project, state="ready")
        Replica.objects.create(deployment=deployment, node=node, port=21000 + n, state="ready")
        DeploymentEvent.objects.create(deployment=deployment, from_state="loading", to_state="failed", message="x")
        usage(personas.acme.project, model.name, timezone.now() - timedelta(hours=n))
        approvals.request_approval(personas.olivia_actor, "contract.raise_limit", personas.acme.project,
                                   personas.acme.project,
                                   contracts.raise_limit_evidence(personas.acme.project, gpus_limit=8 + n), f"more {n}")

    for n in range(1, 6):  # past the five failures listed, so that they are counted too
        more(n)
    before = count()
    for n in range(6, 9):
        more(n)
    assert count() == before


# --- navigation --------------------------------------------------------------------------------

# Reached otherwise than by a link: the deployment page's script opens its event stream.
NOT_LINKED = {"models/deployments/<uuid:public_id>/stream/"}
SKIP = ("/static/", "/admin/", "/api/", "/logout/", "/login/")


def crawl(user, start="/", limit=400, urls: list | None = None) -> tuple[dict[str, int], dict[str, str]]:
    """Follow every same-site link from ``start`` (each route opened at most three times): the
    routes reached with their status, and for each the page it was first linked from. ``urls``, when
    given, gets each URL opened, in order (tests/test_console_crawl.py opens them in Chromium)."""
    client = Client()
    client.force_login(user)
    reached, linked_from, opened = {}, {}, {}
    queue, seen = deque([(start, "")]), {start}
    while queue and len(seen) < limit:
        url, parent = queue.popleft()
        try:
            route = resolve(urlsplit(url).path).route
        except Resolver404:
            reached[url] = 404
            linked_from[url] = parent
            continue
        if opened.get(route, 0) >= 3 or route in NOT_LINKED:
            continue
        opened[route] = opened.get(route, 0) + 1
        response = client.get(url)
        if urls is not None:
            urls.append(url)
        reached[route] = max(reached.get(route, 0), response.status_code)
        linked_from.setdefault(route, parent)
        if response.get("Content-Type", "").startswith("text/html"):
            for href in hrefs(response.content.decode(errors="replace")):
                parts = urlsplit(href)
                if parts.scheme or parts.netloc or not parts.path.startswith("/") or parts.path.startswith(SKIP):
                    continue
                target = parts.path + (f"?{parts.query}" if parts.query else "")
                if target not in seen:
                    seen.add(target)
                    queue.append((target, url))
    return reached, linked_from


def test_every_console_page_is_reached_by_links_from_the_dashboard(personas, admin_user):
    world = build_world(personas)
    reached, linked_from = crawl(admin_user)
    pages = {route for route, spec in ROUTES.items() if isinstance(spec, Page)} - NOT_LINKED
    assert sorted(pages - set(reached)) == [], "no link reaches these console pages"
    allowed = {route: spec.answers for route, spec in ROUTES.items() if isinstance(spec, Page)}
    wrong = {route: (status, linked_from[route]) for route, status in reached.items()
             if status not in allowed.get(route, {200})}
    assert wrong == {}, "pages that answered badly (status, linked from)"
    assert world.node.name  # the world's rows were there to link to


@pytest.mark.parametrize(("url", "area", "section"), [
    ("/", "Dashboard", None),
    ("/fleet/placement/", "Fleet", "Placement"),
    ("/fleet/", "Fleet", "Nodes"),
    ("/models/held/", "Models", "Catalog"),
    ("/models/fetch/", "Models", "Catalog"),
    ("/models/", "Models", "Deployments"),
    ("/gateway/", "Gateway", "Usage"),
    ("/gateway/playground/", "Gateway", "Playground"),
    ("/organisations/audit/", "Organisations", None),
])
def test_the_current_area_and_section_are_marked(admin_user, url, area, section):
    client = Client()
    client.force_login(admin_user)
    html = client.get(url).content.decode()
    areas = html[html.index('aria-label="Areas"'):html.index("</nav>", html.index('aria-label="Areas"'))]
    marked = re.findall(r'<a href="[^"]*" class="active" aria-current="(?:page|true)">([^<]+)</a>', areas)
    assert marked == [area]
    sections = re.findall(r'<nav class="subnav sections".*?</nav>', html, re.S)
    if section is None:
        assert sections == []  # the dashboard has none; Organisations' pages draw their own
    else:
        [nav] = sections
        assert re.findall(r'class="active" aria-current="(?:page|true)">([^<]+)</a>', nav) == [section]


def test_the_estimate_is_offered_to_staff_only(admin_user, personas):
    client = Client()
    client.force_login(personas.olivia)
    assert "Will it fit?" not in client.get("/fleet/placement/").content.decode()
    client.force_login(admin_user)
    assert "Will it fit?" in client.get("/fleet/placement/").content.decode()


@pytest.mark.browser
@pytest.mark.django_db(transaction=True)
def test_the_dashboard_in_chromium_holds_at_1280_pixels(fleet, live_server, admin_user, admin_password,
                                                        chromium_path, artifacts_dir):
    # Everything the ORM needs is done above: Playwright's sync API runs an event loop in this thread.
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            errors = []
            page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
            page.on("response", lambda response: errors.append(f"{response.status} {response.url}")
                    if response.status >= 400 else None)
            page.goto(live_server.url + "/")
            page.fill("#id_username", "ada")
            page.fill("#id_password", admin_password)
            page.click("button[type=submit]")
            page.wait_for_url(live_server.url + "/")
            page.wait_for_selector("#memory .mem")
            page.screenshot(path=str(artifacts_dir / "dashboard.png"), full_page=True)
            assert errors == []
            # No panel wider than the window; every header and row on one line.
            assert page.evaluate("document.documentElement.scrollWidth") <= 1280
            heights = page.evaluate("""() => [...document.querySelectorAll('#dashboard table.records tr')]
                .map(row => row.getBoundingClientRect().height)""")
            assert heights and max(heights) <= min(heights) * 1.5, heights
            for heading in page.locator("#dashboard h2").all():
                assert heading.bounding_box()["height"] < 30, heading.inner_text()
            # It stays live: the fragment swaps itself in.
            with page.expect_response(lambda r: r.url == live_server.url + "/"
                                      and r.request.headers.get("hx-request") == "true", timeout=15_000):
                pass
            page.click("#tile-nodes")
            page.wait_for_url(live_server.url + "/fleet/")
            assert page.locator("nav.areas a[aria-current]").inner_text() == "Fleet"
        finally:
            browser.close()
