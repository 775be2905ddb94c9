"""The files to run Berth (deploy/, docs/) are checked against the code they start: the compose file's
structure and variables, the Dockerfile, the systemd units (systemd-analyze verify), the nginx example's
limits, and every shell command the docs tell an operator to run."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml
from django.conf import settings
from django.core.management import get_commands

from berth.web import uvicorn_command

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
DOCS = ["install.md", "add-a-node.md", "upgrade.md", "backup-and-restore.md", "monitoring.md"]

# Variables read by the official postgres and redis images (and redis-cli), not by Berth.
SERVICE_VARIABLES = {"POSTGRES_USER", "POSTGRES_PASSWORD", "POSTGRES_DB", "REDIS_PASSWORD", "REDISCLI_AUTH"}
SECRET_WORDS = ("SECRET", "PASSWORD", "PEPPER", "TOKEN")


def berth_variables() -> set[str]:
    """Every variable berth/settings.py reads, and its NAME_FILE form (berth/env.py)."""
    names = set(re.findall(r"""env\.\w+\(\s*["']([A-Z][A-Z0-9_]*)["']""", (ROOT / "berth" / "settings.py").read_text()))
    assert "DATABASE_URL" in names and "BERTH_KEY_PEPPER" in names
    return names | {f"{name}_FILE" for name in names}


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def env_file_names(path: Path) -> list[str]:
    return [line.split("=", 1)[0] for line in path.read_text().splitlines() if line and not line.startswith("#")]


def test_compose_runs_the_control_plane_and_an_agent_from_this_checkout():
    services = compose()["services"]
    assert {"postgres", "redis", "web", "worker", "batch-worker", "beat", "agent"} <= set(services)
    for name, service in services.items():
        assert "image" in service or "build" in service, name
        for needed in service.get("depends_on", {}) or {}:
            assert needed in services, f"{name} depends on unknown service {needed}"
    for name in ("web", "worker", "batch-worker", "beat", "agent", "migrate"):
        assert services[name]["build"] == {"context": "..", "dockerfile": "deploy/Dockerfile"}
        assert (COMPOSE.parent / services[name]["build"]["context"] / services[name]["build"]["dockerfile"]).is_file()
    assert services["agent"]["profiles"] == ["agent"]


def test_compose_commands_are_the_ones_berth_runs():
    services = compose()["services"]
    # berth/web.py's command line, with the container's bind address.
    assert services["web"]["command"] == ["python", *uvicorn_command("0.0.0.0", 8000)[1:]]
    worker = services["worker"]["command"]
    assert worker[:6] == ["python", "-m", "celery", "-A", "berth.celery", "worker"]
    assert worker[worker.index("-Q") + 1] == settings.CELERY_TASK_DEFAULT_QUEUE
    batches = services["batch-worker"]["command"]
    assert batches[:6] == worker[:6] and batches[batches.index("-Q") + 1] == settings.BATCH_QUEUE
    assert settings.CELERY_TASK_ROUTES["gateway.run_batch"]["queue"] == settings.BATCH_QUEUE
    beat = services["beat"]["command"]
    assert beat[5] == "beat" and beat[beat.index("--scheduler") + 1] == settings.CELERY_BEAT_SCHEDULER
    assert services["agent"]["command"] == ["python", "manage.py", "agent"]
    assert services["migrate"]["command"][:3] == ["python", "manage.py", "migrate"]
    commands = get_commands()
    assert "agent" in commands and "migrate" in commands


def test_compose_publishes_no_secret_and_only_the_web_server_on_loopback():
    services = compose()["services"]
    for name, service in services.items():
        environment = service.get("environment") or {}
        keys = environment if isinstance(environment, dict) else [item.split("=", 1)[0] for item in environment]
        assert not [key for key in keys if any(word in key for word in SECRET_WORDS)], name
        published = service.get("ports", [])
        if name == "web":
            assert published == ["127.0.0.1:8000:8000"]
        else:
            assert published == [], f"{name} publishes {published}"
        for env_file in service.get("env_file", []):
            assert (DEPLOY / f"{Path(env_file).stem}.env.example").is_file(), env_file
    assert not (DEPLOY / "compose.env").exists() or "compose.env" in (DEPLOY / "Dockerfile.dockerignore").read_text()


def test_every_variable_the_deploy_files_name_is_one_berth_or_its_services_read():
    known = berth_variables() | SERVICE_VARIABLES
    named = set()
    for example in ("compose.env.example", "agent.env.example", "berth.env.example"):
        named |= set(env_file_names(DEPLOY / example))
    named |= set(re.findall(r"\$\$\{?([A-Z][A-Z0-9_]*)", COMPOSE.read_text()))
    named |= set(re.findall(r"\b(BERTH_[A-Z0-9_]+|DATABASE_URL|REDIS_URL)\b",
                            "\n".join((ROOT / "docs" / page).read_text() for page in DOCS)))
    unknown = named - known
    assert not unknown, f"not read by berth/settings.py nor by postgres/redis: {sorted(unknown)}"
    # No secret has a real value in a committed example.
    for example in ("compose.env.example", "agent.env.example"):
        for line in (DEPLOY / example).read_text().splitlines():
            if line.startswith(("BERTH_SECRET_KEY=", "BERTH_KEY_PEPPER=", "BERTH_METRICS_TOKEN=")):
                assert line.endswith("="), line


def test_the_compose_file_follows_the_compose_specification():
    """The Python equivalent of ``docker compose config``, which needs a plugin not every machine has:
    the file against the Compose Specification's JSON schema (tests/assets/compose_spec.json). That
    schema predates Compose v2's top-level ``name``, checked here by v2's own rule instead."""
    schema = json.loads((ROOT / "tests" / "assets" / "compose_spec.json").read_text())
    document = compose()
    assert re.fullmatch(r"[a-z0-9][a-z0-9_-]*", document.pop("name"))
    problems = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
                for e in jsonschema.Draft201909Validator(schema).iter_errors(document)]
    assert problems == []
    # And it can fail: a service with a misspelt key is refused.
    broken = {**document, "services": {**document["services"], "web": {**document["services"]["web"], "imagee": "x"}}}
    assert list(jsonschema.Draft201909Validator(schema).iter_errors(broken))


def test_docker_compose_config_accepts_the_file(tmp_path):
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("no docker CLI here: test_the_compose_file_follows_the_compose_specification checks the file")
    probe = subprocess.run([docker, "compose", "version"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"the docker compose plugin is not installed ({probe.stderr.strip()[:80]}): "
                    "test_the_compose_file_follows_the_compose_specification checks the file")
    project = tmp_path / "deploy"
    shutil.copytree(DEPLOY, project)
    for example in ("compose", "agent"):
        shutil.copy(project / f"{example}.env.example", project / f"{example}.env")
    result = subprocess.run([docker, "compose", "-f", str(project / "compose.yaml"), "--profile", "agent", "config", "-q"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_dockerfile_installs_the_locked_set_and_runs_as_a_user_without_secrets():
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim", text, re.M)
    assert "pip install -c requirements.lock ." in text
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0")
    for source in re.findall(r"^COPY (\S+)", text, re.M):
        assert (ROOT / source).exists(), source
    assert not re.search(r"^(ENV|ARG) .*(SECRET|PEPPER|PASSWORD|TOKEN)", text, re.M)


def units() -> list[Path]:
    found = sorted((DEPLOY / "systemd").glob("*.service"))
    assert {unit.name for unit in found} >= {"berth-web.service", "berth-worker.service", "berth-beat.service",
                                              "berth-agent.service"}
    return found


def test_systemd_units_pass_systemd_analyze_verify(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed: test_unit_commands_name_real_programs checks the units")
    copies = []
    for unit in units():
        # The units expect the checkout in /opt/berth; verify them against this one, where the programs exist.
        copy = tmp_path / unit.name
        copy.write_text(unit.read_text().replace("/opt/berth", str(ROOT)))
        copies.append(str(copy))
    result = subprocess.run([analyze, "verify", *copies], capture_output=True, text=True, timeout=60)
    problems = [line for line in (result.stdout + result.stderr).splitlines()
                if any(Path(c).name in line for c in copies)]
    assert result.returncode == 0 and not problems, result.stdout + result.stderr


def test_unit_commands_name_real_programs():
    import configparser

    commands = get_commands()
    for unit in units():
        parser = configparser.ConfigParser(strict=False, interpolation=None)
        parser.optionxform = str
        parser.read_string(unit.read_text())
        assert {"Unit", "Service", "Install"} <= set(parser.sections()), unit.name
        argv = shlex.split(parser["Service"]["ExecStart"])
        assert argv[0] == "/opt/berth/.venv/bin/python", unit.name
        if argv[1] == "-m":
            assert argv[2] in ("uvicorn", "celery"), unit.name
        else:
            assert argv[1] == "/opt/berth/manage.py" and argv[2] in commands, unit.name
    agent = shlex.split(configparser_value(DEPLOY / "systemd" / "berth-agent.service", "ExecStart"))
    assert agent[-1] == "agent"


def configparser_value(unit: Path, key: str) -> str:
    return next(line.split("=", 1)[1] for line in unit.read_text().splitlines() if line.startswith(f"{key}="))


def test_nginx_example_matches_the_gateway_limit_and_streams_unbuffered():
    text = (DEPLOY / "nginx" / "berth.conf").read_text()
    size = re.search(r"client_max_body_size (\d+)([km]?);", text)
    factor = {"": 1, "k": 1024, "m": 1024 * 1024}[size.group(2)]
    assert int(size.group(1)) * factor == settings.GATEWAY_MAX_BODY_BYTES
    assert f"BERTH_GATEWAY_MAX_BODY_BYTES={settings.GATEWAY_MAX_BODY_BYTES}" in (DEPLOY / "compose.env.example").read_text()
    assert "ssl_certificate " in text and "listen 443 ssl" in text
    for location in (r"location /v1/ \{", r"location ~ \^/models/[^\n]*stream[^\n]*\{"):
        block = re.search(location + r"(.*?)\}", text, re.S)
        assert block, location
        assert "proxy_buffering off;" in block.group(1), location
    # The console's live panel URL is the one the nginx location matches.
    assert re.match(r"^/models/.+/(stream|events)/?$", "/models/deployments/0b1e6f5e-0000-4000-8000-000000000000/stream/")
    from django.urls import reverse

    stream = reverse("serving:deployment-stream", kwargs={"public_id": "0b1e6f5e-0000-4000-8000-000000000000"})
    assert re.match(r"^/models/.+/(stream|events)/?$", stream), stream


# Operator tools the docs name that this test machine need not have.
OPERATOR_TOOLS = {"systemctl", "nginx", "useradd", "install", "cp", "chmod", "git", "curl", "docker", "promtool",
                  "python3"}


def doc_commands() -> list[tuple[str, list[str]]]:
    found = []
    for page in DOCS:
        text = (ROOT / "docs" / page).read_text()
        for block in re.findall(r"```sh\n(.*?)```", text, re.S):
            for line in block.splitlines():
                argv: list[str] = []
                for token in [*shlex.split(line), "&&"]:
                    if token in ("&&", "||", ";", "|"):
                        if argv:
                            found.append((page, argv))
                        argv = []
                    else:
                        argv.append(token)
    return found


def test_docs_shell_commands_name_programs_and_manage_py_commands_that_exist():
    commands = get_commands()
    written = set()
    seen = doc_commands()
    assert {page for page, _ in seen} == set(DOCS)
    for page, argv in seen:
        program = argv[0]
        assert program in OPERATOR_TOOLS or program.startswith("/opt/berth/.venv/bin/") or shutil.which(program), \
            f"{page}: {program} is not a known program"
        if program.startswith("/opt/berth/.venv/bin/"):
            assert (ROOT / ".venv" / "bin" / Path(program).name).exists(), f"{page}: {program}"
        if "manage.py" in argv:
            sub = argv[argv.index("manage.py") + 1]
            assert sub in commands, f"{page}: manage.py {sub} does not exist"
        if program == "cp":
            written.add(argv[-1])
        for token in argv[1:]:
            if token.startswith("deploy/") and token not in written:
                assert (ROOT / token).exists(), f"{page}: {token} does not exist"
        if program == "docker" and "-f" in argv:
            assert (ROOT / argv[argv.index("-f") + 1]).is_file()
    for needed in ("backup", "restore", "doctor", "status", "migrate", "bootstrap", "engines"):
        assert any("manage.py" in argv and argv[argv.index("manage.py") + 1] == needed for _, argv in seen), needed


def test_a_node_agent_is_given_nothing_of_the_cluster():
    """The agent reaches the control plane through the node API with its own credential: no deploy file
    hands it the database, Redis, the secret key or the pepper."""
    cluster = {"DATABASE_URL", "REDIS_URL", "BERTH_SECRET_KEY", "BERTH_KEY_PEPPER"}
    assert not cluster & set(env_file_names(DEPLOY / "agent.env.example"))
    assert compose()["services"]["agent"]["env_file"] == ["agent.env"]
    unit = (DEPLOY / "systemd" / "berth-agent.service").read_text()
    files = [line.split("=", 1)[1] for line in unit.splitlines() if line.startswith("EnvironmentFile=")]
    assert files == ["/etc/berth/agent.env"]
