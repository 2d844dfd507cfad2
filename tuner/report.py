"""What ``tuner run``, ``tuner confirm`` and ``tuner show`` print: a study's finding, in words and tables.

The report dict comes from ``tuner.export.study_report`` (plus ``tuner.importance``); this module only
renders it. Labels come from the metrics table (``engine.metrics``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from engine.metrics import label

Say = Callable[..., None]


def fmt(v: Any, spec: str = ".3g") -> str:
    """A number for a terminal; ``-`` for missing."""
    if v is None:
        return "-"
    if isinstance(v, bool) or not isinstance(v, int | float):
        return str(v)
    return format(v, spec)


def table(rows: Sequence[Mapping[str, Any]], cols: Sequence[str]) -> str:
    """A plain left-aligned table."""
    cells = [[fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def _unit(objective: str) -> str:
    text = label(objective)
    return text[text.index("(") + 1: -1] if "(" in text else ""


def trial_line(frozen: Any, objectives: Sequence[str]) -> str:
    """One line per finished trial for the progress output."""
    from tuner.objective import ATTR_BASELINE, ATTR_ERROR, ATTR_METRICS, ATTR_RUNGS
    from tuner.study import feasible, trial_state

    state = trial_state(frozen)
    name = frozen.user_attrs.get(ATTR_BASELINE)
    head = f"trial {frozen.number}" + (f" [{name}]" if name else "")
    if state != "complete":
        rungs = frozen.user_attrs.get(ATTR_RUNGS) or {}
        got = f" (after {objectives[0]} {fmt(rungs[max(rungs)], '.4g')} on a prefix)" if rungs else ""
        return f"{head} {state}{got}: {frozen.user_attrs.get(ATTR_ERROR) or ''}".rstrip(": ")
    m = frozen.user_attrs.get(ATTR_METRICS) or {}
    parts = [f"{o} {fmt(v, '.4g')}" for o, v in zip(objectives, frozen.values or [], strict=False)]
    parts += [f"attainment {fmt(m.get('slo_attainment'), '.0%')}",
              f"ttft p99 {fmt(m.get('ttft_p99_ms'), '.0f')} ms", f"tpot p99 {fmt(m.get('tpot_p99_ms'), '.0f')} ms",
              f"{fmt(m.get('output_tokens_per_s'), '.1f')} tok/s",
              *([f"top-1 agreement {m['quality_top1_agreement']:.1%}"] if m.get("quality_top1_agreement") is not None
                else [])]
    return f"{head} complete{'' if feasible(frozen) else ' (SLO missed)'}: " + ", ".join(parts)


def _changed(changed: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(changed.items())) or "none (the engine defaults)"


def print_report(report: Mapping[str, Any], say: Say = print) -> None:
    """The whole report: study, noise, multi-fidelity, time, the confirmed finding, importance, top trials."""
    objectives = report["objectives"]
    o = objectives[0]
    unit = _unit(o)
    t = report["trials"]
    counts = ", ".join(f"{v} {k}" for k, v in t.items() if k != "total")
    say(f"\nstudy {report['study']}: {t['total']} trials ({counts}); objective {', '.join(objectives)}; SLO "
        + (", ".join(f"{k}={v:g}" for k, v in report["slo"].items()) or "none"))
    noise = report.get("noise")
    if noise:
        vals = ", ".join(fmt(v, ".4g") for v in noise["values"])
        say(f"noise: the defaults measured {noise['n']} times: {vals} {unit} (spread {noise['rel_spread']:.1%} of "
            "the median)")
    f = report.get("fidelity") or {}
    if f.get("searched"):
        saved = f"; about {f['time_saved_s']:.0f} s of replays saved" if f.get("time_saved_s") is not None else ""
        say(f"multi-fidelity: of {f['searched']} searched trials, {f['stopped_on_prefix']} stopped on a prefix and "
            f"{f['promoted']} reached the whole workload ({f['fraction_promoted']:.0%}), where "
            f"{f['promoted'] - f['completed']} more could not beat the best so far{saved}")
    tm = report.get("time") or {}
    if tm.get("measured_s"):
        say(f"time: {tm['measured_s']:.0f} s of replays in trials, quality checks {tm['quality_s']:.0f} s, overhead "
            f"(reconfigure, warm-up, probe set-up) {tm['overhead_s']:.1f} s = {tm['overhead_share']:.1%} of the "
            f"replay time (worst trial {tm['overhead_share_max']:.1%}); noise and confirmation runs "
            f"{tm['repeats_runs_s']:.0f} s")
    conf = report.get("confirmation")
    if conf:
        _print_confirmation(report, conf, say)
    else:
        _print_unconfirmed(report, say)
    val = report.get("validation")
    if val:
        say(validation_line(val))
    imp = report.get("importance")
    if imp:
        say(f"parameter importance: {imp['message']}")
    if len(report["best"]) > 1:
        say("top trials (their own search, one measurement each):")
        rows = [{"trial": r["number"], "baseline": r["baseline"], "state": r["state"],
                 "meets SLO": "yes" if r["feasible"] else "no", **{x: r["objectives"].get(x) for x in objectives},
                 "attainment": r["slo_attainment"], "ttft_p99_ms": r["ttft_p99_ms"], "tpot_p99_ms": r["tpot_p99_ms"],
                 "changed": _changed(r["changed"])[:60]}
                for r in report["best"]]
        say(table(rows, ["trial", "baseline", "state", "meets SLO", *objectives, "attainment", "ttft_p99_ms",
                         "tpot_p99_ms", "changed"]))


def _print_confirmation(report: Mapping[str, Any], conf: Mapping[str, Any], say: Say) -> None:
    o = conf["objective"]
    unit = _unit(o)
    order = " ".join(str(n) for n in conf["order"][: len(conf["configs"]) * 2])
    say(f"confirmed (session {conf['session']}): {len(conf['configs'])} configs x {conf['repeats']} interleaved "
        f"runs, order {order}{' ...' if len(conf['order']) > len(conf['configs']) * 2 else ''}")
    rows = []
    for c in conf["configs"]:
        iv = c["interval"] or {}
        rows.append({"trial": c["number"], "baseline": c["baseline"], f"{o} median": fmt(iv.get("median"), ".4g"),
                     "interval": f"{fmt(iv.get('lo'), '.4g')}-{fmt(iv.get('hi'), '.4g')}" if iv else "-",
                     "runs": iv.get("n"), "method": iv.get("method"), "search": c["search_value"]})
    say(table(rows, ["trial", "baseline", f"{o} median", "interval", "runs", "method", "search"]))
    best = conf["best"]
    if best is None:
        say("no confirmed config was measured")
        return
    changed = next((r["changed"] for r in report["best"] + report["baselines"] if r["number"] == best["number"]), {})
    iv = best["interval"]
    kind = "baseline " + best["baseline"] if best["baseline"] else f"trial {best['number']}"
    above = (f"; {best['open_above']} of them met the target at the highest rate tried, so at least that"
             if best.get("open_above") else "")
    say(f"best confirmed {'baseline' if best['baseline'] else 'searched config'}: {kind}, {o} {iv['median']:.4g} "
        f"{unit} ({iv['lo']:.4g}-{iv['hi']:.4g}, {iv['n']} runs{above}); knobs changed from the defaults: "
        f"{_changed(changed)}")
    for g in conf["gains"]:
        say(f"  {g['text']}")
    say("finding: " + finding(conf, changed))


def finding(conf: Mapping[str, Any], changed: Mapping[str, Any]) -> str:
    """One sentence: what the study found, confirmed, or that nothing beats the defaults beyond noise."""
    best = conf["best"]
    gains = {g["baseline"]: g for g in conf["gains"]}
    over_defaults = gains.get("defaults")
    if best["baseline"]:
        return (f"no searched config beats the baseline {best['baseline']} (the best confirmed median); "
                "the search found no gain beyond noise on this machine")
    if over_defaults is None:
        return f"trial {best['number']} is the best confirmed config; the defaults were not confirmed beside it"
    if over_defaults["verdict"] == "gain":
        return (f"trial {best['number']} ({_changed(changed)}) "
                f"{over_defaults['text'].replace('over defaults', 'the defaults')}")
    return (f"no config beats the defaults beyond noise on this machine (best searched: trial {best['number']}, "
            f"{over_defaults['text']})")


def _print_unconfirmed(report: Mapping[str, Any], say: Say) -> None:
    objectives = report["objectives"]
    if not report["best"]:
        say("no complete trial yet")
        return
    best = report["best"][0]
    verdict = "meets the SLO" if best["feasible"] else "NO trial met the SLO; closest"
    vals = ", ".join(f"{o} {fmt(best['objectives'].get(o), '.4g')}" for o in objectives)
    say(f"best (not confirmed; one measurement each, see `tuner confirm`): trial {best['number']}"
        f"{' [' + best['baseline'] + ']' if best['baseline'] else ''} ({verdict}): {vals}")
    say(f"  knobs changed from the engine defaults: {_changed(best['changed'])}")
    if report["baselines"]:
        rows = []
        for b in report["baselines"]:
            g = b["gain"].get(objectives[0])
            rows.append({"baseline": b["baseline"], "trial": b["number"], "state": b["state"],
                         "meets SLO": "yes" if b["feasible"] else "no", objectives[0]: b["objectives"].get(objectives[0]),
                         "gain (unconfirmed)": f"x{g:.2f}" if g is not None else "-"})
        say(table(rows, ["baseline", "trial", "state", "meets SLO", objectives[0], "gain (unconfirmed)"]))


def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * v:+.1f}%"


def validation_line(val: Mapping[str, Any]) -> str:
    """One line: the latest live validation of a simulated study and its median errors."""
    summary = val.get("summary") or {}
    errs = ", ".join(f"{m} {fmt((summary.get(m) or {}).get('median_abs_error'), '.1%')}" for m in val["metrics"])
    rho = (summary.get("spearman") or {}).get("rho")
    forced = " (forced: the profile does not describe this machine)" if val.get("forced") else ""
    return (f"validated live (session {val['session']}, {len(val['trials'])} trials x {val['repeats']} runs on "
            f"{val.get('hardware_fingerprint')}){forced}: median |error| {errs}; Spearman {fmt(rho, '.2f')} "
            f"(`tuner validate --study {val['study']}` re-runs it)")


def print_validation(val: Mapping[str, Any], say: Say = print) -> None:
    """The validation table: per trial and metric, predicted (simulated), measured (live median) and the
    signed relative error; then the median absolute error per metric and Spearman's rho of the objective."""
    profile = val.get("profile") or {}
    say(f"\nvalidation {val['session']} of study {val['study']}: profile {profile.get('name')} (calibrated: "
        f"{str(bool(profile.get('calibrated'))).lower()}) against live runs on this machine "
        f"({val.get('hardware_fingerprint')}), {val['repeats']} run(s) each, median"
        + (f"\nforced: {val['mismatch']}" if val.get("forced") else ""))
    rows = []
    for t in val["trials"]:
        name = f"{t['trial']}" + (f" [{t['baseline']}]" if t.get("baseline") else "")
        for m in val["metrics"]:
            rows.append({"trial": name, "metric": m, "predicted": fmt(t["predicted"].get(m), ".4g"),
                         "measured": fmt(t["measured"].get(m), ".4g"), "error": _pct(t["error"].get(m))})
            name = ""
        if t.get("note"):
            rows.append({"trial": "", "metric": "note", "predicted": t["note"][:80]})
    say(table(rows, ["trial", "metric", "predicted", "measured", "error"]))
    summary = val.get("summary") or {}
    parts = []
    for m in val["metrics"]:
        s = summary.get(m) or {}
        target = s.get("target")
        verdict = "" if target is None or s.get("met") is None else \
            f" (target {target:.0%}: {'met' if s['met'] else 'missed'})"
        parts.append(f"{m} {fmt(s.get('median_abs_error'), '.1%')}{verdict}")
    say("median |error|: " + ", ".join(parts))
    sp = summary.get("spearman") or {}
    rho = sp.get("rho")
    say(f"Spearman rank correlation of {sp.get('metric')}, predicted against measured, over {sp.get('n')} trials: "
        + (f"{rho:.2f} (target {sp['target']:g}: {'met' if sp.get('met') else 'missed'})" if rho is not None
           else "- (needs 3 or more trials whose figures differ)"))
