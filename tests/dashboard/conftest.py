"""Fixtures of the dashboard tests: a database seeded by real short studies, and page runners.

The seed (once per session, about 30 s on a shared 2-core machine) is what a user would have
after two short ``tuner run`` commands:

* ``live``: a realtime replay of a bursty 16-request workload whose router trace was recorded
  with the tiny model (``workloads synth`` then ``workloads record``), against a tight SLO, so
  trials meet it, miss it, get pruned or are infeasible; single objective (capacity, the default),
  with its noise and a confirmation (the best searched config and every baseline, two runs each).
* ``pareto``: an offline replay of ``builtin:tiny`` with two objectives (throughput, TPOT p99).

Tests compare what the pages show with what the database holds, read back independently through
the ORM, so they hold whichever trials the realtime run happened to produce.
"""

from __future__ import annotations

import base64
import json
import sqlite3
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from sqlalchemy import select
from streamlit.testing.v1 import AppTest

from db.models import Study, Trial, Validation, ValidationMetric, Workload
from db.session import make_engine, session_scope
from db.store import fail_trial, stable_hash, start_trial
from engine.config import ConfigError, EngineConfig

REPO = Path(__file__).resolve().parents[2]
APP = REPO / "dashboard" / "app.py"
MODEL = "builtin:qwen3_moe-tiny"


@dataclass
class Seed:
    """The seeded database: its URL and file, the two studies' full names, the workload dir."""

    url: str
    path: Path
    live: str
    pareto: str
    workload_dir: Path


def _run(main: Callable[[list[str]], int], args: list[str]) -> None:
    rc = main(args)
    assert rc == 0, f"{main.__module__} {' '.join(args)} -> {rc}"


@pytest.fixture(scope="session")
def seed(tmp_path_factory: pytest.TempPathFactory, _moetune_cache: None) -> Seed:
    """A results database filled by two real short studies (see the module docstring)."""
    from tuner.cli import main as tuner
    from workloads.cli import main as workloads

    root = tmp_path_factory.mktemp("dashboard-seed")
    path = root / "moetune.db"
    url = f"sqlite:///{path}"
    synth, recorded = root / "bursty-synth", root / "bursty"
    _run(workloads, ["synth", "--out", str(synth), "--name", "bursty16", "--n-requests", "16", "--arrival", "gamma",
                     "--cv", "2", "--rate", "12", "--prompt-len", "uniform:8:64", "--output-len", "uniform:4:16",
                     "--seed", "3"])
    _run(workloads, ["record", "--model", MODEL, "--workload", str(synth), "--out", str(recorded)])
    _run(tuner, ["run", "--model", MODEL, "--workload", str(recorded), "--mode", "realtime", "--rate-scale", "2",
                 "--trials", "12", "--slo", "ttft_p99_ms=40", "--slo", "tpot_p99_ms=8", "--slo", "attainment_min=0.8",
                 "--confirm-top", "1", "--confirm-repeats", "2", "--study", "live", "--db", url, "--quiet"])
    _run(tuner, ["run", "--model", MODEL, "--workload", "builtin:tiny", "--mode", "offline", "--max-requests", "8",
                 "--trials", "8", "--objectives", "output_tokens_per_s,tpot_p99_ms", "--study", "pareto",
                 "--db", url, "--quiet"])
    db = make_engine(url)
    with session_scope(db) as s:
        names = s.scalars(select(Study.name)).all()
    db.dispose()
    live = next(n for n in names if n.startswith("live-"))
    pareto = next(n for n in names if n.startswith("pareto-"))
    return Seed(url=url, path=path, live=live, pareto=pareto, workload_dir=recorded)


SIM_STUDY = ["--model", MODEL, "--workload", "builtin:tiny", "--max-requests", "8", "--backend", "sim",
             "--profile", "builtin:spr", "--trials", "3", "--confirm-repeats", "0", "--noise-repeats", "1",
             "--quiet"]
"""Short simulated studies (`sim_validated`): realtime capacity on 8 requests, priced by a datasheet profile."""


@pytest.fixture(scope="session")
def sim_validated(tmp_path_factory, _moetune_cache):
    """A database with two simulated studies of the tiny model (datasheet profile builtin:spr): ``checked``,
    validated live with ``--top 2 --force``, and ``unchecked``; returns (url, short name -> full name,
    (trial number, metric) -> (predicted, measured), the recorded mismatch)."""
    from tuner.cli import main as tuner_main

    url = f"sqlite:///{tmp_path_factory.mktemp('dashboard-validate') / 'moetune.db'}"
    for name in ("checked", "unchecked"):
        assert tuner_main(["run", *SIM_STUDY, "--study", name, "--db", url]) == 0
    assert tuner_main(["validate", "--study", "checked", "--top", "2", "--force", "--db", url]) == 0
    db = make_engine(url)
    with session_scope(db) as s:
        names = {n.rsplit("-", 1)[0]: n for n in s.scalars(select(Study.name))}
        v = s.scalars(select(Validation)).one()
        numbers = {t.id: t.number for t in s.scalars(select(Trial))}
        stored = {(numbers[m.trial_id], m.metric): (m.predicted, m.measured)
                  for m in s.scalars(select(ValidationMetric).where(ValidationMetric.validation_id == v.id))}
        mismatch = v.mismatch
    db.dispose()
    return url, names, stored, mismatch


@pytest.fixture(scope="session")
def altered(seed: Seed, tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A copy of the seed where a worker is mid-trial (one running trial in ``live``), one trial the
    engine refused (998, infeasible with the config error it raises, whatever the realtime run
    produced) and the ``live`` workload's file has gone (its source points nowhere)."""
    path = tmp_path_factory.mktemp("dashboard-altered") / "moetune.db"
    with closing(sqlite3.connect(seed.path)) as src, closing(sqlite3.connect(path)) as dst:
        src.backup(dst)  # a consistent copy, whatever is still in the write-ahead log
    url = f"sqlite:///{path}"
    db = make_engine(url)
    config = EngineConfig()
    with session_scope(db) as s:
        study = s.scalars(select(Study).where(Study.name == seed.live)).one()
        start_trial(s, study.id, 999, config.to_dict(), config.config_hash())
        bad = {**config.to_dict(), "experts": {**config.to_dict()["experts"], "int4_group_size": 48}}
        with pytest.raises(ConfigError) as refused:
            EngineConfig.from_dict(bad, source="trial 998")
        fail_trial(s, start_trial(s, study.id, 998, bad, stable_hash(bad)), str(refused.value), "infeasible")
        workload = s.get(Workload, study.workload_id)
        workload.source = str(path.parent / "gone")
    db.dispose()
    return SimpleNamespace(url=url, study=seed.live)



@pytest.fixture
def page(monkeypatch: pytest.MonkeyPatch) -> Callable[..., AppTest]:
    """``page("study", url, study=NAME)``: the app run on one page with query parameters, on
    the database ``url``; fails on any exception the page raised."""

    def run(name: str, url: str, **params: Any) -> AppTest:
        monkeypatch.setenv("MOETUNE_DB", url)
        at = AppTest.from_file(str(APP), default_timeout=120)
        for key, value in params.items():
            at.query_params[key] = [str(v) for v in value] if isinstance(value, list) else str(value)
        at.switch_page(f"app_pages/{name}.py")
        at.run()
        assert not at.exception, [e.value for e in at.exception]
        return at

    return run


def _plain(obj: Any) -> Any:
    """A figure spec with plotly's typed arrays (``{"dtype", "bdata", "shape"}``) as lists."""
    if isinstance(obj, dict):
        if set(obj) >= {"dtype", "bdata"}:
            array = np.frombuffer(base64.b64decode(obj["bdata"]), dtype=np.dtype(obj["dtype"]))
            if "shape" in obj:
                array = array.reshape([int(n) for n in str(obj["shape"]).split(",")])
            return array.tolist()
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    return obj


def charts(at: AppTest) -> dict[str, dict[str, Any]]:
    """The page's plotly figures by title, arrays as plain lists."""
    out = {}
    for element in at.get("plotly_chart"):
        spec = _plain(json.loads(element.proto.spec))
        out[spec["layout"]["title"]["text"]] = spec
    return out


def texts(at: AppTest) -> str:
    """Every piece of text on the page, joined (markdown, captions, alerts, headings)."""
    parts = []
    for kind in ("title", "header", "subheader", "markdown", "caption", "info", "warning", "error", "success"):
        parts += [str(e.value) for e in getattr(at, kind)]
    return "\n".join(parts)


def trials_of(url: str, study: str) -> list[Trial]:
    """Every trial of a study, read through the ORM (detached, all columns loaded)."""
    db = make_engine(url)
    with session_scope(db) as s:
        study_id = s.scalars(select(Study.id).where(Study.name == study)).one()
        trials = s.scalars(select(Trial).where(Trial.study_id == study_id).order_by(Trial.number)).all()
        s.expunge_all()
    db.dispose()
    return list(trials)


@pytest.fixture
def kit() -> SimpleNamespace:
    """The helpers above for test modules (``--import-mode=importlib`` cannot import conftest)."""
    return SimpleNamespace(charts=charts, texts=texts, trials_of=trials_of, REPO=REPO, APP=APP, MODEL=MODEL)


PLAN = ["plan", "--model", "shape:olmoe-1b-7b", "--profile", "builtin:h100-pcie", "--workload", "builtin:tiny",
        "--max-requests", "4", "--max-batch-seqs", "8", "--max-seq-len-tokens", "1024", "--quiet"]
"""A small `engine plan` (`planned`): about 20 configs of the OLMoE shape on a datasheet profile, seconds."""


@pytest.fixture(scope="session")
def planned(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A database holding one real ``engine plan`` run and no study; returns its URL."""
    from engine.cli import main as engine_main

    url = f"sqlite:///{tmp_path_factory.mktemp('dashboard-plan') / 'moetune.db'}"
    _run(engine_main, [*PLAN, "--db", url])
    return url
