"""The Prometheus alert rules (deploy/prometheus/alerts.yml) against their fixtures, with promtool.

promtool comes from Debian's ``prometheus`` package, which deploy/scripts/ensure-services.sh installs;
without it these tests fail (they do not skip) and say how to get it.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

RULES_DIR = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"
RULES = RULES_DIR / "alerts.yml"
FIXTURES = RULES_DIR / "alerts_test.yml"

EXPECTED_ALERTS = {
    "BerthModelNothingServing", "BerthModelParked", "BerthModelFailingToStart", "BerthModelUnplaceable",
    "BerthModelPreempted", "BerthScopeAtLimit", "BerthNodeLost", "BerthWatchdogCritical",
    "BerthControlLoopSilent", "BerthBackupTooOld",
}


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not installed: run deploy/scripts/ensure-services.sh (apt-get install prometheus).")
    return path


def alert_rules() -> dict[str, dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule["alert"]: rule for group in groups for rule in group["rules"]}


def test_every_alert_the_issue_asks_for_is_there_with_a_severity_and_a_summary():
    rules = alert_rules()
    assert set(rules) == EXPECTED_ALERTS
    for name, rule in rules.items():
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}, name
        assert rule["annotations"]["summary"], name


def test_each_alert_has_a_fixture_it_fires_on_and_one_it_stays_quiet_on():
    fired, quiet = set(), set()
    for case in yaml.safe_load(FIXTURES.read_text())["tests"]:
        for check in case["alert_rule_test"]:
            (fired if check.get("exp_alerts") else quiet).add(check["alertname"])
    assert fired == EXPECTED_ALERTS
    assert quiet == EXPECTED_ALERTS


def test_rules_pass_promtool_check(promtool):
    result = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(EXPECTED_ALERTS)} rules found" in result.stdout


def test_each_alert_fires_on_its_fixture_and_stays_quiet_otherwise(promtool):
    result = subprocess.run([promtool, "test", "rules", FIXTURES.name], cwd=RULES_DIR,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def test_fixtures_catch_a_rule_that_never_fires(promtool, tmp_path):
    """The fixtures are not vacuous: a rule set whose alerts can never fire fails them."""
    broken = yaml.safe_load(RULES.read_text())
    for group in broken["groups"]:
        for rule in group["rules"]:
            rule["expr"] = "vector(1) < 0"
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(broken))
    shutil.copy(FIXTURES, tmp_path / FIXTURES.name)
    result = subprocess.run([promtool, "test", "rules", FIXTURES.name], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    for name in EXPECTED_ALERTS:
        assert f"alertname: {name}" in output, name
