"""Several tuner workers on one study: a shared trial budget, joining a study, reaping lost trials.

Workers share a study through Optuna's RDB storage on PostgreSQL. Three rules keep the study exact:

- **Budget.** ``--trials N`` counts the study's trials, not the worker's: under a PostgreSQL advisory
  lock on the study (:class:`StudyLock`) a worker counts the finished trials plus the running ones
  and, when there is room, creates its trial (``study.optimize`` with one trial) before the lock is
  released, so two workers never take the last slot together (Optuna's ``MaxTrialsCallback`` checks
  after a trial and overshoots by up to one trial per worker). Baselines are enqueued under the same
  lock, once per study.
- **Lost trials.** Trials send heartbeats (Optuna's ``heartbeat_interval``/``grace_period``); a trial
  whose worker was killed goes stale and is failed and retried once (``max_retry=1``) by whichever
  worker looks next. The worker that finds the budget spent while trials still run does not end: it
  waits until each has finished or missed its heartbeat for the grace period (saying so), fails the
  stale ones and runs their retries, so no trial stays ``RUNNING``.
- **One SQLite file, one worker.** SQLite's locking does not suit concurrent writers (Optuna's advice):
  a second worker on the same file is refused, pointing to PostgreSQL.

``tuner worker --db URL --study NAME`` joins a study with its own recorded launch (model, workload,
SLO, objectives, mode, base config and pinned knobs: :data:`ATTR_LAUNCH`), refusing a machine whose
model, hardware or search space differs.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import logging
import os
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from db.session import mask_url
from tuner.study import StudyError, counted_trials

log = logging.getLogger(__name__)

ATTR_LAUNCH = "moetune_launch"
"""Study user attribute: what ``tuner run`` was given, so ``tuner worker`` can join without repeating it."""

LAUNCH_ARGS = ("model", "workload", "slo", "attainment", "objective", "objectives", "mode", "rate_scale",
               "max_requests", "fidelity", "noise_repeats", "fix", "no_prune", "no_quality", "memory_gib", "trials",
               "timeout", "backend", "profile", "router_skew", "router_drift")
"""The ``tuner run`` arguments a study records for its workers (``--config`` travels as the config itself)."""

ATTR_WORKER = "worker"
"""Trial user attribute: ``host:pid`` of the worker process that ran it."""
WORKER_ID = f"{socket.gethostname()}:{os.getpid()}"

REAP_POLL_S = 1.0


# ------------------------------------------------------------------------------------- the lock


class StudyLock:
    """A PostgreSQL session advisory lock keyed by the study name (a no-op on SQLite, which allows one
    worker). Re-entrant use is not needed: ``acquire`` then ``release`` (idempotent)."""

    def __init__(self, url: str, study: str):
        self.url = url
        self.key = int.from_bytes(hashlib.sha256(f"moetune-study:{study}".encode()).digest()[:8], "big",
                                  signed=True)
        self._conn = None
        self._engine = None
        if url.startswith("postgresql"):
            from sqlalchemy import create_engine
            from sqlalchemy.pool import NullPool

            self._engine = create_engine(url, poolclass=NullPool)

    def acquire(self) -> None:
        if self._engine is None or self._conn is not None:
            return
        from sqlalchemy import text
        from sqlalchemy.exc import SQLAlchemyError

        from db.session import DatabaseError

        try:
            conn = self._engine.connect()
        except SQLAlchemyError as e:
            cause = " ".join(str(e).split())[:200]
            raise DatabaseError(f"cannot open database {mask_url(self.url)}: {cause}") from None
        conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": self.key})
        conn.commit()
        self._conn = conn

    def release(self) -> None:
        if self._conn is None:
            return
        from sqlalchemy import text

        conn, self._conn = self._conn, None
        try:
            conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": self.key})
            conn.commit()
        finally:
            conn.close()

    def __enter__(self) -> StudyLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def close(self) -> None:
        self.release()
        if self._engine is not None:
            self._engine.dispose()


# ------------------------------------------------------------------------------ one SQLite worker


_held: dict[str, Any] = {}  # path -> the lock file this process holds (until it exits)


def claim_sqlite(url: str) -> None:
    """Refuse a second worker process on one SQLite file (an advisory ``flock`` on ``<file>.worker-lock``,
    held until this process exits; a process that holds it may open the file again)."""
    import fcntl

    if not url.startswith("sqlite"):
        return
    from sqlalchemy.engine import make_url

    path = make_url(url).database
    if not path or path == ":memory:":
        return
    lock_path = Path(f"{path}.worker-lock")
    if not lock_path.parent.is_dir():  # opening the database will say so, naming the URL
        return
    if str(lock_path.resolve()) in _held:  # this process already is the file's worker
        return
    f = open(lock_path, "a+")  # noqa: SIM115 - held open for the life of the process
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        raise StudyError(f"{mask_url(url)}: another tuner worker (pid {holder}) is running on this SQLite file; "
                         "several workers on one study need PostgreSQL (--db postgresql://USER@HOST/DB, "
                         "see the README's Scale out)") from None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    _held[str(lock_path.resolve())] = f


# ------------------------------------------------------------------------------------- running


def _room(trials: list[FrozenTrial], n_trials: int) -> tuple[int, int, list[FrozenTrial]]:
    done = len(counted_trials(trials))
    running = [t for t in trials if t.state == TrialState.RUNNING]
    return n_trials - done - len(running), done, running


def _adopt_silent(study: optuna.Study, running: list[FrozenTrial], grace_s: float, adopted: set[int]) -> None:
    """A worker killed between creating its trial and its first heartbeat leaves a RUNNING trial with no
    heartbeat, which Optuna never finds stale: the study would wait for it for ever. Each running trial
    older than the grace period gets one heartbeat from here, once, so that it goes stale a grace period
    later unless its own worker is alive and keeps beating."""
    now = datetime.datetime.now()  # Optuna stores datetime_start as the local naive time
    for t in running:
        if t._trial_id in adopted or t.datetime_start is None:
            continue
        if (now - t.datetime_start).total_seconds() > grace_s:
            study._storage.record_heartbeat(t._trial_id)
            adopted.add(t._trial_id)


def run_budgeted(study: optuna.Study, objective: Callable[[optuna.Trial], Any], n_trials: int, lock: StudyLock,
                 timeout_s: float | None = None,
                 on_trial: Callable[[optuna.Study, FrozenTrial, int], None] | None = None,
                 say: Callable[[str], None] = print,
                 between: Callable[[optuna.Study, FrozenTrial], None] | None = None) -> int:
    """Run trials until the study holds ``n_trials`` counted trials (across every worker) and none is
    running, or ``timeout_s`` passes. Returns the number of trials this worker ran. ``between(study,
    trial)`` runs after each of this worker's trials (the noise repeats interleaved with the baselines).

    A crashing trial is recorded and the study goes on; Ctrl-C propagates (``KeyboardInterrupt``)."""
    from tuner.objective import TrialFailed

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    ran = 0
    waiting_said: tuple[int, ...] | None = None
    grace = getattr(study._storage, "grace_period", None)
    adopted: set[int] = set()

    def after(st: optuna.Study, frozen: FrozenTrial) -> None:
        if on_trial is not None:
            on_trial(st, frozen, len(counted_trials(st.get_trials(deepcopy=False))))
        if between is not None:
            between(st, frozen)

    def first_release(trial: optuna.Trial) -> Any:
        lock.release()  # the trial exists (RUNNING): other workers now count it
        trial.set_user_attr(ATTR_WORKER, WORKER_ID)
        return objective(trial)

    while True:
        if deadline is not None and time.monotonic() >= deadline:
            return ran
        lock.acquire()
        try:
            room, done, running = _room(study.get_trials(deepcopy=False), n_trials)
            if room > 0:
                # Optuna fails stale trials (and enqueues their retries) before it creates this one.
                study.optimize(first_release, n_trials=1, catch=(TrialFailed,), callbacks=[after],
                               gc_after_trial=False)
                ran += 1
                waiting_said = None
                continue
            if not running:
                return ran
            # The budget is spent but trials still run: wait for them, or for their heartbeats to go stale.
            numbers = tuple(t.number for t in running)
            if numbers != waiting_said:
                say(f"tuner: {done}/{n_trials} trials done; waiting for running trial(s) "
                    f"{', '.join(map(str, numbers))} to finish or miss their heartbeat for the grace period "
                    f"({grace or 0:g} s) before ending the study")
                waiting_said = numbers
            _adopt_silent(study, running, grace or 0, adopted)
            optuna.storages.fail_stale_trials(study)
        finally:
            lock.release()
        time.sleep(REAP_POLL_S)


# ------------------------------------------------------------------------------------- joining


def record_launch(study: optuna.Study, args: argparse.Namespace, base_config: dict[str, Any],
                  join: dict[str, Any]) -> None:
    """Store what this run was given (once per study) for ``tuner worker``."""
    if ATTR_LAUNCH in study.user_attrs:
        return
    launch = {k: getattr(args, k, None) for k in LAUNCH_ARGS}
    launch.update(study=args.study, config=base_config, **join)
    study.set_user_attr(ATTR_LAUNCH, launch)


def check_join(expect: dict[str, Any], *, name: str, model_fingerprint: str, hardware: dict[str, Any]) -> None:
    """A worker joining a study: its model, hardware and search space must be the study's; one line."""
    from db.store import stable_hash

    differ = []
    if model_fingerprint != expect["model_fingerprint"]:
        differ.append(f"model fingerprint {model_fingerprint} (study {expect['model_fingerprint']})")
    if stable_hash(hardware) != expect["hardware_hash"]:
        theirs = expect.get("hardware") or {}
        keys = [k for k in sorted(set(theirs) | set(hardware)) if theirs.get(k) != hardware.get(k)]
        differ.append("hardware " + ", ".join(f"{k}={hardware.get(k)!r} (study {theirs.get(k)!r})" for k in keys[:3]))
    if name != expect["name"]:
        differ.append(f"search space hash {name.rsplit('-', 1)[-1]} (study {expect['name'].rsplit('-', 1)[-1]})")
    if differ:
        raise StudyError(f"tuner worker: cannot join study {expect['name']!r}: this machine's " + "; ".join(differ))


def cmd_worker(args: argparse.Namespace) -> int:
    """``tuner worker``: join the study ``args.study`` with its recorded launch and run its trials."""
    from db.session import resolve_url
    from tuner.cli import cmd_run
    from tuner.study import open_storage

    url = resolve_url(args.db)
    storage = open_storage(url)
    found = [s for s in storage.get_all_studies() if s.study_name == args.study]
    if not found:
        names = sorted(s.study_name for s in storage.get_all_studies())
        raise StudyError(f"no study {args.study!r} in {mask_url(url)} (studies: {', '.join(names) or 'none'})")
    launch = found[0].user_attrs.get(ATTR_LAUNCH)
    if not launch:
        raise StudyError(f"study {args.study!r} records no launch (made by an older tuner run): join it with "
                         "`tuner run` and the same arguments")
    run_args = argparse.Namespace(**{k: launch.get(k) for k in LAUNCH_ARGS})
    run_args.trials = args.trials or launch["trials"]
    run_args.backend = run_args.backend or "live"  # a study launched before the simulator existed
    # Workers started together draw different points: a seed of their own unless one is given.
    seed = args.seed if args.seed is not None else os.getpid()
    run_args.study, run_args.db, run_args.seed = launch["study"], args.db, seed
    run_args.heartbeat_s, run_args.quiet, run_args.json = args.heartbeat_s, args.quiet, args.json
    run_args.join = launch
    # Confirmation re-runs the study's top configs after the search: the launching `tuner run` does it
    # (or `tuner confirm --study`), not every worker again.
    run_args.confirm_top, run_args.confirm_repeats = 0, 0
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(launch["config"], f)
    run_args.config = f.name
    try:
        return cmd_run(run_args)
    finally:
        os.unlink(f.name)
