"""``engine bench-serve``: the cost of HTTP, measured.

The same workload and config, replayed two ways in interleaved rounds (served first in even rounds,
in process first in odd ones, so drift on a shared machine falls on both):

- served: ``engine serve`` in its own process, ``workloads replay`` (this process) streaming from it;
- in process: ``engine run``'s ``run_workload`` on an engine loaded here, on a worker thread as the
  server's engine loop runs (``inprocess_thread="worker"``), or on the main thread as ``engine run``
  itself does (``"main"``). The two differ for a reason that is not HTTP: on an oversubscribed CPU
  libgomp's spin-waiting (``OMP_WAIT_POLICY`` active) slowed main-thread steps about 10x here
  (README, Serve), so the default compares like with like.

Both measure with ``engine.results`` (the replay's request timelines are client-side). The client runs
on its own thread at ``client_nice`` (default 10) above the server's priority: a client on another
machine would take none of the server's CPU, and on a small shared CPU it otherwise would. The overhead is
the served median-of-rounds p50 TPOT over the in-process one, and the difference of p50 TTFTs, each with
an interval over the rounds (``tuner.stats``: min-max under 5 rounds, a bootstrap from 5), so a figure
within the round-to-round spread reads as such. ``warmup_rounds`` whole rounds of each (default 1) run
first and are not counted: the first minute of a fresh process is slower on both sides (allocator,
kernel caches, CPU frequency), which a two-request warm-up did not cover.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: The targets of issue 15 for the small model: served p50 TPOT within 5 % of in-process, p50 TTFT within 20 ms.
TPOT_TARGET_PCT = 5.0
TTFT_TARGET_MS = 20.0
_START_TIMEOUT_S = 300.0
METRICS = ("ttft_p50_ms", "tpot_p50_ms", "itl_p50_ms", "e2e_p50_ms", "ttft_p99_ms", "tpot_p99_ms",
           "output_tokens_per_s")


def start_server(model: str, config_path: str, extra: list[str] | None = None) -> tuple[subprocess.Popen, str]:
    """``engine serve`` on a free port of 127.0.0.1 in a child process; returns it and its API base URL."""
    cmd = [sys.executable, "-m", "engine.cli", "serve", "--model", model, "--config", config_path, "--port", "0",
           "--log-level", "warning", *(extra or [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True, env={**os.environ})
    assert proc.stdout is not None
    deadline = time.monotonic() + _START_TIMEOUT_S
    url = None
    while url is None:
        line = proc.stdout.readline()
        if not line:
            proc.wait(10)
            raise RuntimeError(f"engine serve exited with status {proc.returncode} before listening")
        if "http://" in line:
            url = line[line.index("http://"):].split()[0].rstrip(";")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("engine serve did not start listening in time")
    while True:
        try:
            with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=5) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("engine serve does not answer /health") from None
            time.sleep(0.2)


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def _row(how: str, rnd: int, summary: dict[str, Any]) -> dict[str, Any]:
    return {"how": how, "round": rnd, **{k: summary.get(k) for k in METRICS},
            "requests_done": summary["requests_done"], "prompt_tokens": summary["prompt_tokens"],
            "output_tokens": summary["output_tokens"]}


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def _diff_interval(a: list[float | None], b: list[float | None]) -> list[Any] | None:
    """``[lo, hi, method]`` of ``median(a) - median(b)`` (:func:`tuner.stats.difference_interval`)."""
    from tuner.stats import difference_interval

    d = difference_interval(a, b)
    return None if d is None else [d.lo, d.hi, d.method]


def _on_worker_thread(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on a fresh thread (as the server's engine loop runs), re-raising its error."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as e:  # handed back to the caller below
            out["error"] = e

    t = threading.Thread(target=run, name="moetune-bench-inprocess")
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def _niced(nice: int, fn, *args, **kwargs):
    from engine.serve.app import lower_this_thread

    lower_this_thread(nice)
    return fn(*args, **kwargs)


def run_bench_serve(model: str, config, workload_spec: str, *, mode: str = "realtime", rate_scale: float = 1.0,
                    max_requests: int | None = None, repeats: int = 3, warmup_rounds: int = 1,
                    inprocess_thread: str = "worker", client_nice: int = 10,
                    server_args: list[str] | None = None) -> dict[str, Any]:
    """Interleaved rounds of (served, in process) on ``workload_spec``; rows, medians and overheads."""
    from engine.runner import run_workload
    from engine.runtime import Engine
    from tuner.stats import gain_interval
    from workloads.replay import ReplayOptions, replay
    from workloads.schema import load_workload

    if repeats < 1:
        raise ValueError(f"--repeats {repeats}: must be at least 1")
    if warmup_rounds < 0:
        raise ValueError(f"--warmup-rounds {warmup_rounds}: must be 0 or more")
    workload = load_workload(workload_spec)
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path = str(Path(tmp) / "config.json")
        Path(cfg_path).write_text(json.dumps(config.to_dict()))
        proc, url = start_server(model, cfg_path, server_args)
        try:
            engine = Engine(model, config)
            options = ReplayOptions(mode=mode, rate_scale=rate_scale, max_requests=max_requests)  # type: ignore[arg-type]
            # One short warm-up each (first steps allocate), not counted.
            replay(url, workload, options=ReplayOptions(mode="offline", max_requests=2))
            run_workload(engine, workload, mode="offline", max_requests=2)
            rows = []
            for rnd in range(-warmup_rounds, repeats):
                order = ("served", "inprocess") if rnd % 2 == 0 else ("inprocess", "served")
                for how in order:
                    if how == "served":
                        res = _on_worker_thread(_niced, client_nice, replay, url, workload, options=options)
                    else:
                        run = _on_worker_thread if inprocess_thread == "worker" else (lambda f, *a, **k: f(*a, **k))
                        res = run(run_workload, engine, workload, mode=mode, rate_scale=rate_scale,
                                  max_requests=max_requests)
                    row = _row(how, rnd, res.summary())
                    log.info("round %d %s%s: %s", rnd, how, " (warm-up)" if rnd < 0 else "", row)
                    if rnd >= 0:
                        rows.append(row)
        finally:
            stop_server(proc)
    served = [r for r in rows if r["how"] == "served"]
    inproc = [r for r in rows if r["how"] == "inprocess"]
    med = {how: {k: _median(rs, k) for k in METRICS} for how, rs in (("served", served), ("inprocess", inproc))}
    s_tpot, i_tpot = med["served"]["tpot_p50_ms"], med["inprocess"]["tpot_p50_ms"]
    s_ttft, i_ttft = med["served"]["ttft_p50_ms"], med["inprocess"]["ttft_p50_ms"]
    tpot_pct = (s_tpot / i_tpot - 1) * 100 if s_tpot and i_tpot else None
    ttft_ms = s_ttft - i_ttft if s_ttft is not None and i_ttft is not None else None
    tpot_ratio = gain_interval([r["tpot_p50_ms"] for r in served], [r["tpot_p50_ms"] for r in inproc])
    ttft_diff = _diff_interval([r["ttft_p50_ms"] for r in served], [r["ttft_p50_ms"] for r in inproc])
    same_tokens = all((a["requests_done"], a["prompt_tokens"], a["output_tokens"])
                      == (b["requests_done"], b["prompt_tokens"], b["output_tokens"]) for a, b in zip(served, inproc, strict=True))
    from engine.hwinfo import hardware

    return {"model": model, "config_hash": config.config_hash(), "workload": workload.name, "mode": mode,
            "inprocess_thread": inprocess_thread, "client_nice": client_nice, "server_args": server_args or [],
            "rate_scale": rate_scale, "max_requests": max_requests, "repeats": repeats,
            "warmup_rounds": warmup_rounds, "rows": rows,
            "median": med, "tpot_p50_overhead_pct": tpot_pct, "ttft_p50_overhead_ms": ttft_ms,
            "tpot_p50_overhead_pct_interval": None if tpot_ratio is None else
            [(tpot_ratio.lo - 1) * 100, (tpot_ratio.hi - 1) * 100, tpot_ratio.method],
            "ttft_p50_overhead_ms_interval": ttft_diff,
            "targets": {"tpot_p50_overhead_pct": TPOT_TARGET_PCT, "ttft_p50_overhead_ms": TTFT_TARGET_MS},
            "met": {"tpot": tpot_pct is not None and tpot_pct <= TPOT_TARGET_PCT,
                    "ttft": ttft_ms is not None and ttft_ms <= TTFT_TARGET_MS},
            "same_requests_and_tokens": same_tokens, "hardware": hardware()}


def format_bench(res: dict[str, Any]) -> str:
    from engine.cli import _table

    head = (f"model {res['model']} config {res['config_hash']}; workload {res['workload']} ({res['mode']}, "
            f"x{res['rate_scale']:g}, {res['max_requests'] or 'all'} requests); {res['repeats']} interleaved rounds; "
            f"in process on the {res['inprocess_thread']} thread")
    fmt = {k: ".1f" for k in METRICS}
    table = _table(res["rows"], ["how", "round", *METRICS, "output_tokens"], fmt)
    med = [{"how": how, **vals} for how, vals in res["median"].items()]
    tpot, ttft = res["tpot_p50_overhead_pct"], res["ttft_p50_overhead_ms"]
    tail = "overhead: not measured"
    if tpot is not None and ttft is not None:
        ti, di = res.get("tpot_p50_overhead_pct_interval"), res.get("ttft_p50_overhead_ms_interval")
        t_iv = f" ({ti[0]:+.1f} to {ti[1]:+.1f} %, {ti[2]})" if ti else ""
        d_iv = f" ({di[0]:+.1f} to {di[1]:+.1f} ms, {di[2]})" if di else ""
        tail = (f"HTTP overhead (medians of rounds): p50 TPOT {tpot:+.1f} %{t_iv} (target <= {TPOT_TARGET_PCT:g} %), "
                f"p50 TTFT {ttft:+.1f} ms{d_iv} (target <= {TTFT_TARGET_MS:g} ms); same requests and token "
                f"counts: {res['same_requests_and_tokens']}")
    return "\n".join([head, table, "medians:", _table(med, ["how", *METRICS], fmt), tail])
