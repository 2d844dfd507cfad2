"""What the pages share: the database check, study and trial pickers bound to the URL, links
and number formatting. Queries stay in :mod:`dashboard.data`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode

import streamlit as st

from dashboard import data
from db.session import DatabaseError

#: Page scripts, relative to ``dashboard/app.py`` (``st.Page`` and ``st.page_link`` take these).
PAGES = {
    "studies": "app_pages/studies.py",
    "study": "app_pages/study.py",
    "trial": "app_pages/trial.py",
    "compare": "app_pages/compare.py",
    "workloads": "app_pages/workloads.py",
    "export": "app_pages/export.py",
    "plans": "app_pages/plans.py",
}
LIVE_REFRESH_S = 10
"""How often a view of a running study re-reads the database."""

POINT_AT_DB = (
    "Point the dashboard at a results database with `tuner dashboard --db URL`, or "
    "`MOETUNE_DB=URL streamlit run dashboard/app.py` (default: `sqlite:///moetune.db` in the working "
    "directory; PostgreSQL URLs work too)."
)
START_A_STUDY = (
    "Run a short study to fill it, for example `tuner run --trials 12` (a minute on a laptop CPU with "
    "the built-in model and workload), then reload this page. Studies that are still running show up "
    "as soon as their first trial starts."
)


def _require(status: Any, nothing: str, how: str) -> str:
    """The database URL when ``status(url)`` says it holds what a page shows; otherwise explain and stop."""
    try:
        url = data.db_url()
    except DatabaseError as e:
        st.error(f"Cannot open the results database: {e}")
        st.markdown(POINT_AT_DB)
        st.stop()
    state = status(url)
    if state["state"] == "error":
        st.error(f"Cannot open the results database: {state['message']}")
        st.markdown(POINT_AT_DB)
        st.stop()
    if state["state"] == "empty":
        st.info(f"{nothing}: {state['message']}")
        st.markdown(how)
        st.stop()
    return url


def require_database() -> str:
    """The URL of a readable database holding at least one study; otherwise explain and stop."""
    return _require(data.database_status, "No studies yet", START_A_STUDY)


START_A_PLAN = (
    "Plan a model on machines that are not here, for example `engine plan --model shape:qwen3-30b-a3b "
    "--profile builtin:rtx4090 --profile builtin:h100-pcie --max-requests 30` (simulated, no weights; add "
    "`--db URL` for another database), then reload this page."
)


def require_plans() -> str:
    """The URL of a readable database holding at least one ``engine plan`` run; otherwise explain and stop."""
    return _require(data.plans_status, "No plans yet", START_A_PLAN)


def pick_study(url: str) -> dict[str, Any]:
    """A study chosen in a select box bound to ``?study=NAME`` (newest first by default)."""
    names = data.study_names(url)
    last = st.session_state.get("_last_study")
    index = names.index(last) if last in names else 0
    name = st.selectbox("Study", names, index=index, key="study", bind="query-params")
    st.session_state["_last_study"] = name
    info = data.study_info(url, name)
    if info is None:  # deleted since the list was cached
        st.warning(f"Study {name!r} is no longer in the database.")
        st.stop()
    return info


def best_number(url: str, study_name: str) -> int | None:
    """The trial ``tuner export`` ranks first (the tuner's own ranking: the best confirmed median when the
    study was confirmed, else the best first objective among trials that met the SLO)."""
    ranking = data.export_ranking(url, study_name)
    return int(ranking["number"].iloc[0]) if len(ranking) else None


def trial_label(row: Mapping[str, Any]) -> str:
    """``trial 5 [fiddler], complete, meets the SLO``."""
    base = f" [{row['baseline']}]" if isinstance(row.get("baseline"), str) and row.get("baseline") else ""
    verdict = ""
    if row.get("state") == "complete":
        verdict = ", meets the SLO" if row.get("feasible") else ", misses the SLO"
    return f"trial {row['number']}{base}, {row['state']}{verdict}"


def study_caption(info: Mapping[str, Any]) -> str:
    """One line: model, workload, backend, hardware, objectives and SLO of a study."""
    return " · ".join([
        f"model **{info['model']}**",
        f"workload **{info['workload']}**",
        f"backend {info['backend']}",
        data.hardware_label(info.get("hardware")),
        "objective " + ", ".join(f"{o} ({d})" for o, d in zip(info["objectives"], info["directions"], strict=True)),
        f"SLO {data.slo_label(info.get('slo'))}",
    ])


def finding_text(conf: Mapping[str, Any]) -> str:
    """The one-sentence finding of a confirmation (the tuner's own wording)."""
    from tuner.report import finding

    best = conf["best"]
    return finding(conf, changed_knobs(best["config"]) if best else {})


def changed_knobs(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The knobs of ``config`` that differ from the engine defaults."""
    defaults = default_config()
    return {k: v for k, v in flatten(config).items() if k in defaults and v != defaults[k]}


def page_url(page: str, **params: Any) -> str:
    """A relative link to a page with query parameters (for link columns in tables)."""
    return f"{page}?{urlencode(params, doseq=True)}"


def link(page: str, label: str, **params: Any) -> None:
    """A link to another page of the app carrying ``params`` in the URL."""
    st.page_link(PAGES[page], label=label, query_params={k: str(v) if not isinstance(v, list) else v
                                                          for k, v in params.items()})


def fmt(value: Any, spec: str = ".4g", unit: str = "") -> str:
    """A number for display; ``-`` for missing."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    return f"{format(value, spec)}{unit}"


def flatten(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """``{"scheduler": {"max_batch_seqs": 8}}`` -> ``{"scheduler.max_batch_seqs": 8}`` (the
    tuner's own flattening); a config that is already flat is returned as is."""
    from tuner.space import flatten as flatten_nested

    config = dict(config or {})
    if config and all(isinstance(v, Mapping) for v in config.values()):
        return flatten_nested(config)
    return config


def default_config() -> dict[str, Any]:
    """Every knob's default, flat (from the engine's knob registry; no torch import)."""
    from engine.config import EngineConfig

    return flatten(EngineConfig().to_dict())
