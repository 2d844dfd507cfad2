"""docker-compose.yml is checked, not run (no Docker engine here): structure, and that the workers'
command is one the tuner accepts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml  # pyyaml is in the test extra

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_services_and_dependencies(compose):
    services = compose["services"]
    assert set(services) == {"db", "worker", "dashboard"}
    assert services["db"]["image"].startswith("postgres:15")
    assert "healthcheck" in services["db"]
    for name in ("worker", "dashboard"):
        assert services[name]["build"] == "."
        assert services[name]["depends_on"]["db"]["condition"] == "service_healthy"
    assert "8501:8501" in services["dashboard"]["ports"]
    assert services["dashboard"]["environment"]["MOETUNE_DB"].startswith("postgresql+psycopg://")
    assert (ROOT / "Dockerfile").exists()


def test_worker_command_parses_with_the_tuner(compose):
    from tuner.cli import build_parser

    cmd = [str(c) for c in compose["services"]["worker"]["command"]]
    assert cmd[:2] == ["tuner", "run"]
    # Compose substitutes ${VAR:-default}; the defaults are what a plain `docker compose up` runs.
    args = [c.split(":-", 1)[1].rstrip("}") if c.startswith("${") else c for c in cmd[1:]]
    ns = build_parser().parse_args(args)
    assert ns.db.startswith("postgresql+psycopg://moetune:") and "@db:5432/" in ns.db


def test_every_name_the_file_uses_exists(compose):
    """The builtin model and workload the workers default to, the dashboard's script, and each variable
    the header's example sets is one a command reads."""
    import re

    from engine.model.arch import ARCHS
    from engine.model.maker import PRESETS
    from workloads.schema import builtin_names

    text = (ROOT / "docker-compose.yml").read_text()
    cmd = [str(c) for c in compose["services"]["worker"]["command"]]
    defaults = {m.group(1): m.group(2) for c in cmd if (m := re.fullmatch(r"\$\{(\w+):-(.*)\}", c))}
    arch, _, preset = defaults["MODEL"].removeprefix("builtin:").rpartition("-")
    assert arch in ARCHS and preset in PRESETS, defaults["MODEL"]
    assert defaults["WORKLOAD"].removeprefix("builtin:") in builtin_names(), defaults["WORKLOAD"]
    assert int(defaults["TRIALS"]) >= 1
    example = next(line for line in text.splitlines() if "docker compose up" in line)
    for var in re.findall(r"\b([A-Z_]+)=", example):
        assert var in defaults, f"the header sets {var}, which no worker command reads"
    assert "--scale worker=" in example  # several workers share one study (tuner/worker.py's budget)
    dash = compose["services"]["dashboard"]["command"]
    assert dash[:2] == ["streamlit", "run"] and (ROOT / dash[2]).is_file()
