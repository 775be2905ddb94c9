"""A real Chromium logs in and moves between areas of the console."""

import pytest
from playwright.sync_api import sync_playwright

from scheduler.services import NodeReport, register_node

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def test_person_logs_in_and_sees_the_fleet_in_one_line_per_node(live_server, admin_user, admin_password,
                                                                chromium_path, artifacts_dir):
    register_node(NodeReport(name="a-node-with-a-rather-long-name-that-must-be-clipped-not-wrapped-" + "x" * 60,
                             address="127.0.0.1", cpu_count=2))
    # Everything the ORM needs is done above: Playwright's sync API runs an event loop in this thread.
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(live_server.url + "/")
            assert "/login/" in page.url
            page.fill("#id_username", "ada")
            page.fill("#id_password", admin_password)
            page.click("button[type=submit]")
            page.wait_for_url(live_server.url + "/")
            assert page.locator("h1").inner_text() == "Dashboard"
            page.click("nav.areas >> text=Fleet")
            page.wait_for_url(live_server.url + "/fleet/")
            row = page.locator("table.records tbody tr").first
            height = row.bounding_box()["height"]
            header_height = page.locator("table.records thead tr").bounding_box()["height"]
            assert height <= header_height * 1.5, "a record wrapped onto more than one line"
            assert page.evaluate("typeof htmx") == "object"  # htmx loaded from our static files
            page.screenshot(path=str(artifacts_dir / "fleet.png"), full_page=True)
        finally:
            browser.close()
