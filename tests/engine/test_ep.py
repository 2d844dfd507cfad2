"""Expert parallelism on real processes: 2 CPU ranks on gloo against one process, and dead ranks.

Every case spawns its ranks (torch.multiprocessing, spawn) and runs real collectives over loopback.
The oracle is the same engine in one process: logits within 1e-4 of the logit scale (the ranks'
partial sums are added in another order) and the same greedy tokens.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import torch

from engine.config import ConfigError, EngineConfig
from engine.model.decoder import KVCache
from engine.parallel import EPError
from engine.runner import record_router_trace, run_workload
from engine.runtime import Engine
from workloads import Request, Workload
from workloads.schema import save_workload

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]


@pytest.fixture
def drive(open_engine):
    """``drive(engine)``: the conftest's step driver on ``engine``'s model (every rank follows its steps)."""

    def run(engine: Engine):
        drv = open_engine(engine.model_path)
        drv.decoder, drv.cache = engine.model, KVCache(engine.spec, 4, 64, engine.dtype, engine.device)
        return _steps(drv)

    return run


def _steps(drv):
    """Prefill two prompts in chunks, mix a prompt chunk with a decode, then decode both a few steps."""
    a, b = drv.random_prompt(7, seed=1), drv.random_prompt(9, seed=2)
    drv.admit("a", 0)
    drv.admit("b", 2)
    drv.step([("a", a), ("b", b[:4], False)])
    drv.step([("a", [drv.next_token("a")]), ("b", b[4:])])
    for _ in range(3):
        drv.decode(["b", "a"])
    drv.decode(["a"])  # one token alone
    return drv


def assert_same_logits(ep, one) -> None:
    scale = max(r.abs().max().item() for rows in one.logits.values() for r in rows.values())
    for seq, rows in one.logits.items():
        assert rows.keys() == ep.logits[seq].keys()
        for pos, row in rows.items():
            err = (ep.logits[seq][pos] - row).abs().max().item()
            assert err <= 1e-4 * scale, (seq, pos, err, scale)
    assert ep.history == one.history  # greedy tokens along the way


PROMPTS = [[5, 9, 13, 2, 8, 21], [3, 4], [17, 11, 19, 23, 29, 31, 37, 41, 43]]


@pytest.fixture(scope="module")
def one_process():
    """Plain engines by (checkpoint, config), reused across cases."""
    made: dict[tuple, Engine] = {}

    def get(path, **knobs) -> Engine:
        key = (str(path), tuple(sorted(knobs.items())))
        if key not in made:
            made[key] = Engine(path, EngineConfig().replace(**knobs))
        return made[key]

    return get


@pytest.mark.parametrize("arch", FAMILIES)
def test_two_ranks_match_one_process(arch, make_ckpt, one_process, drive):
    path = make_ckpt(arch, experts=8, top_k=2)
    ep = Engine(path, EngineConfig().replace(ep_size=2))
    try:
        assert [len(w) for w in ep.model.ep.w13] == [4] * len(ep.spec.moe_layers)  # half the experts here
        assert ep.model.layers[ep.spec.moe_layers[0]].w13 is None
        assert_same_logits(drive(ep), drive(one_process(path)))
        assert ep.generate(PROMPTS, 6) == one_process(path).generate(PROMPTS, 6)
    finally:
        ep.close()


CASES = {
    "hotness-chunks": dict(ep_placement="hotness", ep_combine_chunks=3),
    "eplb-replicas": dict(ep_placement="eplb", redundant_experts=5, ep_combine_chunks=2),
    "pruned-routes": dict(ep_placement="hotness", top_k_override=1, min_gate_weight=0.3),
}


@pytest.mark.parametrize("case", CASES)
def test_placements_overlap_and_pruned_routes_match_one_process(case, make_ckpt, one_process, drive):
    knobs = CASES[case]
    path = make_ckpt("qwen2_moe", experts=8, top_k=3)  # with a shared expert
    routing = {k: v for k, v in knobs.items() if k in ("top_k_override", "min_gate_weight")}
    ep = Engine(path, EngineConfig().replace(ep_size=2, **knobs))
    try:
        ep.warm_up_hotness()
        if knobs.get("redundant_experts"):
            assert sum(len(r) for r in ep.model.ep.placement.copies[0]) == 8 + 5
        assert_same_logits(drive(ep), drive(one_process(path, **routing)))
        assert ep.generate(PROMPTS, 5) == one_process(path, **routing).generate(PROMPTS, 5)
    finally:
        ep.close()


def test_native_kernels_on_bf16_weights_match_one_process(make_ckpt, one_process, drive):
    """bf16 weights read by the native CPU kernels (one fused call for a rank's experts, the other
    rank's pairs skipped), against the same kernels in one process."""
    path = make_ckpt("qwen3_moe", dtype="bfloat16", experts=8, top_k=2)
    ep = Engine(path, EngineConfig().replace(ep_size=2, compute_dtype="float32"))
    try:
        assert ep.model.native, ep.kernels_label
        assert_same_logits(drive(ep), drive(one_process(path, compute_dtype="float32")))
    finally:
        ep.close()


def small_workload(n: int = 12) -> Workload:
    rng = np.random.default_rng(7)
    return Workload("ep", [Request(f"r{i}", 0.0, int(rng.integers(4, 16)), int(rng.integers(3, 8)))
                           for i in range(n)], {"source": "test"})


def test_hotness_placement_cuts_the_recorded_imbalance_on_a_skewed_trace(make_ckpt):
    """A run's router trace places the experts: the run records per-rank tokens, per-layer max/mean
    imbalance and combine bytes per step, and placement by hotness beats contiguous blocks."""
    path = make_ckpt("qwen3_moe", seed=3, experts=16, top_k=2, router_skew=3.0)
    wl = small_workload()
    wl = wl.with_router_trace(record_router_trace(str(path), wl))
    figures = {}
    for placement in ("contiguous", "hotness", "eplb"):
        knobs = dict(ep_size=2, ep_placement=placement)
        if placement == "eplb":
            knobs["redundant_experts"] = 2
        eng = Engine(path, EngineConfig().replace(**knobs))
        try:
            res = run_workload(eng, wl, mode="offline")
        finally:
            eng.close()
        ep = res.meta["ep"]
        assert ep["ranks"] == 2 and ep["placement"]["policy"] == placement
        routed = sum(s.tokens for s in res.expert_stats)
        assert sum(ep["tokens_per_rank"]) == routed  # every routed pair computed on exactly one rank
        assert len(ep["steps"]) == len(res.steps)
        hidden, layers = eng.spec.hidden_size, len(eng.spec.moe_layers)
        for step, rec in zip(res.steps, ep["steps"], strict=True):  # 2 (N-1)/N of [T, H] fp32 per layer
            assert rec["bytes_combined"] == layers * (step.prefill_tokens + step.decode_tokens) * hidden * 4
            assert rec["bytes_dispatched"] == 0
            # ...and each step record carries its own figures (an mt_steps row)
            assert (step.ep_bytes_combined, step.ep_bytes_dispatched) == (rec["bytes_combined"], 0)
            assert step.ep_imbalance == pytest.approx(rec["imbalance"])
        summary = res.summary()
        assert (summary["ep_ranks"], summary["ep_imbalance_mean"]) == (2, ep["imbalance_mean"])
        figures[placement] = ep["imbalance_mean"]
    assert figures["contiguous"] > 1.3, figures
    assert figures["hotness"] < figures["contiguous"] - 0.2, figures
    assert figures["eplb"] < figures["contiguous"] - 0.2, figures


def test_configs_expert_parallelism_cannot_run_are_refused_naming_the_knob(make_ckpt):
    with pytest.raises(ConfigError, match=r"parallel.ep_size=2 with experts.residency='static'"):
        EngineConfig().replace(ep_size=2, residency="static")
    with pytest.raises(ConfigError, match=r"redundant_experts=2 needs parallel.ep_placement='eplb'"):
        EngineConfig().replace(ep_size=2, redundant_experts=2)
    path = make_ckpt("mixtral", experts=4, top_k=2)
    with pytest.raises(ConfigError, match="ep_size=8 exceeds the model's 4 experts"):
        Engine(path, EngineConfig().replace(ep_size=8))
    with pytest.raises(ConfigError, match=r"redundant_experts=5 exceeds n_experts \* \(ep_size - 1\) = 4"):
        Engine(path, EngineConfig().replace(ep_size=2, ep_placement="eplb", redundant_experts=5))
    EngineConfig().replace(ep_size=2, top_k_override=1)  # routing knobs run with expert parallelism


def test_a_killed_rank_fails_the_next_step_at_once_naming_it(make_ckpt):
    path = make_ckpt("qwen3_moe", experts=8, top_k=2)
    eng = Engine(path, EngineConfig().replace(ep_size=2, ep_timeout_s=60))
    try:
        (pid,) = eng.ep_driver.pids
        os.kill(pid, signal.SIGKILL)
        t = time.monotonic()
        with pytest.raises(EPError, match=rf"rank 1 \(pid {pid}\) was killed by SIGKILL"):
            eng.generate([[1, 2, 3]], 4)
        assert time.monotonic() - t < 10  # not the 60 s timeout
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        with pytest.raises(EPError, match="rank 1"):  # the engine stays failed, it does not hang
            eng.generate([[1, 2, 3]], 4)
    finally:
        eng.close()
    again = Engine(path, EngineConfig().replace(ep_size=2))  # the process group was released
    again.close()


def _workers_of(proc: subprocess.Popen, n: int, timeout_s: float = 60) -> list[psutil.Process]:
    """The expert-parallel ranks a command spawned (multiprocessing's spawn children, not its trackers)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        kids = [c for c in psutil.Process(proc.pid).children()
                if "spawn_main" in " ".join(c.cmdline()) and "resource_tracker" not in " ".join(c.cmdline())]
        if len(kids) == n:
            return kids
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    raise AssertionError("the ranks did not start")


def _wait_for_group(proc: subprocess.Popen, worker: psutil.Process, timeout_s: float = 60) -> None:
    """Until the rank has joined the process groups: its store connection plus one per gloo group."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sum(c.status == psutil.CONN_ESTABLISHED for c in worker.net_connections("tcp")) >= 3:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    raise AssertionError("the rank did not join the process group")


def test_a_rank_that_dies_while_starting_is_named_at_once(make_ckpt, tmp_path):
    """Killed before the rendezvous (while it imports and loads), not held for parallel.ep_timeout_s."""
    path = make_ckpt("qwen3_moe", experts=8, top_k=2)
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "generate", "--model", str(path), "--prompt-ids",
                             "5,6,7", "--max-new-tokens", "4", "--ep", "2", "--ep-timeout-s", "120"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    (worker,) = _workers_of(proc, 1)
    worker.kill()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, (out, err)
    assert err.strip().splitlines() == [f"engine: error: expert parallelism: rank 1 (pid {worker.pid}) was killed by "
                                        "SIGKILL (starting the ranks); the other ranks were stopped"], err


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.getcwd()}


def test_engine_run_whose_rank_dies_exits_with_one_line(make_ckpt, tmp_path):
    path = make_ckpt("qwen3_moe", experts=8, top_k=2)
    wl = tmp_path / "wl"
    save_workload(small_workload(2000), wl)
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "run", "--model", str(path), "--workload", str(wl),
                             "--mode", "offline", "--ep", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env())
    (worker,) = _workers_of(proc, 1)
    _wait_for_group(proc, worker)
    time.sleep(1.0)  # stepping
    assert proc.poll() is None
    worker.kill()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("engine: error: expert parallelism: rank 1") and "SIGKILL" in lines[0], lines


def test_ranks_exit_with_one_line_when_rank_0_dies(make_ckpt):
    path = make_ckpt("qwen3_moe", experts=8, top_k=2)
    code = ("import sys, time; from engine.runtime import Engine; from engine.config import EngineConfig; "
            f"e = Engine({str(path)!r}, EngineConfig().replace(ep_size=2)); e.generate([[1, 2, 3]], 2); "
            "print('ready', flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env())
    (worker,) = _workers_of(proc, 1)
    assert proc.stdout.readline().strip() == "ready"
    proc.kill()
    proc.wait()
    worker.wait(timeout=15)  # the rank's watchdog saw its parent go
    err = proc.stderr.read()  # EOF once the rank, which shares the pipe, has exited
    assert err.strip().splitlines() == [f"engine: rank 1: rank 0 (pid {proc.pid}) is gone; exiting"], err


def test_cli_ep_flag_runs_two_ranks_and_reports_them(make_ckpt):
    path = make_ckpt("olmoe", experts=8, top_k=2)
    out = subprocess.run([sys.executable, "-m", "engine.cli", "generate", "--model", str(path), "--prompt-ids",
                          "5,6,7", "--max-new-tokens", "4", "--json"], capture_output=True, text=True, check=True,
                         env=_env()).stdout.splitlines()
    out_ep = subprocess.run([sys.executable, "-m", "engine.cli", "generate", "--model", str(path), "--prompt-ids",
                             "5,6,7", "--max-new-tokens", "4", "--ep", "2", "--json"], capture_output=True, text=True,
                            check=True, env=_env()).stdout.splitlines()
    assert out_ep[0] == out[0]
    assert '"ep_ranks": 2' in out_ep[-1] and '"ep_ranks": 1' in out[-1]
    bad = subprocess.run([sys.executable, "-m", "engine.cli", "generate", "--model", str(path), "--prompt-ids", "5",
                          "--ep", "2", "--residency", "cache"], capture_output=True, text=True, env=_env())
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "parallel.ep_size=2" in bad.stderr


def test_torch_threads_are_restored_after_close(make_ckpt):
    before = torch.get_num_threads()
    eng = Engine(make_ckpt("mixtral", experts=4, top_k=2), EngineConfig().replace(ep_size=2))
    eng.close()
    assert torch.get_num_threads() == before


def test_the_sm_share_splits_a_gpu_between_expert_compute_and_the_combine():
    """``execution.expert_sm_share`` under expert parallelism: the experts' green context takes that share of
    the SMs and NCCL's CTAs are capped to the rest (at least one each); a share of 1 leaves NCCL alone. The
    config is accepted beside ep_size > 1 (other executor knobs are not), and the tuner searches it at any
    rank count on a multi-GPU machine."""
    from engine.moe.experts import expert_sms, sm_partition
    from engine.parallel.group import RankSetup, comm_ctas, group_options
    from tuner.space import build_space

    assert (expert_sms(0.75, 132), comm_ctas(0.75, 132)) == (99, 33)
    assert comm_ctas(1.0, 132) is None
    assert (expert_sms(0.01, 16), comm_ctas(0.01, 16)) == (1, 15)
    assert (expert_sms(0.999, 132), comm_ctas(0.999, 132)) == (131, 1)  # the combine keeps one SM
    cfg = EngineConfig().replace(ep_size=2, expert_sm_share=0.5)
    assert cfg.execution.expert_sm_share == 0.5
    with pytest.raises(ConfigError, match=r"ep_size=2 with execution.expert_batching='micro'"):
        EngineConfig().replace(ep_size=2, expert_batching="micro")
    # On the CPU there is no partition to make, and the process group takes no NCCL options.
    part = sm_partition(torch.device("cpu"), 0.5)
    assert part.stream is None and part.inert is None
    setup = RankSetup("m", cfg.to_dict(), "float32", "float32", "cpu", 2, 1)
    assert group_options(setup, 0) is None
    space = build_space({"gpu": {"count": 2, "names": ["H100", "H100"], "memory_bytes": [80 << 30] * 2}})
    share = space.param("execution.expert_sm_share")
    assert all(c.parent != "parallel.ep_size" for c in share.when)
    assert any(c.parent == "parallel.ep_size" for c in space.param("execution.expert_batching").when)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs CUDA (two GPUs)")
def test_two_gpu_ranks_on_an_sm_partition_match_one_process(make_ckpt, one_process, drive):
    path = make_ckpt("qwen3_moe", experts=8, top_k=2)
    knobs = dict(device="cuda", compute_dtype="float32", expert_sm_share=0.5)
    one = drive(one_process(path, **knobs))
    eng = Engine(path, EngineConfig().replace(ep_size=2, ep_combine_chunks=2, **knobs))
    try:
        assert_same_logits(drive(eng), one)
        sm = eng.model.ep.describe()["sm_partition"]
        assert sm["expert_sms"] + sm["comm_max_ctas"] == sm["sms"]
    finally:
        eng.close()
