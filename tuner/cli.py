"""tuner: search the engine's knobs against SLOs, resumably; confirm, show, export and browse studies.

    tuner run                      # a short study on the built-in model and workload, confirmed
    tuner run --model DIR --workload W --slo ttft_p99_ms=2000 --slo tpot_p99_ms=200 --timeout 8h
    tuner confirm --study NAME     # re-run the top configs and every baseline, interleaved
    tuner show --study NAME        # noise, confirmed gains with intervals, best trials
    tuner validate --study NAME    # a --backend sim study's best trials re-run live: predicted against measured
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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config import EngineConfig
from typing import Any

from tuner.report import fmt as _fmt
from tuner.report import print_report, table, trial_line

DEFAULT_MODEL = "builtin:qwen3_moe-small"
DEFAULT_WORKLOAD = "builtin:quick"
DEFAULT_TRIALS = 10
DEFAULT_FIDELITY = "0.34,1"
DEFAULT_NOISE_REPEATS = 3
DEFAULT_CONFIRM_REPEATS = 3
DEFAULT_RUN_CONFIRM_TOP = 1
DEFAULT_CONFIRM_TOP = 2


# ------------------------------------------------------------------------------------- run


def parse_fidelity(text: str) -> tuple[float, ...]:
    """``"0.34,1"`` -> ``(0.34, 1.0)``: increasing shares of the workload, the last one 1."""
    try:
        rungs = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--fidelity {text!r}: expected increasing shares of the workload, e.g. 0.34,1") from None
    if not rungs or rungs[-1] != 1.0 or any(not 0 < r <= 1 for r in rungs) or list(rungs) != sorted(set(rungs)):
        raise ValueError(f"--fidelity {text!r}: expected increasing shares in (0, 1] ending with 1, e.g. 0.34,1")
    return rungs


def _objectives(args: argparse.Namespace, slo: Any, workload: Any) -> list[str]:
    from tuner.metrics import DEFAULT_OBJECTIVE, OFFLINE_OBJECTIVE, parse_objectives

    if args.objectives or args.objective:
        objectives = parse_objectives(args.objectives or args.objective)
    else:
        objectives = [DEFAULT_OBJECTIVE if args.mode == "realtime" else OFFLINE_OBJECTIVE]
    if "capacity_rps" in objectives:
        if args.mode != "realtime":
            raise ValueError("objective capacity needs --mode realtime (capacity is a highest arrival rate); "
                             "offline replays optimise output_tokens_per_s")
        if slo.attainment_target is None:
            raise ValueError("objective capacity needs per-request latency SLOs (e.g. --slo ttft_p99_ms=2000)")
        if workload is not None and not workload.rate_per_s:
            raise ValueError(f"objective capacity: workload {workload.name} has no arrival rate "
                             "(every request at t=0); use --mode offline")
        if len(objectives) > 1:
            raise ValueError("objective capacity cannot be one of several (--objectives): it is a search per trial")
    return objectives


def _slo(args: argparse.Namespace) -> Any:
    from tuner.slo import DEFAULT_SLO, SloError, SloSpec, parse_slo

    slo = parse_slo(args.slo) if args.slo else parse_slo(data=DEFAULT_SLO)
    if args.attainment is not None:
        if not 0 < args.attainment <= 1:
            raise SloError(f"--attainment {args.attainment}: a share, between 0 and 1")
        given = slo.bounds.get("attainment_min")
        if given is not None and given != args.attainment:
            raise SloError(f"--attainment {args.attainment} and --slo attainment_min={given:g} disagree")
        slo = SloSpec({**slo.bounds, "attainment_min": float(args.attainment)})
    return slo


def cmd_run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from engine.config import ConfigError, EngineConfig
    from tuner.space import parse_fixed
    from tuner.study import parse_duration

    # Everything a user typed is checked before any database or model work.
    slo = _slo(args)
    if args.rate_scale <= 0:
        raise ValueError(f"--rate-scale {args.rate_scale}: must be > 0")
    if args.trials < 1:
        raise ValueError(f"--trials {args.trials}: must be >= 1")
    for flag in ("noise_repeats", "confirm_repeats", "confirm_top"):
        if getattr(args, flag) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be >= 0")
    rungs = parse_fidelity(args.fidelity) if not args.no_prune else (1.0,)
    _objectives(args, slo, None)
    timeout_s = parse_duration(args.timeout) if args.timeout else None
    base = EngineConfig.from_file(args.config) if args.config else EngineConfig()
    fixed = parse_fixed(args.fix or [], base)

    from db.session import make_engine, mask_url, resolve_url, upgrade
    from engine.hwinfo import hardware, software
    from workloads.schema import load_workload

    workload = load_workload(args.workload)
    objectives = _objectives(args, slo, workload)
    url = resolve_url(args.db)
    from tuner.worker import StudyLock, check_join, claim_sqlite, record_launch, run_budgeted

    claim_sqlite(url)  # one worker per SQLite file (several workers: PostgreSQL)
    with StudyLock(url, "moetune:migrations") as setup_lock:  # workers starting together migrate once
        upgrade(url)
    setup_lock.close()
    db = make_engine(url)

    import optuna

    from engine.backend import make_backend
    from tuner.baselines import BaselineContext, baseline_points
    from tuner.measure import Measurer, MeasureSettings
    from tuner.metrics import latency_constraints
    from tuner.objective import Objective
    from tuner.record import Recorder, model_identity, record_study, workload_fingerprint
    from tuner.repeats import NoisePhase, confirm
    from tuner.slo import study_constraints
    from tuner.space import build_space
    from tuner.study import (
        RetryLostTrial,
        best_trials,
        counted_trials,
        default_study_name,
        enqueue_baselines,
        full_study_name,
        make_pruner,
        open_storage,
        open_study,
    )

    if args.backend not in ("live", "sim"):
        raise ConfigError(f"tuner run --backend {args.backend}: trials run live or sim (the stub prices nothing)")
    from engine.cli import backend_options

    options = backend_options(args)  # sim: the profile (and synthetic routing) that price every trial
    profile = options.get("profile")
    hw = hardware() if profile is None else profile.hardware()
    sw = {**software(), "optuna": optuna.__version__}
    widths = model_widths(args.model)
    base = fit_int4_group(base, widths)
    space = build_space(hw, fixed=fixed, base=base, widths=widths)
    if not space.params:
        raise ConfigError("nothing to search: every searchable knob is pinned or inert here")
    name = full_study_name(args.study or default_study_name(args.model, args.workload), space.space_hash())
    start_config = space.to_config({}, base, source="--config/--fix")
    capacity = objectives[0] == "capacity_rps"
    constraints = study_constraints(slo, capacity=capacity, latency=latency_constraints(objectives, args.mode))
    measure_settings = MeasureSettings(tuple(objectives), args.mode, args.rate_scale, args.max_requests,
                                       tuple(constraints))

    say = print if not args.json else (lambda *a, **k: print(*a, **k, file=sys.stderr))
    say(f"tuner: study {name} in {mask_url(url)}")
    t = time.perf_counter()
    backend = make_backend(args.model, start_config, kind=args.backend, **options)
    engine = getattr(backend, "engine", None)  # the live backend's torch engine; the simulator has none
    load_s = time.perf_counter() - t
    spec = backend.spec
    if engine is not None:
        say(f"tuner: loaded {args.model} ({spec.arch}, {spec.total_params() / 1e6:.1f}M params, "
            f"{str(engine.dtype).removeprefix('torch.')} on {engine.device}, {engine.kernels_label} kernels) in "
            f"{load_s:.2f} s (weights {engine.load_s:.2f} s), once for the whole study")
    else:
        say(f"tuner: simulating {args.model} ({spec.arch}, {spec.total_params() / 1e6:.1f}M params, no weights) "
            f"priced by profile {profile.name} (calibrated: {str(profile.calibrated).lower()}) in {load_s:.2f} s")
        if not args.no_quality:
            say("tuner: --backend sim: no quality check (the simulator has no weights); every trial records "
                "quality_check off")
            args.no_quality = True

    identity = model_identity(backend, args.model)
    settings = {
        "model_fingerprint": identity["fingerprint"],
        "workload_fingerprint": workload_fingerprint(workload),
        **measure_settings.to_dict(),
        "slo": slo.to_dict(),
        "fidelity": list(rungs),
        "quality": not args.no_quality,
        "base_config_hash": start_config.config_hash(),
    }
    stored_settings = {**settings, "model": args.model, "workload": args.workload, "noise_repeats": args.noise_repeats,
                       "prune": not args.no_prune}
    if profile is not None:  # what priced the study's trials (the backend column says sim)
        stored_settings.update(profile=profile.describe(), calibrated=profile.calibrated)
    if getattr(args, "join", None):  # tuner worker: this machine's model, hardware and space must be the study's
        check_join(args.join, name=name, model_fingerprint=identity["fingerprint"], hardware=hw)
    lock = StudyLock(url, name)  # workers on one study: created once, baselines once, the --trials budget shared
    lock.acquire()
    try:
        study_id = record_study(db, name, identity=identity, workload=workload, workload_spec=args.workload,
                                slo=slo.to_dict(), objectives=objectives, space_hash=space.space_hash(),
                                hardware=hw, software=sw, settings=stored_settings, backend=backend.kind)
        recorder = Recorder(db, study_id)
        on_lost = RetryLostTrial()
        on_lost.recorder = recorder
        storage = open_storage(url, args.heartbeat_s, on_lost)
        study = open_study(storage, name, objectives, constraints, settings, seed=args.seed,
                           pruner=make_pruner(len(rungs)))
        skipped: list[tuple[str, str]] = []
        points = baseline_points(space, BaselineContext(spec, hw, start_config), skipped=skipped)
        enqueued = enqueue_baselines(study, points, args.trials)
        from db.store import stable_hash

        record_launch(study, args, base.to_dict(), {"name": name, "model_fingerprint": identity["fingerprint"],
                                                    "hardware_hash": stable_hash(hw), "hardware": hw})
    finally:
        lock.release()
    if enqueued:
        say(f"tuner: baselines first: {', '.join(enqueued)}")
    by_reason: dict[str, list[str]] = {}
    for n, why in skipped:
        by_reason.setdefault(why, []).append(n)
    for why, names in by_reason.items():
        say(f"tuner: baselines not run here: {', '.join(names)}: {why}")
    measurer = Measurer(backend, workload, slo, measure_settings)
    noise = NoisePhase(measurer, recorder, args.noise_repeats, say=say if not args.quiet else (lambda _m: None))
    objective = Objective(
        measurer=measurer, model=args.model, space=space, base=base, slo=slo, objectives=objectives,
        recorder=recorder, constraints=constraints, rungs=rungs, load_s=load_s,
        memory_limit_bytes=int(args.memory_gib * 2**30) if args.memory_gib else None, prune=not args.no_prune,
        quality=not args.no_quality, margin=noise.margin)
    if any(n.startswith("quality") for n in slo.bounds) and not objective.quality:
        say("tuner: warning: --no-quality: the SLO's quality bounds are not checked (each trial records "
            "quality_check off and the bound as unmeasured)")

    warm_s = objective.warm_up()
    if space.may_place_by_hotness(base):  # once, at the start config's speed, not at the first such trial's
        warm_s += measurer.warm_up_hotness()
    done_before = len(counted_trials(study.get_trials(deepcopy=False)))
    what = (f"capacity at attainment >= {slo.attainment_target:.0%} of {slo.describe_latency()}"
            if capacity else ", ".join(objectives))
    say(f"tuner: objective {what}; constraints {', '.join(constraints) or 'none'}; {args.mode} replay of "
        f"{workload.name} ({measurer.n_requests(1.0)} requests"
        + (f", fidelity {args.fidelity}" if len(rungs) > 1 else "") + f"); noise from {args.noise_repeats} runs "
        f"of the defaults; {done_before}/{args.trials} trials done" + (f"; timeout {args.timeout}" if args.timeout else ""))
    show_bar = not args.quiet and sys.stderr.isatty()
    bar = tqdm(total=args.trials, initial=min(done_before, args.trials), unit="trial", desc="trials",
               disable=not show_bar, dynamic_ncols=True)

    def on_trial(st: optuna.Study, frozen: optuna.trial.FrozenTrial, counted: int) -> None:
        line = trial_line(frozen, objectives)
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
    confirm_s = 0.0
    try:
        ran = run_budgeted(study, objective, args.trials, lock, timeout_s, on_trial, say, between=noise)
        bar.close()
        if args.confirm_repeats and len(objectives) == 1:
            t = time.perf_counter()
            confirm(measurer, db, study_id, top=args.confirm_top, repeats=args.confirm_repeats,
                    say=say if not args.quiet else (lambda _m: None))
            confirm_s = time.perf_counter() - t
    except KeyboardInterrupt:
        interrupted = True
        ran = -1
    finally:
        bar.close()
        lock.close()
    run_s = time.perf_counter() - t_run
    if interrupted:
        say(f"tuner: interrupted; finished trials are saved. Re-run the same command to resume study {name}.")
    report = _report(db, name, url)
    reconf = objective.reconfigure_s
    timing = {"engine_load_s": load_s, "weights_load_s": engine.load_s if engine is not None else 0.0,
              "warm_up_s": warm_s, "run_s": run_s,
              "noise_s": noise.ran_s, "confirm_s": confirm_s, "trials_run": ran if ran >= 0 else None,
              "reconfigure_median_s": statistics.median(reconf) if reconf else None,
              "reconfigure_max_s": max(reconf) if reconf else None}
    say(f"\ntuner: {run_s:.1f} s for this run (noise repeats {noise.ran_s:.1f} s, confirmation {confirm_s:.1f} s); "
        f"engine load {load_s:.2f} s and warm-up {warm_s:.2f} s (once); reconfigure between trials median "
        f"{_fmt((timing['reconfigure_median_s'] or 0) * 1e3, '.2f')} ms, max "
        f"{_fmt((timing['reconfigure_max_s'] or 0) * 1e3, '.1f')} ms over {len(reconf)} trials")
    print_report(report, say)
    db_flag = "" if not args.db else f" --db {mask_url(args.db)}"
    say("\nnext:")
    say(f"  tuner show --study {name}{db_flag}")
    say(f"  tuner confirm --study {name}{db_flag} --repeats 5     (tighter intervals)")
    say(f"  tuner export --study {name}{db_flag} --out best.json")
    sim = f" --backend sim --profile {args.profile}" if profile is not None else ""
    say(f"  engine run --config best.json --model {args.model} --workload {args.workload}{sim}")
    say(f"  tuner dashboard{db_flag}     (or: MOETUNE_DB={mask_url(url)} streamlit run dashboard/app.py)")
    if args.json:
        print(json.dumps({**report, "timing": timing, "interrupted": interrupted}))
    return 130 if interrupted else 0


def cmd_confirm(args: argparse.Namespace) -> int:
    from db.session import make_engine, mask_url, resolve_url, session_scope, upgrade
    from engine.backend import make_backend
    from tuner.export import find_study
    from tuner.measure import Measurer, MeasureSettings
    from tuner.repeats import confirm, settings_of
    from tuner.slo import parse_slo
    from workloads.schema import load_workload

    if args.repeats < 1:
        raise ValueError(f"--repeats {args.repeats}: must be >= 1")
    if args.top < 0:
        raise ValueError(f"--top {args.top}: must be >= 0")
    url = resolve_url(args.db)
    upgrade(url)
    db = make_engine(url)
    with session_scope(db) as s:
        study = find_study(s, args.study)
        settings = settings_of(study)
        name, study_id = study.name, study.id
        slo = parse_slo(data=study.slo or {})
        model = settings.get("model") or (study.model.identity or {}).get("model") or study.model.path
        workload_spec = settings.get("workload") or study.workload.source
        fingerprint = study.model.fingerprint
    say = print if not args.json else (lambda *a, **k: print(*a, **k, file=sys.stderr))
    workload = load_workload(workload_spec)
    backend = make_backend(model, kind="live")
    engine = backend.engine
    if engine.fingerprint != fingerprint:
        raise ValueError(f"{model}: its weights differ from those study {name!r} was tuned on "
                         f"(fingerprint {engine.fingerprint}, study {fingerprint})")
    ms = MeasureSettings.from_dict(settings)
    measurer = Measurer(backend, workload, slo, ms)
    say(f"tuner: confirming study {name} in {mask_url(url)} on {model} and {workload.name}")
    measurer.warm_up()
    confirm(measurer, db, study_id, top=args.top, repeats=args.repeats, say=say)
    report = _report(db, name, url)
    print_report(report, say)
    if args.json:
        print(json.dumps(report))
    return 0


# -------------------------------------------------------------------------------- validate


def cmd_validate(args: argparse.Namespace) -> int:
    """``tuner validate``: re-run a simulated study's best trials live here; predicted against measured."""
    from db.session import make_engine, mask_url, resolve_url, session_scope, upgrade
    from engine.hwinfo import hardware
    from tuner.report import print_validation
    from tuner.validate import plan, validate_study

    if args.repeats < 1:
        raise ValueError(f"--repeats {args.repeats}: must be >= 1")
    url = resolve_url(args.db)
    readonly = _readonly_db(url)
    with session_scope(readonly) as s:  # every refusal before anything is created or migrated
        plan(s, args.study, top=args.top, force=args.force, here=hardware())
    readonly.dispose()
    upgrade(url)
    db = make_engine(url)
    say = print if not args.json else (lambda *a, **k: print(*a, **k, file=sys.stderr))
    say(f"tuner: validating study {args.study} in {mask_url(url)}")
    report = validate_study(db, args.study, top=args.top, repeats=args.repeats, force=args.force, say=say)
    print_validation(report)
    if args.json:
        print(json.dumps(report))
    return 0


def _validate_parser(sub: Any, db_arg: Any) -> None:
    from tuner.validate import DEFAULT_REPEATS, DEFAULT_TOP

    v = sub.add_parser("validate", help="re-run a simulated study's best trials live here; store predicted "
                                        "against measured")
    v.add_argument("--study", required=True, help="a study run with --backend sim")
    v.add_argument("--top", type=int, default=DEFAULT_TOP, help=f"best complete trials to re-run (default {DEFAULT_TOP})")
    v.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                   help=f"interleaved live runs of each; the measured figure is their median (default {DEFAULT_REPEATS})")
    v.add_argument("--force", action="store_true",
                   help="validate although the study's profile does not describe this machine (recorded as forced)")
    v.add_argument("--json", action="store_true", help="end with one JSON object on the last line")
    db_arg(v)
    v.set_defaults(fn=cmd_validate)


def _report(db: Any, name: str, url: str | None = None, top: int = 5) -> dict[str, Any]:
    from db.session import session_scope
    from tuner.export import find_study, study_report

    with session_scope(db) as s:
        report = study_report(s, find_study(s, name), top=top)
    if url is not None:
        from tuner.importance import importance_report

        report["importance"] = importance_report(url, report)
    return report


# ------------------------------------------------------------------------------- read back


def _readonly_db(url_arg: str | None) -> Any:
    from db.session import make_readonly_engine

    return make_readonly_engine(url_arg)


def cmd_show(args: argparse.Namespace) -> int:
    from db.session import resolve_url

    url = resolve_url(args.db)
    db = _readonly_db(url)
    report = _report(db, args.study, url, top=args.top)
    print_report(report)
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
    objective = (data.get("objectives") or ["-"])[0]
    conf = data.get("confirmed")
    figure = (f"confirmed {objective} {conf['median']:.4g} ({conf['lo']:.4g}-{conf['hi']:.4g}, {conf['n']} runs)"
              if conf else f"{objective} {_fmt((m.get('objectives') or {}).get(objective), '.4g')} (not confirmed)")
    print(f"wrote {path}: trial {data['trial']}{' [' + data['baseline'] + ']' if data['baseline'] else ''} of "
          f"{data['study']} ({'meets the SLO' if m['feasible'] else 'does not meet the SLO'}; {figure})")
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
    print(table(rows, ["study", "workload", "objective", "trials", "best", "best_feasible", "created_at"]))
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


def model_widths(model: str) -> tuple[int, ...]:
    """The hidden size and expert width of ``model`` from its config alone (empty if it cannot be read:
    loading the model says why)."""
    from engine.backend_sim import resolve_sim_model

    try:
        spec = resolve_sim_model(model)[0]
    except Exception:  # noqa: BLE001 - the model's own load reports the problem with its file and field
        return ()
    return (spec.hidden_size, spec.expert_intermediate)


def fit_int4_group(base: EngineConfig, widths: tuple[int, ...]) -> EngineConfig:
    """``base`` with an int4 group size that divides the model's widths, where its own does not. The group
    size is searched only with int4 resident experts; an int4 low-precision copy under other resident
    experts takes the base's, and the default (128) does not divide every model (expert width 320)."""
    from engine.precision import int4_groups_dividing

    if not widths or int4_groups_dividing(widths, (base.experts.int4_group_size,)):
        return base
    fits = int4_groups_dividing(widths)
    return base.replace(int4_group_size=max(fits)) if fits else base


def build_parser() -> argparse.ArgumentParser:
    from engine.cli import sim_args
    from tuner.slo import DEFAULT_ATTAINMENT, DEFAULT_SLO

    p = argparse.ArgumentParser(prog="tuner", description=(__doc__ or "").splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true", help="log what the tuner and Optuna do")
    sub = p.add_subparsers(dest="cmd", required=True)

    def db_arg(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--db", help="results database URL (default $MOETUNE_DB, else sqlite:///moetune.db)")

    r = sub.add_parser("run", help="run (or resume) a study, then confirm its gains")
    r.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint directory or builtin:<arch>-<preset>")
    r.add_argument("--workload", default=DEFAULT_WORKLOAD, help="workload path or builtin:<name>")
    sim_args(r)  # --backend live|sim, --profile, the synthetic routing of a simulated study
    r.add_argument("--slo", action="append", metavar="NAME=VALUE|FILE",
                   help="an SLO bound (repeat), e.g. ttft_p99_ms=2000, tpot_p99_ms=200, quality_min=0.95, "
                        "attainment_min=0.9; or a JSON file of them (default "
                        + ", ".join(f"{k}={v:g}" for k, v in DEFAULT_SLO.items()) + ")")
    r.add_argument("--attainment", type=float,
                   help="share of requests that must meet every latency bound at the capacity "
                        f"(default {DEFAULT_ATTAINMENT:g})")
    r.add_argument("--objective", help="what to maximise or minimise: capacity (default, realtime), "
                                       "output_tokens_per_s (default offline), goodput, ...")
    r.add_argument("--objectives", help="several, comma-separated, for a Pareto search "
                                        "(e.g. output_tokens_per_s,tpot_p99_ms)")
    r.add_argument("--trials", type=int, default=DEFAULT_TRIALS,
                   help=f"finished trials the study should hold, baselines included (default {DEFAULT_TRIALS})")
    r.add_argument("--timeout", help="stop starting trials after this long: 8h, 90m, 1h30m, 3600")
    r.add_argument("--study", help="study name (default <model>.<workload>); the space hash is appended")
    db_arg(r)
    r.add_argument("--mode", choices=["realtime", "offline"], default="realtime",
                   help="realtime replays arrival times; offline sends every request at once")
    r.add_argument("--rate-scale", type=float, default=1.0,
                   help="divide arrival times by this (capacity: the first rate probed)")
    r.add_argument("--max-requests", type=int, help="replay only the first N requests")
    r.add_argument("--fidelity", default=DEFAULT_FIDELITY,
                   help="shares of the workload a searched trial is measured on, in turn; the pruner stops "
                        f"uncompetitive ones early (default {DEFAULT_FIDELITY})")
    r.add_argument("--noise-repeats", type=int, default=DEFAULT_NOISE_REPEATS,
                   help="runs of the default config that measure the noise, interleaved with the first baselines "
                        f"(default {DEFAULT_NOISE_REPEATS})")
    r.add_argument("--confirm-top", type=int, default=DEFAULT_RUN_CONFIRM_TOP,
                   help=f"searched configs re-run with every baseline at the end (default {DEFAULT_RUN_CONFIRM_TOP}; "
                        "`tuner confirm` re-runs more on demand)")
    r.add_argument("--confirm-repeats", type=int, default=DEFAULT_CONFIRM_REPEATS,
                   help=f"interleaved runs of each of them (default {DEFAULT_CONFIRM_REPEATS}; 0: no confirmation)")
    r.add_argument("--config", help="base engine config (JSON or a `tuner export` file) for the knobs not searched")
    r.add_argument("--fix", action="append", metavar="KNOB=VALUE", help="pin a knob (repeat); not searched")
    r.add_argument("--seed", type=int, default=0, help="sampler seed")
    r.add_argument("--heartbeat-s", type=int, default=10,
                   help="trial heartbeat; a trial silent for 3 beats is retried (default 10)")
    r.add_argument("--memory-gib", type=float, help="memory a config may use (default: what is free)")
    r.add_argument("--no-prune", action="store_true",
                   help="measure every trial on the whole workload, never stop one early")
    r.add_argument("--no-quality", action="store_true",
                   help="skip measuring output quality against the full-precision reference")
    r.add_argument("--quiet", action="store_true", help="no progress bar and no per-trial lines")
    r.add_argument("--json", action="store_true", help="end with one JSON object on the last line")
    r.set_defaults(fn=cmd_run)

    c = sub.add_parser("confirm", help="re-run the top configs and every baseline, interleaved, with intervals")
    c.add_argument("--study", required=True)
    c.add_argument("--top", type=int, default=DEFAULT_CONFIRM_TOP,
                   help=f"searched configs to confirm (default {DEFAULT_CONFIRM_TOP})")
    c.add_argument("--repeats", type=int, default=DEFAULT_CONFIRM_REPEATS,
                   help=f"interleaved runs of each (default {DEFAULT_CONFIRM_REPEATS}; 5 or more: bootstrap intervals)")
    c.add_argument("--json", action="store_true")
    db_arg(c)
    c.set_defaults(fn=cmd_confirm)

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

    _validate_parser(sub, db_arg)

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
    import optuna

    optuna.logging.set_verbosity(optuna.logging.INFO if args.verbose else optuna.logging.ERROR)
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
