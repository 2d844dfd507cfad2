"""The moetune dashboard: ``streamlit run dashboard/app.py`` (or ``tuner dashboard``).

Reads the results database named by ``$MOETUNE_DB`` (default ``sqlite:///moetune.db``), read-only.
This file only declares the pages; each lives in ``app_pages/`` and every query in ``data.py``.
Selections travel in the URL (``/trial?study=NAME&trial=3``), so any view can be linked to.
"""

from __future__ import annotations

import sys
from pathlib import Path

# `streamlit run dashboard/app.py` puts dashboard/ on sys.path, not the repository; without an
# installed moetune the packages beside it would not import.
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import streamlit as st  # noqa: E402

from dashboard import data  # noqa: E402
from dashboard.ui import PAGES  # noqa: E402

st.set_page_config(page_title="moetune", page_icon=":material/tune:", layout="wide")

pages = [
    st.Page(PAGES["studies"], title="Studies", icon=":material/table_view:", url_path="studies", default=True),
    st.Page(PAGES["study"], title="Study", icon=":material/insights:", url_path="study"),
    st.Page(PAGES["trial"], title="Trial", icon=":material/science:", url_path="trial"),
    st.Page(PAGES["compare"], title="Compare", icon=":material/compare_arrows:", url_path="compare"),
    st.Page(PAGES["workloads"], title="Workloads", icon=":material/stacked_bar_chart:", url_path="workloads"),
    st.Page(PAGES["export"], title="Export", icon=":material/download:", url_path="export"),
    st.Page(PAGES["plans"], title="Plans", icon=":material/query_stats:", url_path="plans"),
]
page = st.navigation(pages)
st.sidebar.caption(f"Results database (read-only): `{data.db_label()}`")
page.run()
