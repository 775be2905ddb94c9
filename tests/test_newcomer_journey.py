"""A newcomer's journey, in a real Chromium, through what `make up` runs: `bootstrap`, `demo` and
`serve` (web with the gateway, the control worker, beat and this node's agent) on the suite's database.
They log in, see the demo model and this node's memory on the dashboard, fetch a model from a
hub-shaped local server, deploy it from Held with the wizard, watch its page go to ready by itself,
chat with it in the playground through a real llama-server, see the request on the dashboard's
chart, then revoke the playground's key and see the next request refused. Each step leaves a
screenshot under test-artifacts/journey/ for a person to look at.

It runs on the embedded default (SQLite, the file broker, no Redis: tests/conftest.py EMBEDDED),
where the pages poll, and as well on PostgreSQL and Redis, where the deployment page listens to
server-sent events."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest
from django.db import connection
from playwright.sync_api import expect, sync_playwright

from serving.deployments import service
from serving.models import Deployment, Replica
from serving.runtimes.process import ProcessRuntime
from tenancy.audit import Actor
from tests.assets.database import database_environ
from tests.assets.hub_server import hub  # noqa: F401  (a fixture)
from tests.assets.llama_server import free_port
from tests.assets.waiting import wait_until
from tests.test_browser import CHROMIUM_ARGS

pytestmark = [pytest.mark.browser, pytest.mark.llama, pytest.mark.django_db(transaction=True),
              pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parent.parent
# Its own node name: two runs sharing a broker never take each other's node queue.
NODE = f"journey-node-{os.getpid()}"
REPO = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
QUESTION = "What is the capital of France? Answer in one word."
SECONDS = 1000  # Playwright counts milliseconds


@pytest.fixture
def hub_repo(hub, smollm2_model):
    hub.add(REPO, {"smollm2-135m-instruct-Q4_1.gguf": smollm2_model.read_bytes(), "README.md": b"# SmolLM2"})
    return hub


@pytest.fixture
def journey_dir(artifacts_dir) -> Path:
    folder = artifacts_dir / "journey"
    folder.mkdir(exist_ok=True)
    for old in folder.glob("*.png"):  # only this run's steps are there to look at
        old.unlink()
    return folder


@pytest.fixture
def berth(tmp_path, hub_repo, admin_user, journey_dir):
    """`make up` after its installs: `bootstrap` (an administrator exists: ada), `demo`, then `serve`
    on a free port, each as its own process on the suite's database with HF_ENDPOINT at the local hub.
    Afterwards every deployment is stopped the way a person would, then `serve` with Ctrl-C."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    engines = tmp_path / "engines"
    models = tmp_path / "models"
    models.mkdir()
    environment = {**os.environ, **database_environ(connection.settings_dict), "BERTH_NODE_NAME": NODE,
                   "BERTH_MODEL_ROOTS": str(models), "BERTH_ENGINE_DIR": str(engines),
                   "HF_HOME": str(tmp_path / "hf-home")}
    log_path = journey_dir / "serve.log"
    for command in (["bootstrap"], ["demo", "--url", url]):
        done = subprocess.run([sys.executable, "manage.py", *command], cwd=ROOT, env=environment,
                              capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, f"manage.py {command[0]}: {done.stdout[-2000:]}{done.stderr[-3000:]}"
    log = open(log_path, "w")
    group = subprocess.Popen([sys.executable, "manage.py", "serve", "--port", str(port)], cwd=ROOT, env=environment,
                             stdout=log, stderr=subprocess.STDOUT)

    def console_up():
        if group.poll() is not None:
            raise RuntimeError(f"serve exited: {log_path.read_text()[-3000:]}")
        return "Berth console: " in log_path.read_text()

    try:
        wait_until(console_up, 120, what="serve announcing the console")
        wait_until(lambda: re.search(r"control@\S+ ready\.", log_path.read_text())
                   and f"agent of {NODE} ready: " in log_path.read_text(), 120, what="the worker and the agent ready")
        yield types.SimpleNamespace(url=url, log=log_path)
    finally:
        try:
            for deployment in Deployment.objects.exclude(state__in=("stopped", "failed")):
                service.stop(Actor(system="tests"), deployment)
            if group.poll() is None:
                wait_until(lambda: not Replica.objects.exclude(state__in=("stopped", "failed")).exists(), 60,
                           what="every replica stopped")
        finally:
            if group.poll() is None:
                group.send_signal(signal.SIGINT)  # what Ctrl-C delivers
                try:
                    group.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    group.kill()
                    group.wait()
            log.close()
            runtime = ProcessRuntime(engines)  # an engine the agent could not stop is stopped here, by its PID
            for handle in runtime.managed():
                runtime.stop(handle, grace_seconds=5)


def choose_demo_client(page):
    """The demo's service client, the one `make up` made (its label names its project)."""
    option = page.locator("select[name=client] option", has_text="local/demo/playground / demo")
    page.select_option("select[name=client]", value=option.get_attribute("value"))


def test_a_newcomer_fetches_deploys_chats_and_revokes_on_the_embedded_default(
        berth, admin_password, chromium_path, journey_dir):
    url = berth.url
    shots = []

    def shot(page, step):
        path = journey_dir / f"{len(shots) + 1:02d}-{step}.png"
        page.screenshot(path=str(path), full_page=True)
        shots.append(path)

    # Everything the ORM needs was done by the fixtures: Playwright's sync API runs an event loop in this thread.
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            errors = []
            page.on("console", lambda message: errors.append(f"{message.text} {message.location.get('url')}")
                    if message.type == "error" and not message.location.get("url", "").endswith("/favicon.ico")
                    else None)
            page.on("response", lambda response: errors.append(f"{response.status} {response.url}")
                    if response.status >= 400 and not response.url.endswith("/favicon.ico") else None)
            page.on("dialog", lambda dialog: dialog.accept())

            # Log in.
            page.goto(url + "/")
            expect(page).to_have_url(re.compile(r"/login/"))
            page.fill("#id_username", "ada")
            page.fill("#id_password", admin_password)
            shot(page, "login")
            page.click("button[type=submit]")
            page.wait_for_url(url + "/")

            # The dashboard: the demo model, and this node's memory as a bar (it polls itself).
            expect(page.locator("#models")).to_contain_text("smollm2", timeout=60 * SECONDS)
            node_row = page.locator("#memory tr", has_text=NODE)
            expect(node_row.locator(".mem")).to_be_visible(timeout=60 * SECONDS)
            expect(node_row).to_contain_text("RAM")
            shot(page, "dashboard")

            # Models → Fetch, from the hub.
            page.click("nav.areas >> text=Models")
            page.click("nav.tabs >> text=Fetch")
            page.wait_for_url(url + "/models/fetch/")
            page.fill("form[action='/models/fetch/'] input[name=repo]", REPO)
            page.fill("form[action='/models/fetch/'] input[name=quant]", "Q4_1")
            shot(page, "fetch")
            page.click("form[action='/models/fetch/'] button[type=submit]")
            page.wait_for_url(url + "/models/held/")
            expect(page.locator(".messages")).to_contain_text(f"Fetching {REPO}")

            # It appears in Held (the tab polls while the fetch runs), ready to deploy.
            row = page.locator("#held table tbody tr", has_text=REPO).filter(has=page.locator("a[data-action=deploy]"))
            expect(row).to_have_count(1, timeout=120 * SECONDS)
            name = row.locator("td").first.inner_text().strip()
            assert name and name != "smollm2", name
            shot(page, "held")

            # Deploy it from Held: the wizard is filled in for it and says it fits.
            row.locator("a[data-action=deploy]").click()
            page.wait_for_url(re.compile(r"/models/deploy/\?model="))
            expect(page.locator("#id_name")).to_have_value(name)
            assert page.locator("#id_model").input_value() in page.url
            expect(page.locator("#preview")).to_contain_text("Fits:", timeout=60 * SECONDS)
            shot(page, "deploy")
            page.click("#deploy-form button[type=submit]")
            page.wait_for_url(re.compile(r"/models/deployments/[0-9a-f-]{36}/$"))
            expect(page.locator("h1")).to_have_text(name)

            # The deployment's page goes to ready by itself (polling here, events with Redis): it opens
            # before the engine has loaded, and nobody reloads it.
            state = page.locator("#deployment-live h2 .state")
            opened_as = state.inner_text()
            shot(page, "deploying")
            assert opened_as != "Ready", "the page opened ready: it could not show the deployment getting there"
            expect(state).to_have_text("Ready", timeout=240 * SECONDS)
            shot(page, "ready")

            # The playground chats with it through /v1/, as the demo's service client.
            page.click("nav.areas >> text=Gateway")
            page.click("nav.sections >> text=Playground")
            page.wait_for_url(url + "/gateway/playground/")
            choose_demo_client(page)
            page.fill("input[name=model]", name)
            page.fill("textarea[name=text]", QUESTION)
            page.click("form[action='/gateway/playground/'] button[type=submit]")
            result = page.locator("#playground-result")
            expect(result.locator("dl.facts")).to_contain_text("200 in", timeout=180 * SECONDS)
            # The playground sends no temperature: what the model says varies, that it says something does not.
            expect(result.locator("pre.answer")).not_to_be_empty()
            expect(result.locator("dl.facts")).to_contain_text(re.compile(r"\d+ prompt, [1-9]\d* completion"))
            shot(page, "playground")

            # The dashboard's chart shows the request.
            page.click("a.brand")
            page.wait_for_url(url + "/")
            expect(page.locator("#requests svg.chart")).to_be_visible(timeout=60 * SECONDS)
            expect(page.locator("#tile-requests .value")).to_have_text("1")
            assert "answered: 1" in page.locator("#requests svg.chart").inner_html()
            shot(page, "dashboard-request")

            # Revoke the playground's key on the demo client's page.
            page.click("nav.areas >> text=Organisations")
            page.click("nav.subnav >> text=Service clients")
            page.click("table.records a:text-is('demo')")
            key = page.locator("#keys tbody tr", has_text="playground")
            expect(key).to_contain_text("working")
            key.locator("button:text-is('Revoke')").click()
            expect(page.locator("#keys tbody tr", has_text="playground")).to_contain_text("revoked")
            shot(page, "key-revoked")

            # The next request from the playground (the key it keeps in the session) is refused.
            page.click("nav.areas >> text=Gateway")
            page.click("nav.sections >> text=Playground")
            choose_demo_client(page)
            page.fill("input[name=model]", name)
            page.fill("textarea[name=text]", QUESTION)
            page.click("form[action='/gateway/playground/'] button[type=submit]")
            expect(result.locator("p.error")).to_contain_text("401", timeout=60 * SECONDS)
            expect(result.locator("p.error")).to_contain_text("revoked")
            expect(result.locator("p.note")).to_contain_text("the next request makes it a new one")
            shot(page, "refused")
            assert not errors, errors
        finally:
            browser.close()
    assert [p.name for p in shots] == [
        "01-login.png", "02-dashboard.png", "03-fetch.png", "04-held.png", "05-deploy.png", "06-deploying.png",
        "07-ready.png", "08-playground.png", "09-dashboard-request.png", "10-key-revoked.png", "11-refused.png"]
