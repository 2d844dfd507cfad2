"""The Study page of a simulated study: predicted against measured once `tuner validate` ran, else
"not validated live". Real short sim studies of the tiny model, validated live (forced: the datasheet
profile describes another machine), read back independently through the ORM."""

from __future__ import annotations

import pytest

from dashboard.charts import label


def test_study_page_shows_predicted_against_measured(sim_validated, page, kit):
    url, names, stored, mismatch = sim_validated
    at = page("study", url, study=names["checked"])
    text = kit.texts(at)
    assert "Simulated against live" in text and "Not validated live" not in text
    assert "Validation 1: profile spr (calibrated: false)" in text
    assert f"Forced (--force): {mismatch}" in text

    table = next(df.value for df in at.dataframe if "measured" in df.value.columns)
    got = {(int(n.split()[1]), m): (p, v) for n, m, p, v in
           zip(table["trial"], table["metric"], table["predicted"], table["measured"], strict=True)}
    assert set(got) == set(stored)
    for key, (p, v) in stored.items():
        assert got[key] == (pytest.approx(p), pytest.approx(v))
    assert table["error"].tolist() == pytest.approx([(p - v) / v for p, v in zip(table["predicted"],
                                                                                 table["measured"], strict=True)])

    charts = kit.charts(at)
    for metric in ("capacity_rps", "output_tokens_per_s", "ttft_p99_ms", "tpot_p99_ms"):
        chart = charts[f"Predicted vs measured: {label(metric)}"]
        points = next(tr for tr in chart["data"] if tr["mode"] == "markers")
        expected = sorted(v for (_, m), v in stored.items() if m == metric)
        drawn = sorted(zip(points["x"], points["y"], strict=True))
        assert [x for pair in drawn for x in pair] == pytest.approx([x for pair in expected for x in pair])
        line = next(tr for tr in chart["data"] if tr["mode"] == "lines")
        assert line["x"] == line["y"]  # y = x
    assert sum(t.startswith("Predicted vs measured:") for t in charts) == 4
    medians = {m.label: m.value for m in at.metric}
    assert medians["median |error| capacity_rps"].endswith("%") and "Spearman capacity_rps" in medians


def test_study_page_says_not_validated_live(sim_validated, page, kit):
    url, names, _, _ = sim_validated
    at = page("study", url, study=names["unchecked"])
    assert "Not validated live" in kit.texts(at)
    assert not any(t.startswith("Predicted vs measured:") for t in kit.charts(at))
