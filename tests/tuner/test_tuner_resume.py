"""kill -9 in the middle of a study, then the same command again: nothing finished is lost, the trial
that was running is retried through Optuna's heartbeat, and the study ends at the requested size."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import time

import optuna
from optuna.trial import TrialState

from tuner.study import counted_trials

HEARTBEAT_S = 1
GRACE_S = 3 * HEARTBEAT_S  # tuner.study.GRACE_HEARTBEATS beats


def _our_trials(path) -> dict[int, tuple[str, float | None, str | None]]:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5) as con:
        try:
            rows = con.execute("SELECT number, state, goodput_rps, error FROM mt_trials").fetchall()
        except sqlite3.OperationalError:  # tables not created yet
            return {}
    return {n: (state, goodput, error) for n, state, goodput, error in rows}


def test_kill_9_loses_no_finished_trial_and_the_study_resumes(tmp_path, kit):
    path = tmp_path / "moetune.db"
    url = f"sqlite:///{path}"
    args = ["run", *kit.FAST, "--trials", "5", "--db", url, "--study", "kill", "--heartbeat-s", str(HEARTBEAT_S),
            "--quiet"]
    proc = subprocess.Popen([sys.executable, "-m", "tuner.cli", *args], cwd=tmp_path, env=kit.cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lost = None
    deadline = time.monotonic() + 180
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            rows = _our_trials(path) if path.exists() else {}
            done = [n for n, (state, _, _) in rows.items() if state != "running"]
            running = [n for n, (state, _, _) in rows.items() if state == "running"]
            if done and running:
                proc.send_signal(signal.SIGKILL)
                lost = running[0]
                break
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate(timeout=30)
    assert lost is not None, f"no trial was running after a finished one; tuner said: {err[-2000:]}"
    before = {n: row for n, row in _our_trials(path).items() if row[0] != "running"}
    name = next(n for n in optuna.get_all_study_names(url) if n.startswith("kill-"))
    values_before = {t.number: t.values for t in optuna.load_study(study_name=name, storage=url).trials
                     if t.state.is_finished()}
    assert before and lost not in before

    time.sleep(GRACE_S + 1.5)  # the lost trial's heartbeat is now stale
    again = kit.run_cli(args, tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]

    after = _our_trials(path)
    for n, row in before.items():
        assert after[n] == row  # finished trials untouched
    assert after[lost][0] == "failed" and "heartbeat" in after[lost][2]
    assert all(state != "running" for state, _, _ in after.values())
    trials = optuna.load_study(study_name=name, storage=url).trials
    by_number = {t.number: t for t in trials}
    for n, values in values_before.items():
        assert by_number[n].values == values
    assert by_number[lost].state == TrialState.FAIL
    retry = [t for t in trials if t.system_attrs.get("failed_trial") == lost]
    assert len(retry) == 1 and retry[0].params == by_number[lost].params and retry[0].state.is_finished()
    assert len(counted_trials(trials)) == 5
    assert [t.number for t in trials if t.state == TrialState.RUNNING] == []
