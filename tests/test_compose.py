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
