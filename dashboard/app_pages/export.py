"""Export: the config file of the best (or any complete) trial, byte for byte what
``tuner export`` writes, ready for ``engine run --config``."""

from __future__ import annotations

import streamlit as st

from dashboard import data, ui

url = ui.require_database()
st.title("Export")
info = ui.pick_study(url)
ranking = data.export_ranking(url, info["name"])
if ranking.empty:
    st.info("This study has no complete trial to export yet.")
    st.stop()
numbers = [int(n) for n in ranking["number"]]
rows = ranking.set_index("number")
objective = info["objectives"][0]


def describe(n: int) -> str:
    r = rows.loc[n]
    base = f" [{r['baseline']}]" if isinstance(r["baseline"], str) and r["baseline"] else ""
    verdict = "meets the SLO" if r["meets_slo"] else "misses the SLO"
    return f"#{int(r['rank'])}: trial {n}{base}, {verdict}, {objective} {ui.fmt(r[objective])}"


number = st.selectbox("Trial", numbers, index=0, key="trial", bind="query-params",
                      help="complete trials in `tuner export --rank` order; the first is the best")
rank = int(rows.loc[number, "rank"])
st.markdown(describe(number))
confirmed = next((c for c in (data.findings(url, info["name"])["confirmation"] or {}).get("configs", [])
                  if c["number"] == number and c["interval"]), None)
if confirmed:
    iv = confirmed["interval"]
    st.markdown(f"Confirmed {objective}: {ui.fmt(iv['median'])} ({ui.fmt(iv['lo'])}-{ui.fmt(iv['hi'])}, {iv['n']} "
                "interleaved runs): the figures the file carries under `confirmed`.")
else:
    st.caption("Not among the confirmed configs: the file carries its single search measurement only.")
if not rows.loc[number, "meets_slo"]:
    st.warning("This trial did not meet the SLO; `tuner export` would export it all the same.")
text = data.export_text(url, info["name"], rank)
file_name = f"{info['name']}-trial{number}.json"
st.download_button("Download the config", data=text.encode(), file_name=file_name, mime="application/json",
                   icon=":material/download:", type="primary")
st.markdown("The same file as")
st.code(f"tuner export --study {info['name']} --rank {rank} --out {file_name}", language="bash")
st.markdown("Use it with")
model = info["model"]
st.code(f"engine run --config {file_name} --model {model}", language="bash")
st.markdown("**Complete trials in export order** (`--rank 1` is the best)")
st.dataframe(ranking, hide_index=True, column_config={"meets_slo": st.column_config.CheckboxColumn("meets SLO")})
with st.expander("File contents"):
    st.code(text, language="json")
