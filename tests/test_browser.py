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


def test_a_header_sorts_its_table_by_figures_and_names_and_again_reverses(live_server, admin_user, admin_password,
                                                                          chromium_path, artifacts_dir):
    for name, memory in (("node-10", 64), ("node-2", 512), ("node-1", 8)):
        register_node(NodeReport(name=name, address="127.0.0.1", cpu_count=2, memory_total_bytes=memory * 2**30,
                                 memory_available_bytes=memory * 2**29))
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(live_server.url + "/login/?next=/fleet/")
            page.fill("#id_username", "ada")
            page.fill("#id_password", admin_password)
            page.click("button[type=submit]")
            page.wait_for_url(live_server.url + "/fleet/")
            names = lambda: page.locator("#fleet-table table.records tbody tr td:first-child").all_inner_texts()  # noqa: E731
            memory = page.locator("#fleet-table th", has_text="Memory").first
            memory.locator("button.sort").click()
            assert names() == ["node-1", "node-10", "node-2"]  # 8, 64, 512 GiB: by bytes, not by the text
            assert memory.get_attribute("aria-sort") == "ascending"
            memory.locator("button.sort").click()
            assert names() == ["node-2", "node-10", "node-1"] and memory.get_attribute("aria-sort") == "descending"
            # From the keyboard: names sort naturally (node-2 before node-10).
            page.locator("#fleet-table th", has_text="Name").locator("button.sort").focus()
            page.keyboard.press("Enter")
            assert names() == ["node-1", "node-2", "node-10"]
            # The table refreshes itself every 10 s: the order holds in the table swapped in.
            page.evaluate("document.querySelector('#fleet-table table').dataset.old = 'yes'")
            page.wait_for_function("""() => {
                const table = document.querySelector('#fleet-table table');
                return !table.dataset.old && table.querySelector('th[aria-sort=ascending]') !== null;
            }""", timeout=20_000)
            assert names() == ["node-1", "node-2", "node-10"]
            page.screenshot(path=str(artifacts_dir / "fleet-sorted.png"))
        finally:
            browser.close()
