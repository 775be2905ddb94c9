"""Every console page the dashboard's links reach (``tests/test_dashboard.py``'s ``crawl``, over the world
of ``tests/assets/world.py``), opened in a real Chromium at 1280 and 1920 pixels wide as an administrator:
no console error and no failed request, no page wider than the window, no table row or header of a
records table on more than one line, no heading or breadcrumb trail on more than one line, no button whose
text reads at less than 4.5:1 against what lies behind it. A screenshot of each page at 1280 is left under
``test-artifacts/crawl/`` to look at."""

from __future__ import annotations

import re

import pytest
from django.urls import resolve
from playwright.sync_api import sync_playwright

from tenancy.services import clients, tree
from tests.assets.world import build_world
from tests.test_browser import CHROMIUM_ARGS
from tests.test_dashboard import crawl

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

WIDTHS = (1280, 1920)
LONG_NAME = ("Retrieval-augmented generation over the customer support knowledge base, re-indexed nightly from the "
             "ticketing system and the product manuals")
SCREENSHOT_WIDTH = 1280

# Deliberate exceptions, each with its reason. Routes the crawl reaches that are no page, not opened here:
NOT_PAGES = {
    "organisations/audit/export.jsonl": "a download (JSON lines), not a page",
}
# Requests the browser is answered without the server: (URL pattern, status) -> why.
ANSWERED_HERE = {
    (r".*/models/deployments/[^/]+/stream/$", 204): "a deployment's page listens to its event stream, an endless "
    "response the test's live server (WSGI) cannot stream (uvicorn does): the answer the view gives without Redis "
    "(nothing to listen to: the page polls)",
}

# What a page must hold to, measured in the page: a list of problems, empty when it holds.
LAYOUT = r"""() => {
  const problems = [];
  const root = document.documentElement;
  if (root.scrollWidth > root.clientWidth) {
    problems.push(`the page is ${root.scrollWidth}px wide in ${root.clientWidth}px`);
  }
  const shown = (el) => el.getClientRects().length > 0;
  const label = (el) => el.innerText.replace(/\s+/g, ' ').trim().slice(0, 70);
  // How many lines an element's own text takes: its content's height against its line height.
  const lines = (el) => {
    const range = document.createRange();
    range.selectNodeContents(el);
    const style = getComputedStyle(el);
    const line = parseFloat(style.lineHeight) || parseFloat(style.fontSize) * 1.2;
    return range.getBoundingClientRect().height / line;
  };
  for (const table of document.querySelectorAll('table.records')) {
    if (!shown(table)) continue;  // in a closed <details>
    for (const th of table.querySelectorAll('th')) {
      if (lines(th) > 1.5) problems.push(`header "${label(th)}" wraps`);
    }
    const header = table.querySelector('thead tr');
    const high = header.getBoundingClientRect().height;
    for (const row of table.querySelectorAll('tbody tr')) {
      const height = row.getBoundingClientRect().height;
      if (height > high * 1.5) {
        problems.push(`row "${label(row)}" is ${Math.round(height)}px high, its header ${Math.round(high)}px`);
      }
    }
  }
  for (const heading of document.querySelectorAll('h1, h2, h3, .breadcrumbs ol')) {
    if (shown(heading) && lines(heading) > 1.5) {
      problems.push(`${heading.tagName.toLowerCase()} "${label(heading)}" wraps`);
    }
  }
  // Every button reads: its text against what lies behind it, 4.5:1 at least (WCAG AA for text).
  const rgba = (color) => (color.match(/[\d.]+/g) || []).map(Number);
  const luminance = ([r, g, b]) => {
    const linear = (v) => (v /= 255) <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4;
    return 0.2126 * linear(r) + 0.7152 * linear(g) + 0.0722 * linear(b);
  };
  const behind = (el) => {
    for (; el; el = el.parentElement) {
      const color = rgba(getComputedStyle(el).backgroundColor);
      if (color.length === 3 || color[3] > 0) return color;
    }
    return [255, 255, 255];
  };
  for (const button of document.querySelectorAll('button, a.button')) {
    if (!shown(button) || button.matches(':disabled') || !button.innerText.trim()) continue;
    const [text, ground] = [luminance(rgba(getComputedStyle(button).color)), luminance(behind(button))];
    const ratio = (Math.max(text, ground) + 0.05) / (Math.min(text, ground) + 0.05);
    if (ratio < 4.5) problems.push(`button "${label(button)}" reads at ${ratio.toFixed(1)}:1`);
  }
  return problems;
}"""


def answer(status: int):
    return lambda route: route.fulfill(status=status)


def shot_name(route: str, taken: dict) -> str:
    name = re.sub(r"[^a-z0-9]+", "-", re.sub(r"<\w+:(\w+)>", r"\1", route).lower()).strip("-") or "dashboard"
    taken[name] = taken.get(name, 0) + 1
    return f"{name}-{taken[name]}.png" if taken[name] > 1 else f"{name}.png"


def test_every_console_page_holds_in_chromium_at_1280_and_1920(personas, admin_user, admin_password, live_server,
                                                               chromium_path, artifacts_dir, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: the hub is away
    build_world(personas)
    urls = []
    crawl(admin_user, urls=urls)
    # Long names (a project's, its client's), on pages the crawl may not open (three of a kind at most):
    # the trail and the heading hold them on one line, clipped.
    project = tree.create_scope(personas.olivia_actor, "project", "long", LONG_NAME, personas.acme.team)
    client = clients.create_client(personas.olivia_actor, project, LONG_NAME[:100])
    urls += [f"/organisations/scopes/{project.public_id}/", f"/organisations/clients/{client.public_id}/"]
    routes = {url: resolve(url.split("?")[0]).route for url in urls}
    assert len(set(routes.values())) >= 20, "the crawl reached the console"
    shots = artifacts_dir / "crawl"
    shots.mkdir(exist_ok=True)
    for old in shots.glob("*.png"):
        old.unlink()
    problems, taken = [], {}
    # Everything the ORM needs is done above: Playwright's sync API runs an event loop in this thread.
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path, args=CHROMIUM_ARGS)
        try:
            for width in WIDTHS:
                context = browser.new_context(viewport={"width": width, "height": 900})
                for (pattern, status) in ANSWERED_HERE:
                    context.route(re.compile(pattern), answer(status))
                page = context.new_page()
                heard = []
                page.on("console", lambda message: heard.append(("console", message.text))
                        if message.type == "error" else None)
                page.on("response", lambda response: heard.append((response.status, response.url))
                        if response.status >= 400 else None)
                page.goto(live_server.url + "/login/")
                page.fill("#id_username", admin_user.username)
                page.fill("#id_password", admin_password)
                page.click("button[type=submit]")
                page.wait_for_url(live_server.url + "/")
                for url in urls:
                    route = routes[url]
                    if route in NOT_PAGES:
                        continue
                    heard.clear()
                    page.goto(live_server.url + url)
                    # What htmx asks for on load is part of the page: wait until none is in flight.
                    page.wait_for_function("() => !document.querySelector('.htmx-request')")
                    problems += [f"{width}px {url}: {what} {said}" for what, said in heard]
                    problems += [f"{width}px {url}: {problem}" for problem in page.evaluate(LAYOUT)]
                    if width == SCREENSHOT_WIDTH:
                        page.screenshot(path=str(shots / shot_name(route, taken)), full_page=True)
                context.close()
        finally:
            browser.close()
    assert problems == [], "\n".join(problems)
