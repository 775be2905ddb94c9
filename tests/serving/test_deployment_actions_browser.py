"""A real Chromium on the deployment page: the buttons carry readable labels, Stop and Remove ask
first, and each outcome shows in place (the buttons swapped for the new state) until Remove goes
back to the list."""

from __future__ import annotations

import shutil

import pytest
from playwright.sync_api import sync_playwright

from scheduler.services import NodeReport, register_node
from serving import queues
from serving.deployments import service
from serving.models import Deployment
from tenancy.audit import Actor
from tests.test_browser import CHROMIUM_ARGS

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_stop_and_remove_ask_first_and_say_how_it_went_in_place(live_server, admin_user, admin_password,
                                                                chromium_path, artifacts_dir, tmp_path, settings,
                                                                tiny_model, monkeypatch):
    root = tmp_path / "models"
    root.mkdir()
    settings.SCHEDULER_MODEL_ROOTS = [root.resolve()]
    monkeypatch.setattr(queues, "to_node", lambda operation, replica: None)  # no agent: it stays planned
    # The test's live server is WSGI, which cannot serve the endless server-sent event stream: the
    # page polls instead, as it does on the embedded default.
    settings.REDIS_URL = ""
    node = register_node(NodeReport(name="cpu-01", address="127.0.0.1", cpu_count=8, memory_total_bytes=64 * 2**30,
                                    memory_available_bytes=60 * 2**30))
    deployment = service.deploy(Actor(system="tests"), service.DeployRequest(
        name="tiny", model_path=str(shutil.copy(tiny_model, root / "tiny.gguf")), node=node, config={"context": 256}))
    url = f"{live_server.url}/models/deployments/{deployment.public_id}/"
    # Everything the ORM needs is done above: Playwright's sync API runs an event loop in this thread.
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            errors, asked = [], []
            page.on("console", lambda message: errors.append(f"{message.text} {message.location.get('url')}")
                    if message.type == "error" and not message.location.get("url", "").endswith("/favicon.ico")
                    else None)
            page.on("dialog", lambda dialog: (asked.append(dialog.message), dialog.accept()))
            page.goto(url)
            page.fill("#id_username", "ada")
            page.fill("#id_password", admin_password)
            page.click("button[type=submit]")
            page.wait_for_url(url)
            buttons = page.locator("#deployment-buttons button")
            assert buttons.all_inner_texts() == ["Stop", "Remove"]  # planned: it may stop, or go at once
            assert "{#" not in page.locator("main").inner_text()
            remove = page.locator("#deployment-buttons [data-verb=remove] button")
            ink, ground = remove.evaluate("b => [getComputedStyle(b).color, getComputedStyle(b).backgroundColor]")
            assert ink != ground, f"the Remove label is not readable: {ink} on {ground}"
            page.screenshot(path=str(artifacts_dir / "deployment-planned.png"), full_page=True)

            page.click("#deployment-buttons [data-verb=stop] button")
            page.wait_for_selector("#deployment-buttons [data-verb=start]")
            assert asked == ["Stop tiny? Requests to it fail until it runs again."]
            assert page.locator("#action-result").inner_text() == "tiny stopped."
            assert buttons.all_inner_texts() == ["Start", "Remove"]
            assert "Stopped" in page.locator("#deployment-live h2").first.inner_text()
            assert page.url == url  # swapped in place, not a new page
            assert page.locator(".heading-row").inner_text().split() == ["tiny", "Start", "Remove"]
            page.screenshot(path=str(artifacts_dir / "deployment-stopped.png"), full_page=True)

            page.click("#deployment-buttons [data-verb=remove] button")
            page.wait_for_url(f"{live_server.url}/models/")
            assert asked[-1].startswith("Remove tiny?")
            assert "tiny removed." in page.locator(".messages").inner_text()
            page.screenshot(path=str(artifacts_dir / "deployment-removed.png"), full_page=True)
            assert not errors, errors
        finally:
            browser.close()
    assert not Deployment.objects.exists()
