"""A real Chromium: an owner creates a service client and a key, sees the key once with a copy
button, and revokes it in place."""

from decimal import Decimal

import pytest
from playwright.sync_api import sync_playwright

from tenancy.models import Contract, Credential
from tenancy.services import contracts
from tests.test_browser import CHROMIUM_ARGS

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_owner_creates_a_client_and_a_key_sees_it_once_and_revokes_it(live_server, personas, chromium_path,
                                                                      artifacts_dir):
    # Guarantees are set with an approval (test_hardening): the page is the subject here, so written directly.
    Contract.objects.create(scope=personas.acme.org, gpu_memory_gib_guarantee=Decimal(80),
                            gpu_memory_gib_limit=Decimal(160), gpus_limit=Decimal(2), cores_guarantee=Decimal(16))
    contracts.reserve(personas.acme.project, "replica:one", gpu_memory_gib=40, gpus=2, cores=4)
    # Everything the ORM needs is done above: Playwright's sync API runs an event loop in this thread.
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context()
            context.grant_permissions(["clipboard-read", "clipboard-write"], origin=live_server.url)
            page = context.new_page()
            page.on("dialog", lambda dialog: dialog.accept())  # hx-confirm on revoke
            page.goto(live_server.url + "/organisations/")
            page.fill("#id_username", "olivia")
            page.fill("#id_password", personas.password)
            page.click("button[type=submit]")
            page.wait_for_url(live_server.url + "/organisations/")
            page.screenshot(path=str(artifacts_dir / "tenancy-tree.png"), full_page=True)
            page.click("table.records >> text=Search")
            page.click("a.button:text-is('New service client')")
            page.fill("#id_name", "indexer-with-a-rather-long-name-that-must-be-clipped-" + "x" * 40)
            page.select_option("#id_environment", "staging")
            page.fill("#id_description", "Feeds the search index " * 10)
            page.click("form.panel button[type=submit]")
            page.wait_for_selector("h1 >> text=indexer-with")

            page.fill("#id_name", "ci")
            page.click("#keys button:has-text('Create key')")
            panel = page.locator("#new-key")
            panel.wait_for()
            plaintext = page.locator("#new-key-value").inner_text()
            assert plaintext.startswith("brk_")
            assert "cannot show it again" in panel.inner_text()
            page.click("#new-key button.copy")
            page.wait_for_selector("#new-key button.copy >> text=Copied")
            assert page.evaluate("navigator.clipboard.readText()") == plaintext

            # A second key, so the table has more than one record to keep on one line each.
            page.fill("#id_name", "nightly")
            page.click("#keys button:has-text('Create key')")
            page.locator("#new-key").wait_for()
            rows = page.locator("#keys table.records tbody tr")
            assert rows.count() == 2
            header_height = page.locator("#keys table.records thead tr").bounding_box()["height"]
            for i in range(2):
                assert rows.nth(i).bounding_box()["height"] <= header_height * 1.6, "a key wrapped onto two lines"
            page.screenshot(path=str(artifacts_dir / "tenancy-key-once.png"), full_page=True)

            # Revoke the first key in place: its row is swapped, the page is not reloaded.
            ci_row = page.locator("#keys tr", has_text="ci").first
            page.evaluate("window.__same_page = true")
            ci_row.locator("button:has-text('Revoke')").click()
            page.wait_for_selector("#keys tr:has-text('revoked')")
            assert page.evaluate("window.__same_page") is True
            assert page.locator("#new-key").count() == 1  # still this response: nothing reloaded

            # Any later visit: the plaintext is gone.
            page.click("nav.subnav >> text=Service clients")
            page.click("table.records >> text=indexer-with")
            page.wait_for_selector("#keys tr:has-text('revoked')")
            assert plaintext not in page.content()
            assert page.locator("#new-key").count() == 0
            page.screenshot(path=str(artifacts_dir / "tenancy-key-revoked.png"), full_page=True)
        finally:
            browser.close()
    assert Credential.objects.filter(revoked_at__isnull=False).count() == 1
