"""Every series an alert rule (deploy/prometheus/alerts.yml) reads is one Berth publishes: each metric an
expression names, with the labels it matches on and joins by, is on a real /metrics scrape (a gateway
process on loopback) of rows and cache entries that make it appear. A series renamed in the code, or a
rule that names one nobody publishes, fails here rather than leaving an alert that can never fire.

tests/test_alert_rules.py checks the rules against promtool fixtures; those fixtures are written by
hand, so only this test ties the rules' names to the code's."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
import yaml
from django.core.cache import cache
from prometheus_client.parser import text_string_to_metric_families

from berth import backup, health
from scheduler.models import Node, PlacementDecision
from serving.models import ModelEntry
from serving.control import watchdog
from tests.gateway.conftest import GatewayProcess

RULES = Path(__file__).resolve().parent.parent / "deploy" / "prometheus" / "alerts.yml"

# PromQL's words that are not series: operators, modifiers, and what takes a list of labels.
KEYWORDS = {"and", "or", "unless", "bool", "offset", "atan2"}
LABEL_LISTS = {"on", "ignoring", "by", "without", "group_left", "group_right"}
TOKEN = re.compile(r'\s*(?:(?P<string>"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\')|(?P<number>\d[\w.]*)'
                   r'|(?P<name>[A-Za-z_:][\w:]*)|(?P<op>=~|!~|!=|==|>=|<=|[-+*/%^=<>(){}\[\],@]))')


@dataclass
class Selector:
    metric: str
    matchers: dict[str, tuple[str, str]] = field(default_factory=dict)  # label -> (operator, value)


@dataclass
class Expression:
    selectors: list[Selector]
    joined_by: set[str]  # labels of on(...), by(...), ignoring(...), group_left(...): both sides need them


def _tokens(expr: str) -> list[tuple[str, str]]:
    found, at = [], 0
    while at < len(expr.rstrip()):
        match = TOKEN.match(expr, at)
        assert match and match.end() > at, f"cannot read {expr[at:]!r}"
        found.append(next((kind, text) for kind, text in match.groupdict().items() if text is not None))
        at = match.end()
    return found


def parse(expr: str) -> Expression:
    """The series an expression selects and the labels it joins or groups by: enough PromQL for rules
    (names, {matchers}, [ranges], function calls, label lists); anything else is refused loudly."""
    tokens, selectors, joined = _tokens(expr), [], set()
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        following = tokens[i + 1][1] if i + 1 < len(tokens) else None
        if kind == "op" and text == "[":  # a range or subquery: durations, not series
            i = next(j for j in range(i, len(tokens)) if tokens[j][1] == "]") + 1
            continue
        if kind != "name" or text in KEYWORDS:
            i += 1
            continue
        if text in LABEL_LISTS:
            if following == "(":
                end = next(j for j in range(i, len(tokens)) if tokens[j][1] == ")")
                joined |= {t for k, t in tokens[i + 2:end] if k == "name"}
                i = end + 1
            else:
                i += 1
            continue
        if following == "(" or following in ("by", "without"):  # a function, or an aggregation (max by (x) (...))
            i += 1
            continue
        selector = Selector(text)
        i += 1
        if i < len(tokens) and tokens[i][1] == "{":
            end = next(j for j in range(i, len(tokens)) if tokens[j][1] == "}")
            inner = [t for t in tokens[i + 1:end] if t[1] != ","]
            assert len(inner) % 3 == 0, f"cannot read the matchers of {text} in {expr!r}"
            for (_, label), (_, operator), (_, value) in zip(inner[::3], inner[1::3], inner[2::3]):
                selector.matchers[label] = (operator, value[1:-1])
            i = end + 1
        selectors.append(selector)
    return Expression(selectors, joined)


def alert_expressions() -> dict[str, Expression]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule["alert"]: parse(rule["expr"]) for group in groups for rule in group["rules"]}


def test_the_reader_finds_series_matchers_and_join_labels_and_skips_functions_and_ranges():
    read = parse('(time() - max by (node) (berth_a{state="lost", x!="y"}) > 26 * 3600) '
                 'and on (scope, resource) increase(berth_b_total[15m]) or absent(berth_c)')
    assert [(s.metric, s.matchers) for s in read.selectors] == [
        ("berth_a", {"state": ("=", "lost"), "x": ("!=", "y")}), ("berth_b_total", {}), ("berth_c", {})]
    assert read.joined_by == {"node", "scope", "resource"}


def test_every_alert_reads_at_least_one_series_of_berths():
    for name, expression in alert_expressions().items():
        assert expression.selectors, name
        assert all(s.metric.startswith("berth_") for s in expression.selectors), (name, expression)


@pytest.fixture
def fleet(transactional_db, tmp_path, settings):
    """Rows and cache entries from which every fleet series appears: a catalog model that should run,
    a node whose watchdog is critical, a scope with a limit and holdings, a control-loop pass, a backup."""
    from tenancy.audit import Actor
    from tenancy.models import Contract, Reservation
    from tenancy.services.tree import create_scope

    ModelEntry.objects.create(name="alerted", source_kind="local", format="gguf", scaling_min=1)
    PlacementDecision.objects.create(model="alerted", verdict=PlacementDecision.Verdict.PREEMPTED,
                                     kind=PlacementDecision.Kind.PLAN, inputs_digest="d", fingerprint="f")
    node = Node.objects.create(name="alert-node", address="127.0.0.1", memory_available_bytes=1 << 20)
    assert watchdog.check(node) == watchdog.CRITICAL  # 1 MiB free is below any margin
    org = create_scope(Actor(system="tests"), "org", "alertorg", "Org")
    Contract.objects.create(scope=org, gpus_limit=Decimal(2))
    Reservation.objects.create(scope=org, scope_path=org.path, holder="replica:r1", gpus=Decimal(2))
    cache.set(health.LAST_PASS_KEY, time.time(), None)
    backups = tmp_path / "backups"
    made = backup.create(backups)
    yield {"backups": backups, "archive": made, "node": node}
    cache.delete_many([health.LAST_PASS_KEY, f"berth:watchdog:level:{node.pk}"])


def _scrape(gateway: GatewayProcess) -> list[tuple[str, dict, float]]:
    response = httpx.get(f"{gateway.base_url}/metrics", timeout=30)
    assert response.status_code == 200, response.text[:500]
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(response.text)
            for s in family.samples]


def _matches(labels: dict, matchers: dict) -> bool:
    for label, (operator, value) in matchers.items():
        if label not in labels:
            return False
        if operator == "=" and labels[label] != value or operator == "!=" and labels[label] == value:
            return False
        if operator in ("=~", "!~") and bool(re.fullmatch(value, labels[label])) != (operator == "=~"):
            return False
    return True


@pytest.mark.django_db(transaction=True)
def test_every_series_an_alert_reads_is_on_a_real_scrape(fleet, tmp_path):
    gateway = GatewayProcess(tmp_path / "gateway-alert-metrics.log", environ={"BERTH_BACKUP_DIR": str(fleet["backups"])})
    try:
        scraped = _scrape(gateway)
    finally:
        gateway.stop()
    assert ("berth_fleet_metrics_up", {}, 1.0) in scraped, gateway.log()[-3000:]
    missing = {}
    for alert, expression in alert_expressions().items():
        for selector in expression.selectors:
            found = [labels for name, labels, _ in scraped if name == selector.metric]
            if not found:
                missing.setdefault(alert, []).append(f"{selector.metric}: not published")
            elif not any(_matches(labels, selector.matchers) for labels in found):
                missing.setdefault(alert, []).append(f"{selector.metric}: no series matches {selector.matchers}")
            elif not all(expression.joined_by <= set(labels) for labels in found):
                missing.setdefault(alert, []).append(
                    f"{selector.metric}: lacks a label it is joined by ({sorted(expression.joined_by)})")
    assert not missing, missing

    # The two series added for the rules carry the figures they stand for.
    by_name = {(name, labels.get("node")): value for name, labels, value in scraped}
    assert by_name[("berth_watchdog_level", "alert-node")] == 2
    made = backup.newest(fleet["backups"])[1].timestamp()
    assert by_name[("berth_backup_last_success_timestamp_seconds", None)] == pytest.approx(made)


@pytest.mark.django_db(transaction=True)
def test_a_node_whose_memory_nobody_measured_has_no_watchdog_series(fleet):
    from gateway import fleet_metrics

    Node.objects.create(name="unmeasured", address="127.0.0.1")
    text = fleet_metrics.render().decode()
    assert 'berth_watchdog_level{node="alert-node"} 2.0' in text
    assert 'berth_watchdog_level{node="unmeasured"}' not in text  # unknown is absent, never 0
