"""The real app, started with ``streamlit run``, in headless Chromium: every page renders without an
exception, and screenshots of the Study and Trial pages land in ``artifacts/dashboard/``.

Needs Debian's Chromium and the Playwright package (not its browser download)::

    apt-get install -y chromium chromium-driver
    pip install playwright
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
from playwright import sync_api
from sqlalchemy import select

from db.models import Study, Workload
from db.session import make_engine, session_scope
from tuner.export import ranked_trials

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "artifacts" / "dashboard"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
INSTALL = "apt-get install -y chromium chromium-driver && pip install playwright"


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module", autouse=True)
def _chromium(require_component):
    require_component("Chromium", CHROMIUM is not None, INSTALL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _streamlit(db_path: Path, log_path: Path) -> Iterator[str]:
    """``streamlit run dashboard/app.py`` on the database file ``db_path``; yields the base URL."""
    port = _free_port()
    cmd = [sys.executable, "-m", "streamlit", "run", str(REPO / "dashboard" / "app.py"), "--server.headless", "true",
           "--server.port", str(port), "--server.address", "127.0.0.1", "--browser.gatherUsageStats", "false",
           "--server.fileWatcherType", "none", "--client.toolbarMode", "viewer"]
    with open(log_path, "w") as log:
        # From the database's directory with the default relative URL, as `tuner run` users have it.
        proc = subprocess.Popen(cmd, env={**os.environ, "MOETUNE_DB": f"sqlite:///{db_path.name}"},
                                cwd=db_path.parent, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{base}/_stcore/health", timeout=2) as r:
                    if r.read().decode().strip() == "ok":
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"streamlit did not come up: {log_path.read_text()[-2000:]}")
            time.sleep(0.3)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def server(seed, tmp_path_factory):
    """The app on the seeded database; yields the base URL."""
    with _streamlit(seed.path, tmp_path_factory.mktemp("streamlit") / "streamlit.log") as base:
        yield base


def _views(seed) -> list[tuple[str, str, str, int]]:
    """(page path with query, heading, text that must show, plotly charts expected at least)."""
    db = make_engine(seed.url)
    with session_scope(db) as s:
        study = s.scalars(select(Study).where(Study.name == seed.live)).one()
        ranked = [t.number for t in ranked_trials(s, study)]
        workload = s.get(Workload, study.workload_id)
        label = f"{workload.name} ({workload.fingerprint[:8]})"
    db.dispose()
    best, other = ranked[0], ranked[-1]
    q = {"study": seed.live}
    return [
        ("", "Studies", "Open a study for its history", 0),
        (f"study?{urlencode(q)}", "Study", "Optimisation history", 5),
        (f"trial?{urlencode({**q, 'trial': best})}", "Trial", "Latency distributions", 8),
        (f"compare?{urlencode({**q, 'trials': [best, other]}, doseq=True)}", "Compare", "Config differences", 3),
        (f"workloads?{urlencode({'workload': label})}", "Workloads", "Expert popularity", 5),
        (f"export?{urlencode(q)}", "Export", "Download the config", 0),
    ]


def _save(page, path: Path, max_height: int) -> None:
    """A screenshot of the page's content (at most ``max_height`` px), as a small palette PNG."""
    from PIL import Image

    bottom = page.evaluate(
        "() => document.querySelector('[data-testid=\"stMainBlockContainer\"]').getBoundingClientRect().bottom")
    width = page.viewport_size["width"]
    page.screenshot(path=str(path), clip={"x": 0, "y": 0, "width": width, "height": min(max_height, int(bottom) + 16)})
    Image.open(path).convert("RGB").quantize(colors=128).save(path, optimize=True)


def _open(page, url: str, heading: str, n_charts: int) -> str:
    """Go to ``url``, wait until the page and at least ``n_charts`` plotly charts are drawn; the main text."""
    page.goto(url)
    page.get_by_role("heading", name=heading, exact=True).wait_for(timeout=60_000)
    page.wait_for_function(
        """n => document.querySelectorAll('[data-testid="stSkeleton"]').length === 0
               && document.querySelectorAll('.js-plotly-plot').length >= n
               && !document.querySelector('[data-testid="stStatusWidget"]')""",
        arg=n_charts, timeout=60_000)
    page.wait_for_timeout(500)  # let plotly finish drawing before the screenshot
    assert page.locator("[data-testid='stException']").count() == 0, f"{url}: an exception is shown"
    return page.inner_text("[data-testid='stMain']")


def test_every_page_renders_in_chromium(server, seed):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 2400})
            for path, heading, text, n_charts in _views(seed):
                body = _open(page, f"{server}/{path}", heading, n_charts)
                name = path.split("?")[0] or "studies"
                assert text in body, f"{name}: {text!r} not shown"
                assert "Cannot open the results database" not in body
                if name in ("studies", "study", "export"):  # tables draw on a canvas: check they are there
                    assert page.locator("[data-testid='stDataFrame']").count() >= 1, f"{name}: no table"
                _save(page, ARTIFACTS / f"{name}.png", max_height=1700 if name in ("study", "trial") else 2400)
        finally:
            browser.close()
    for name in ("study", "trial"):
        assert (ARTIFACTS / f"{name}.png").stat().st_size > 10_000


@contextmanager
def _browser(db_url: str, log_path: Path) -> Iterator[tuple[str, Any]]:
    """The app on the SQLite database ``db_url`` and a Chromium page; yields (base URL, page)."""
    with _streamlit(Path(db_url.removeprefix("sqlite:///")), log_path) as base, sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield base, browser.new_page(viewport={"width": 1280, "height": 2400})
        finally:
            browser.close()


def test_a_validated_sim_study_renders_in_chromium(sim_validated, tmp_path):
    url, names, _, _ = sim_validated
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with _browser(url, tmp_path / "streamlit.log") as (base, page):
        body = _open(page, f"{base}/study?{urlencode({'study': names['checked']})}", "Study", 4)
        assert "Simulated against live" in body and "Forced (--force)" in body
        titles = page.locator(".gtitle").all_text_contents()  # SVG: no innerText
        assert sum(t.startswith("Predicted vs measured") for t in titles) == 4, titles
        _save(page, ARTIFACTS / "study-validated.png", max_height=2400)
    assert (ARTIFACTS / "study-validated.png").stat().st_size > 10_000


def test_the_plans_page_renders_in_chromium(planned, tmp_path):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with _browser(planned, tmp_path / "streamlit.log") as (base, page):
        body = _open(page, f"{base}/plans", "Plans", 2)
        assert "uncalibrated profile (datasheet)" in body and "Cannot open the results database" not in body
        titles = page.locator(".gtitle").all_text_contents()  # SVG: no innerText
        assert any(t.startswith("Capacity at the SLO: h100-pcie") for t in titles), titles
        assert any(t.startswith("Offline throughput: h100-pcie") for t in titles), titles
        assert page.locator("[data-testid='stDataFrame']").count() >= 2
        _save(page, ARTIFACTS / "plans.png", max_height=2400)
    assert (ARTIFACTS / "plans.png").stat().st_size > 10_000
