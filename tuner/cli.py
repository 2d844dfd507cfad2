"""tuner: search the engine's knobs against SLOs, resumably; show, export and browse studies.

    tuner run                      # a short study on the built-in model and workload
    tuner run --model DIR --workload W --slo ttft_p99_ms=2000 --slo tpot_p99_ms=200 --timeout 8h
    tuner show --study NAME        # best trials, SLO attainment, gain over the baselines
    tuner export --study NAME --out best.json && engine run --config best.json
    tuner list | tuner dashboard
    tuner worker --db postgresql+psycopg://USER@HOST/DB --study NAME   # one more worker on a study

Bad input is one line on stderr and exit status 2; Ctrl-C stops after recording (status 130).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "builtin:qwen3_moe-tiny"
DEFAULT_WORKLOAD = "builtin:tiny"
DEFAULT_TRIALS = 24


def _fmt(v: Any, spec: str = ".3g") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool) or not isinstance(v, int | float):
        return str(v)
    return format(v, spec)


def _table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    cells = [[_fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- run


def _trial_line(frozen: Any, objectives: list[str]) -> str:
    from tuner.objective import ATTR_BASELINE, ATTR_ERROR, ATTR_METRICS
    from tuner.study import feasible, trial_state

    state = trial_state(frozen)
    name = frozen.user_attrs.get(ATTR_BASELINE)
    head = f"trial {frozen.number}" + (f" [{name}]" if name else "")
    if state != "complete":
        return f"{head} {state}: {frozen.user_attrs.get(ATTR_ERROR) or ''}".rstrip(": ")
    m = frozen.user_attrs.get(ATTR_METRICS) or {}
    parts = [f"{o} {_fmt(v, '.4g')}" for o, v in zip(objectives, frozen.values or [], strict=False)]
    parts += [f"attainment {_fmt(m.get('slo_attainment'), '.0%')}",
              f"ttft p99 {_fmt(m.get('ttft_p99_ms'), '.0f')} ms", f"tpot p99 {_fmt(m.get('tpot_p99_ms'), '.0f')} ms",
              f"{_fmt(m.get('output_tokens_per_s'), '.1f')} tok/s",
              *([f"top-1 agreement {m['quality_top1_agreement']:.1%}"] if m.get("quality_top1_agreement") is not None
                else []),
              f"reconfigure {_fmt(m.get('reconfigure_s', 0) * 1e3, '.1f')} ms"]
    return f"{head} complete{'' if feasible(frozen) else ' (SLO missed)'}: " + ", ".join(parts)


def cmd_run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from engine.config import ConfigError, EngineConfig
    from tuner.metrics import parse_objectives
    from tuner.slo import DEFAULT_SLO, parse_slo
    from tuner.space import parse_fixed
    from tuner.study import parse_duration

    # Everything a user typed is checked before any database or model work.
    slo = parse_slo(args.slo) if args.slo else parse_slo(data=DEFAULT_SLO)
    objectives = parse_objectives(args.objectives or args.objective)
    if args.rate_scale <= 0:
        raise ValueError(f"--rate-scale {args.rate_scale}: must be > 0")
    if args.trials < 1:
        raise ValueError(f"--trials {args.trials}: must be >= 1")
    if args.capacity and args.mode != "realtime":
        raise ValueError("--capacity needs --mode realtime (capacity is a highest arrival rate)")
    if "capacity_rps" in objectives and not args.capacity:
        raise ValueError("objective capacity_rps needs --capacity")
    if args.capacity and slo.attainment_target is None:
        raise ValueError("--capacity needs per-request latency SLOs (e.g. --slo ttft_p99_ms=2000)")
    timeout_s = parse_duration(args.timeout) if args.timeout else None
    base = EngineConfig.from_file(args.config) if args.config else EngineConfig()
    fixed = parse_fixed(args.fix or [], base)

    from db.session import make_engine, mask_url, resolve_url, upgrade
    from engine.hwinfo import hardware, software
    from workloads.schema import load_workload

    workload = load_workload(args.workload)
    if args.capacity and not workload.rate_per_s:
        raise ValueError(f"--capacity: workload {workload.name} has no arrival rate (every request at t=0)")
    url = resolve_url(args.db)
    from tuner.worker import StudyLock, check_join, claim_sqlite, record_launch, run_budgeted

    claim_sqlite(url)  # one worker per SQLite file (several workers: PostgreSQL)
    with StudyLock(url, "moetune:migrations") as setup_lock:  # workers starting together migrate once
        upgrade(url)
    setup_lock.close()
    db = make_engine(url)

    import optuna

    from engine.runtime import Engine
    from tuner.baselines import BaselineContext, baseline_points
    from tuner.objective import Objective, quality_available
    from tuner.record import Recorder, model_identity, record_study, workload_fingerprint
    from tuner.space import build_space
    from tuner.study import (
        RetryLostTrial,
        best_trials,
        counted_trials,
        default_study_name,
        enqueue_baselines,
        full_study_name,
        open_storage,
        open_study,
    )

    hw = hardware()
    sw = {**software(), "optuna": optuna.__version__}
    space = build_space(hw, fixed=fixed, base=base)
    if not space.params:
        raise ConfigError("nothing to search: every searchable knob is pinned or inert here")
    name = full_study_name(args.study or default_study_name(args.model, args.workload), space.space_hash())
    start_config = space.to_config({}, base, source="--config/--fix")

    say = print if not args.json else (lambda *a, **k: print(*a, **k, file=sys.stderr))
    say(f"tuner: study {name} in {mask_url(url)}")
    t = time.perf_counter()
    engine = Engine(args.model, start_config)
    load_s = time.perf_counter() - t
    say(f"tuner: loaded {args.model} ({engine.spec.arch}, {engine.spec.total_params() / 1e6:.1f}M params, "
        f"{str(engine.dtype).removeprefix('torch.')} on {engine.device}) in {load_s:.2f} s "
        f"(weights {engine.load_s:.2f} s), once for the whole study")

    identity = model_identity(engine, args.model)
    settings = {
        "model_fingerprint": engine.fingerprint,
        "workload_fingerprint": workload_fingerprint(workload),
        "mode": args.mode,
        "rate_scale": args.rate_scale,
        "max_requests": args.max_requests,
        "slo": slo.to_dict(),
        "objectives": objectives,
        "capacity": args.capacity,
        "quality": not args.no_quality,
        "base_config_hash": start_config.config_hash(),
    }
    if getattr(args, "join", None):  # tuner worker: this machine's model, hardware and space must be the study's
        check_join(args.join, name=name, model_fingerprint=engine.fingerprint, hardware=hw)
    lock = StudyLock(url, name)  # workers on one study: created once, baselines once, the --trials budget shared
    lock.acquire()
    try:
        study_id = record_study(db, name, identity=identity, workload=workload, workload_spec=args.workload,
                                slo=slo.to_dict(), objectives=objectives, space_hash=space.space_hash(),
                                hardware=hw, software=sw)
        recorder = Recorder(db, study_id)
        on_lost = RetryLostTrial()
        on_lost.recorder = recorder
        storage = open_storage(url, args.heartbeat_s, on_lost)
        study = open_study(storage, name, objectives, slo.constraint_names(), settings, seed=args.seed)
        points = baseline_points(space, BaselineContext(engine.spec, hw, start_config))
        enqueued = enqueue_baselines(study, points, args.trials)
        from db.store import stable_hash

        record_launch(study, args, base.to_dict(), {"name": name, "model_fingerprint": engine.fingerprint,
                                                    "hardware_hash": stable_hash(hw), "hardware": hw})
    finally:
        lock.release()
    if enqueued:
        say(f"tuner: baselines first: {', '.join(enqueued)}")
    objective = Objective(
        engine=engine, model=args.model, workload=workload, space=space, base=base, slo=slo,
        objectives=objectives, recorder=recorder, mode=args.mode, rate_scale=args.rate_scale,
        capacity=args.capacity, max_requests=args.max_requests, load_s=load_s,
        memory_limit_bytes=int(args.memory_gib * 2**30) if args.memory_gib else None, prune=not args.no_prune,
        quality=not args.no_quality)
    if any(name.startswith("quality") for name in slo.bounds) and not (objective.quality and quality_available()):
        say("tuner: warning: quality bounds are not checked: "
            + ("--no-quality" if not objective.quality else "this engine cannot measure quality"))

    warm_s = objective.warm_up()
    done_before = len(counted_trials(study.get_trials(deepcopy=False)))
    say(f"tuner: SLO {slo.describe()}; objective {', '.join(objectives)}; {args.mode} replay of "
        f"{workload.name} ({len(workload.requests)} requests, rate x{args.rate_scale:g}); "
        f"{done_before}/{args.trials} trials done" + (f"; timeout {args.timeout}" if args.timeout else ""))
    show_bar = not args.quiet and sys.stderr.isatty()
    bar = tqdm(total=args.trials, initial=min(done_before, args.trials), unit="trial", desc="trials",
               disable=not show_bar, dynamic_ncols=True)

    def on_trial(st: optuna.Study, frozen: optuna.trial.FrozenTrial, counted: int) -> None:
        line = _trial_line(frozen, objectives)
        if show_bar:
            bar.write(line)
        elif not args.quiet:
            say(line)
        bar.update(max(0, min(counted, args.trials) - bar.n))
        best = best_trials(st.get_trials(deepcopy=False), objectives)
        if len(objectives) == 1:
            bar.set_postfix_str(f"best {objectives[0]} {_fmt(best[0].values[0], '.4g')}" if best else "best -")
        else:
            bar.set_postfix_str(f"Pareto front {len(best)}")

    t_run = time.perf_counter()
    interrupted = False
    try:
        ran = run_budgeted(study, objective, args.trials, lock, timeout_s, on_trial, say)
    except KeyboardInterrupt:
        interrupted = True
        ran = -1
    finally:
        bar.close()
        lock.close()
    run_s = time.perf_counter() - t_run
    if interrupted:
        say(f"tuner: interrupted; finished trials are saved. Re-run the same command to resume study {name}.")
    report = _report(db, name)
    reconf = objective.reconfigure_s
    timing = {"engine_load_s": load_s, "weights_load_s": engine.load_s, "warm_up_s": warm_s, "run_s": run_s,
              "trials_run": ran if ran >= 0 else None,
              "reconfigure_median_s": statistics.median(reconf) if reconf else None,
              "reconfigure_max_s": max(reconf) if reconf else None}
    say(f"tuner: {run_s:.1f} s for this run; engine load {load_s:.2f} s and warm-up {warm_s:.2f} s (once); "
        "reconfigure between trials "
        f"median {_fmt((timing['reconfigure_median_s'] or 0) * 1e3, '.2f')} ms, "
        f"max {_fmt((timing['reconfigure_max_s'] or 0) * 1e3, '.1f')} ms over {len(reconf)} trials")
    _print_report(report, say)
    db_flag = "" if not args.db else f" --db {mask_url(args.db)}"
    say("\nnext:")
    say(f"  tuner show --study {name}{db_flag}")
    say(f"  tuner export --study {name}{db_flag} --out best.json")
    say(f"  engine run --config best.json --model {args.model} --workload {args.workload}")
    say(f"  tuner dashboard{db_flag}     (or: MOETUNE_DB={mask_url(url)} streamlit run dashboard/app.py)")
    if args.json:
        print(json.dumps({**report, "timing": timing, "interrupted": interrupted}))
    return 130 if interrupted else 0


def _report(db: Any, name: str) -> dict[str, Any]:
    from db.session import session_scope
    from tuner.export import find_study, study_report

    with session_scope(db) as s:
        return study_report(s, find_study(s, name))


def _print_report(report: dict[str, Any], say: Any = print) -> None:
    objectives = report["objectives"]
    t = report["trials"]
    counts = ", ".join(f"{v} {k}" for k, v in t.items() if k != "total")
    say(f"\nstudy {report['study']}: {t['total']} trials ({counts}); SLO "
        + (", ".join(f"{k}={v:g}" for k, v in report["slo"].items()) or "none"))
    if not report["best"]:
        say("no complete trial yet")
        return
    best = report["best"][0]
    verdict = "meets the SLO" if best["feasible"] else "NO trial met the SLO; closest"
    vals = ", ".join(f"{o} {_fmt(best['objectives'].get(o), '.4g')}" for o in objectives)
    say(f"best: trial {best['number']}{' [' + best['baseline'] + ']' if best['baseline'] else ''} ({verdict}): "
        f"{vals}; attainment {_fmt(best['slo_attainment'], '.0%')}, ttft p99 {_fmt(best['ttft_p99_ms'], '.0f')} ms, "
        f"tpot p99 {_fmt(best['tpot_p99_ms'], '.0f')} ms, {_fmt(best['output_tokens_per_s'], '.1f')} tok/s")
    if best["changed"]:
        say("  knobs changed from the engine defaults: "
            + ", ".join(f"{k}={v}" for k, v in sorted(best["changed"].items())))
    else:
        say("  the engine defaults")
    if report["baselines"]:
        say(f"gain over baselines ({objectives[0]}):")
        rows = []
        for b in report["baselines"]:
            g = b["gain"].get(objectives[0])
            rows.append({"baseline": b["baseline"], "trial": b["number"], "state": b["state"],
                         "meets SLO": "yes" if b["feasible"] else "no",
                         objectives[0]: b["objectives"].get(objectives[0]),
                         "gain": f"x{g:.2f}" if g is not None else ("inf" if b["objectives"].get(objectives[0]) == 0
                                                                     else "-")})
        say(_table(rows, ["baseline", "trial", "state", "meets SLO", objectives[0], "gain"]))
    if len(report["best"]) > 1:
        say("top trials:")
        rows = [{"trial": r["number"], "state": r["state"], "meets SLO": "yes" if r["feasible"] else "no",
                 **{o: r["objectives"].get(o) for o in objectives},
                 "attainment": r["slo_attainment"], "ttft_p99_ms": r["ttft_p99_ms"], "tpot_p99_ms": r["tpot_p99_ms"]}
                for r in report["best"]]
        say(_table(rows, ["trial", "state", "meets SLO", *objectives, "attainment", "ttft_p99_ms", "tpot_p99_ms"]))


# ------------------------------------------------------------------------------- read back


def _readonly_db(url_arg: str | None) -> Any:
    from db.session import make_readonly_engine

    return make_readonly_engine(url_arg)


def cmd_show(args: argparse.Namespace) -> int:
    from db.session import session_scope
    from tuner.export import find_study, study_report

    db = _readonly_db(args.db)
    with session_scope(db) as s:
        report = study_report(s, find_study(s, args.study), top=args.top)
    _print_report(report)
    if report.get("reconfigure_s"):
        r = report["reconfigure_s"]
        print(f"reconfigure between trials: median {r['median'] * 1e3:.2f} ms, max {r['max'] * 1e3:.1f} ms; "
              f"engine load {_fmt(report['engine_load_s'], '.2f')} s")
    if args.json:
        print(json.dumps(report))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from db.session import session_scope
    from tuner.export import export_config, find_study, write_export

    db = _readonly_db(args.db)
    with session_scope(db) as s:
        data = export_config(s, find_study(s, args.study), rank=args.rank)
    path = write_export(data, args.out)
    m = data["metrics"]
    print(f"wrote {path}: trial {data['trial']} of {data['study']} "
          f"({'meets the SLO' if m['feasible'] else 'does not meet the SLO'}; "
          f"goodput {_fmt(m['goodput_rps'], '.3g')} req/s, {_fmt(m['output_tokens_per_s'], '.1f')} tok/s)")
    model = (data["model"].get("identity") or {}).get("model") or data["model"]["path"]
    print(f"use it: engine run --config {path} --model {model}")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from db.session import session_scope
    from tuner.export import list_studies

    db = _readonly_db(args.db)
    with session_scope(db) as s:
        rows = list_studies(s)
    if args.json:
        print(json.dumps(rows))
        return 0
    if not rows:
        print("no studies yet: run `tuner run`")
        return 0
    print(_table(rows, ["study", "workload", "objective", "trials", "best", "best_feasible", "created_at"]))
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    import dashboard
    from db.session import resolve_url

    url = resolve_url(args.db)
    _readonly_db(url).dispose()  # a missing or unreachable database is a one-line error here
    app = Path(dashboard.__file__).resolve().parent / "app.py"
    if not app.is_file():
        raise OSError(f"the dashboard is not installed: {app} is missing")
    cmd = [sys.executable, "-m", "streamlit", "run", str(app), "--server.port", str(args.port)]
    print(f"tuner: {' '.join(cmd)}  (MOETUNE_DB set)", file=sys.stderr)
    return subprocess.call(cmd, env={**os.environ, "MOETUNE_DB": url})


# ---------------------------------------------------------------------------------- parser


def _cmd_worker(args: argparse.Namespace) -> int:
    from tuner.worker import cmd_worker

    return cmd_worker(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tuner", description=(__doc__ or "").splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true", help="log what the tuner and Optuna do")
    sub = p.add_subparsers(dest="cmd", required=True)

    def db_arg(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--db", help="results database URL (default $MOETUNE_DB, else sqlite:///moetune.db)")

    r = sub.add_parser("run", help="run (or resume) a study")
    r.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint directory or builtin:<arch>-<preset>")
    r.add_argument("--workload", default=DEFAULT_WORKLOAD, help="workload path or builtin:<name>")
    r.add_argument("--slo", action="append", metavar="NAME=VALUE|FILE",
                   help="an SLO bound (repeat), e.g. ttft_p99_ms=2000, tpot_p99_ms=200, quality_min=0.95, "
                        "attainment_min=0.9; or a JSON file of them (default ttft_p99_ms=1000, tpot_p99_ms=100, "
                        "quality_min=0.9)")
    r.add_argument("--objective", default="goodput", help="what to maximise or minimise (default goodput)")
    r.add_argument("--objectives", help="several, comma-separated, for a Pareto search "
                                        "(e.g. output_tokens_per_s,tpot_p99_ms)")
    r.add_argument("--trials", type=int, default=DEFAULT_TRIALS,
                   help=f"finished trials the study should hold, baselines included (default {DEFAULT_TRIALS})")
    r.add_argument("--timeout", help="stop starting trials after this long: 8h, 90m, 1h30m, 3600")
    r.add_argument("--study", help="study name (default <model>.<workload>); the space hash is appended")
    db_arg(r)
    r.add_argument("--mode", choices=["realtime", "offline"], default="realtime",
                   help="realtime replays arrival times; offline sends every request at once")
    r.add_argument("--rate-scale", type=float, default=1.0, help="divide arrival times by this")
    r.add_argument("--max-requests", type=int, help="replay only the first N requests")
    r.add_argument("--capacity", action="store_true",
                   help="also find each trial's capacity: the highest rate keeping attainment >= the target")
    r.add_argument("--config", help="base engine config (JSON or a `tuner export` file) for the knobs not searched")
    r.add_argument("--fix", action="append", metavar="KNOB=VALUE", help="pin a knob (repeat); not searched")
    r.add_argument("--seed", type=int, default=0, help="sampler seed")
    r.add_argument("--heartbeat-s", type=int, default=10,
                   help="trial heartbeat; a trial silent for 3 beats is retried (default 10)")
    r.add_argument("--memory-gib", type=float, help="memory a config may use (default: what is free)")
    r.add_argument("--no-prune", action="store_true", help="never cut a trial short")
    r.add_argument("--no-quality", action="store_true",
                   help="skip measuring output quality against the full-precision reference after each run")
    r.add_argument("--quiet", action="store_true", help="no progress bar and no per-trial lines")
    r.add_argument("--json", action="store_true", help="end with one JSON object on the last line")
    r.set_defaults(fn=cmd_run)

    s = sub.add_parser("show", help="best trials, SLO attainment and the gain over each baseline")
    s.add_argument("--study", required=True)
    s.add_argument("--top", type=int, default=5)
    s.add_argument("--json", action="store_true")
    db_arg(s)
    s.set_defaults(fn=cmd_show)

    e = sub.add_parser("export", help="write a trial's config with the model, workload, hardware and SLO")
    e.add_argument("--study", required=True)
    e.add_argument("--rank", type=int, default=1, help="1 = the best trial, 2 = the next, ...")
    e.add_argument("--out", required=True)
    db_arg(e)
    e.set_defaults(fn=cmd_export)

    ls = sub.add_parser("list", help="every study in the database")
    ls.add_argument("--json", action="store_true")
    db_arg(ls)
    ls.set_defaults(fn=cmd_list)

    w = sub.add_parser("worker", help="join a study with its recorded model, workload, SLO and space "
                                      "(several workers share one study on PostgreSQL)")
    w.add_argument("--study", required=True, help="the study's full name (as `tuner list` shows it)")
    db_arg(w)
    w.add_argument("--trials", type=int, help="the study's budget (default: the one it was started with)")
    w.add_argument("--seed", type=int, help="sampler seed (default: this process id, so workers differ)")
    w.add_argument("--heartbeat-s", type=int, default=10,
                   help="trial heartbeat; a trial silent for 3 beats is retried once (default 10)")
    w.add_argument("--quiet", action="store_true", help="no progress bar and no per-trial lines")
    w.add_argument("--json", action="store_true", help="end with one JSON object on the last line")
    w.set_defaults(fn=_cmd_worker)

    d = sub.add_parser("dashboard", help="open the Streamlit dashboard on the results database")
    d.add_argument("--port", type=int, default=8501)
    db_arg(d)
    d.set_defaults(fn=cmd_dashboard)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.INFO if args.verbose else optuna.logging.ERROR)
    except ImportError:
        pass
    from engine.model.arch import CheckpointError
    from workloads.schema import WorkloadError

    try:
        return args.fn(args)
    except KeyboardInterrupt:
        print("tuner: interrupted", file=sys.stderr)
        return 130
    except (CheckpointError, WorkloadError, ValueError, LookupError, OSError) as e:
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"tuner: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
