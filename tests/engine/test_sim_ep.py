"""The simulator prices expert parallelism: the live engine's placement, per-rank compute, the all-reduce
over the profile's interconnect, the same ``meta["ep"]`` record, per-rank memory, the tuner's space.

The live comparison runs 2 gloo ranks once (tests/engine/test_ep.py has the rest of the live side).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine.backend import make_backend
from engine.cli import main as engine_main
from engine.config import ConfigError, EngineConfig
from engine.moe.policy.placement import (
    CopyIndex,
    EPStats,
    assign_pairs,
    chunk_bounds,
    chunk_loads,
    place_experts,
    rank_loads,
)
from engine.runner import record_router_trace, run_workload
from engine.runtime import Engine
from engine.sim.profile import Interconnect, builtin_profile
from workloads import Request, Workload

NVLINK2 = "builtin:h100-sxm*2"


def _workload(n: int = 10, prompt: int = 40, out: int = 8, seed: int = 3) -> Workload:
    rng = np.random.default_rng(seed)
    return Workload("simep", [Request(f"r{i}", 0.0, int(rng.integers(prompt // 2, prompt)),
                                      int(rng.integers(out // 2, out))) for i in range(n)], {"source": "test"})


def _cfg(**knobs) -> EngineConfig:
    return EngineConfig().replace(max_batch_seqs=8, max_seq_len_tokens=512, **knobs)


def _run(profile, model: str = "shape:olmoe-1b-7b", wl: Workload | None = None, record_routes: bool = False,
         **knobs):
    b = make_backend(model, _cfg(**knobs), kind="sim", profile=profile)
    return run_workload(b, wl or _workload(), mode="offline", record_routes=record_routes)


def test_combine_bytes_and_tokens_per_rank_follow_the_routing():
    """2 ranks, contiguous blocks: each rank's pairs counted here from the recorded routes (expert e on
    rank e * N // E), bytes from the step's tokens (the live scheme: a ring all-reduce of [T, H] bf16
    per MoE layer, nothing dispatched because attention is replicated)."""
    res = _run(NVLINK2, record_routes=True, ep_size=2)
    ep, spec = res.meta["ep"], make_backend("shape:olmoe-1b-7b", _cfg(), kind="sim", profile=NVLINK2).spec
    n, e, layers, hidden = 2, spec.n_experts, len(spec.moe_layers), spec.hidden_size
    mine = np.zeros((layers, n), np.int64)
    for ids, _gates in res.meta["routes"].values():  # [tokens, L, K]
        for li in range(layers):
            x = ids[:, li][ids[:, li] >= 0].astype(np.int64)
            mine[li] += np.bincount(x * n // e, minlength=n)
    assert ep["tokens_per_rank_per_layer"] == mine.tolist()
    assert sum(ep["tokens_per_rank"]) == sum(s.tokens for s in res.expert_stats)
    assert len(ep["steps"]) == len(res.steps) and ep["placement"]["policy"] == "contiguous"
    for step, rec in zip(res.steps, ep["steps"], strict=True):
        t = step.prefill_tokens + step.decode_tokens
        assert rec["bytes_dispatched"] == 0
        assert rec["bytes_combined"] == layers * (2 * (n - 1) * t * hidden * 2 // n)
    assert ep["bytes_combined"] == sum(r["bytes_combined"] for r in ep["steps"]) > 0
    d = res.meta["ep_pricing"]
    assert d["priced"] is True and d["interconnect"]["kind"] == "nvlink" and res.meta["ep_ranks"] == 2


def test_ep_halves_the_expert_time_and_adds_the_combine():
    one, two = _run(NVLINK2), _run(NVLINK2, ep_size=2)
    b1, b2 = one.meta["sim"]["breakdown_s"], two.meta["sim"]["breakdown_s"]
    assert b2["dense_s"] == b1["dense_s"] and b2["attention_s"] == b1["attention_s"]  # replicated
    assert 0.45 * b1["experts_fast_s"] < b2["experts_fast_s"] < 0.8 * b1["experts_fast_s"]
    assert b1["ep_combine_s"] == 0.0 < b2["ep_combine_s"]
    assert two.duration_s < one.duration_s


@pytest.mark.parametrize("policy,redundant", [("contiguous", 0), ("hotness", 0), ("eplb", 5)])
def test_per_copy_shares_split_as_the_live_assignment(policy, redundant):
    """The simulator's vectorised split (all layers at once) equals rank_loads and, summed over the
    combine's chunks, the pairs assign_pairs gives each rank."""
    rng = np.random.default_rng(1)
    layers, e, k, t, n = 3, 16, 2, 37, 3
    p = 1.0 / np.arange(1, e + 1) ** 1.5
    ids = np.stack([np.stack([rng.choice(e, k, replace=False, p=p / p.sum()) for _ in range(t)])
                    for _ in range(layers)], axis=1)  # [T, L, K]
    ids[5, 1, 1] = -1  # a pruned slot
    counts = np.stack([np.bincount(ids[:, li][ids[:, li] >= 0], minlength=e) for li in range(layers)])
    pl = place_experts(policy, n, e, layers, counts / counts.sum(axis=1, keepdims=True), redundant)
    idx = CopyIndex.of(pl)
    loads = idx.by_rank(idx.shares(counts)).astype(np.int64)
    for chunks in (1, 4):
        bounds = chunk_bounds(t, chunks)
        c = chunk_loads(ids, pl, bounds)  # [C, L, N, E]
        assert c.shape == (chunks, layers, n, e) and c.sum(axis=(0, 3)).tolist() == loads.tolist()
        for li in range(layers):
            owner = assign_pairs(ids[:, li], pl, li)
            for ci, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
                keep = ids[a:b, li] >= 0
                want = np.zeros((n, e), np.int64)
                np.add.at(want, (owner[a:b][keep], ids[a:b, li][keep]), 1)
                assert c[ci, li].tolist() == want.tolist()
    stats, by_layer = EPStats(n, layers, 8, 2), EPStats(n, layers, 8, 2)
    stats.add_step(loads, t)
    for li in range(layers):
        by_layer.add_layer(li, loads[li], t)
    by_layer.end_step()
    assert stats.summary() == by_layer.summary()
    for li in range(layers):
        assert loads[li].tolist() == rank_loads(counts[li], pl, li).tolist()


def test_chunked_combine_records_the_same_pairs_and_prices_the_overlap():
    one, four = _run(NVLINK2, ep_size=2), _run(NVLINK2, ep_size=2, ep_combine_chunks=4)
    assert four.meta["ep"]["tokens_per_rank_per_layer"] == one.meta["ep"]["tokens_per_rank_per_layer"]
    assert four.meta["ep"]["combine_chunks"] == 4
    b1, b4 = one.meta["sim"]["breakdown_s"], four.meta["sim"]["breakdown_s"]
    assert b4["ep_combine_s"] < b1["ep_combine_s"]  # all but the last chunk's sums hide behind compute
    assert b4["experts_fast_s"] > b1["experts_fast_s"]  # each chunk reads its experts' weights again


def test_nvlink_steps_are_faster_than_pcie_when_communication_matters():
    nvlink = builtin_profile("h100-sxm*2")
    pcie = dataclasses.replace(nvlink, name="h100-sxm*2-over-pcie",
                               interconnect=Interconnect("pcie-host", 25e9, 1.5e-5))
    wl = _workload(n=8, prompt=200, out=4)  # prefill-heavy: big all-reduces
    fast, slow = _run(nvlink, wl=wl, ep_size=2), _run(pcie, wl=wl, ep_size=2)
    assert [s.prefill_tokens for s in fast.steps] == [s.prefill_tokens for s in slow.steps]
    assert all(a.duration_ms < b.duration_ms for a, b in zip(fast.steps, slow.steps, strict=True))
    assert slow.meta["sim"]["breakdown_s"]["ep_combine_s"] > 5 * fast.meta["sim"]["breakdown_s"]["ep_combine_s"]
    # The built-in pairs: consumer cards cross host memory, SXM boards NVLink.
    for name, kind in (("rtx4090*2", "pcie-host"), ("rtx5090*2", "pcie-host"), ("h100-sxm*2", "nvlink"),
                       ("h200*2", "nvlink")):
        p = builtin_profile(name)
        assert p.devices == 2 and p.interconnect is not None and p.interconnect.kind == kind
        assert p.calibrated is False


def test_more_ranks_than_devices_is_refused_in_one_line(capsys):
    with pytest.raises(ConfigError) as err:
        make_backend("shape:olmoe-1b-7b", _cfg(ep_size=2), kind="sim", profile="builtin:h100-sxm")
    msg = str(err.value)
    assert "\n" not in msg and "parallel.ep_size=2" in msg and "devices=1" in msg
    rc = engine_main(["run", "--backend", "sim", "--profile", "builtin:h100-sxm*2", "--model", "shape:olmoe-1b-7b",
                      "--workload", "builtin:quick", "--mode", "offline", "--ep", "4"])
    line = capsys.readouterr().err.strip()
    assert rc != 0 and "\n" not in line and "parallel.ep_size=4" in line and "devices=2" in line


def test_each_device_holds_only_its_ranks_experts():
    """Mixtral-8x7B in bf16 (~93 GB) does not fit one H100; split over two it does."""
    with pytest.raises(ConfigError, match=r"GiB on NVIDIA H100 SXM"):
        make_backend("shape:mixtral-8x7b", _cfg(), kind="sim", profile="builtin:h100-sxm*2")
    b = make_backend("shape:mixtral-8x7b", _cfg(ep_size=2), kind="sim", profile="builtin:h100-sxm*2")
    assert b.config.parallel.ep_size == 2
    with pytest.raises(ConfigError, match=r"on each of 2 NVIDIA GeForce RTX 4090"):
        make_backend("shape:mixtral-8x7b", _cfg(ep_size=2), kind="sim", profile="builtin:rtx4090*2")


# Step times of the fixed workload before expert parallelism was priced (main at 01f9b62), as float.hex.
BEFORE = {(): (16, "0x1.d43fd170aa19ap+6", "0x1.af1125c231685p+3"),
          (("missing_expert", "host"), ("resident_budget_gib", 1.0), ("residency", "static")):
              (16, "0x1.1efbabfad4217p+9", "0x1.40535bc76be1cp+6")}


@pytest.mark.parametrize("knobs", list(BEFORE))
def test_one_rank_prices_bit_for_bit_as_before(knobs):
    rng = np.random.default_rng(3)
    wl = Workload("g", [Request(f"r{i}", 0.05 * i, int(rng.integers(20, 40)), int(rng.integers(6, 12)))
                        for i in range(12)], {"source": "test"})
    for profile in ("builtin:h100-sxm", NVLINK2):  # a second device idles at ep_size 1
        res = _run(profile, wl=wl, **dict(knobs))
        d = [s.duration_ms for s in res.steps]
        assert (len(d), float.hex(float(sum(d))), float.hex(float(max(d)))) == BEFORE[knobs], profile
        assert "ep" not in res.meta and res.meta["ep_pricing"] is None


def test_the_tuner_searches_ranks_up_to_the_profiles_devices():
    from tuner.space import build_space

    assert list(build_space(builtin_profile("h100-sxm*2").hardware()).param("parallel.ep_size").choices) == [1, 2]
    assert list(build_space(builtin_profile("h200*8").hardware()).param("parallel.ep_size").choices) == [1, 2, 4, 8]
    assert "parallel.ep_size" in build_space(builtin_profile("h100-sxm").hardware()).omitted


def test_sim_and_live_ranks_count_the_same_pairs_and_hotness_beats_contiguous(make_ckpt):
    """One router trace of a skewed tiny model: the simulator's record of every placement matches
    the live engine's 2 gloo ranks (hotness placement, run once), and hotness cuts the imbalance."""
    path = make_ckpt("qwen3_moe", seed=3, experts=16, top_k=2, router_skew=3.0)
    wl = _workload(n=8, prompt=16, out=6, seed=7)
    wl = wl.with_router_trace(record_router_trace(str(path), wl))
    knobs = dict(ignore_eos=True, max_batch_seqs=8, max_seq_len_tokens=512)
    sims = {}
    for policy in ("contiguous", "hotness"):
        b = make_backend(str(path), EngineConfig().replace(ep_size=2, ep_placement=policy, **knobs), kind="sim",
                         profile=NVLINK2)
        sims[policy] = run_workload(b, wl, mode="offline").meta["ep"]
    assert sims["hotness"]["imbalance_mean"] < sims["contiguous"]["imbalance_mean"] - 0.1, sims
    eng = Engine(path, EngineConfig().replace(ep_size=2, ep_placement="hotness", **knobs))
    try:
        live = run_workload(eng, wl, mode="offline").meta["ep"]
    finally:
        eng.close()
    sim = sims["hotness"]
    assert sim["placement"] == live["placement"]
    for key in ("tokens_per_rank", "tokens_per_rank_per_layer", "bytes_dispatched", "bytes_combined"):
        assert sim[key] == live[key], key
    assert sim["imbalance_mean"] == pytest.approx(live["imbalance_mean"], rel=1e-12)
    assert [s["tokens_per_rank"] for s in sim["steps"]] == [s["tokens_per_rank"] for s in live["steps"]]
    assert set(sim) == set(live)


def test_ep_figures_land_in_the_result_tables(tmp_path):
    """A run's expert-parallel figures are columns of ``mt_trials`` (ranks, imbalance, bytes per step) and
    of each ``mt_steps`` row, equal to its ``meta["ep"]``; a one-rank run leaves them NULL."""
    from sqlalchemy import select

    from db.models import StepRow, Trial
    from db.session import make_engine, session_scope, upgrade
    from db.store import create_study, finish_trial, get_or_create_model, get_or_create_workload, start_trial

    url = f"sqlite:///{tmp_path / 'ep.db'}"
    upgrade(url)
    db = make_engine(url)
    results = {2: _run(NVLINK2, ep_size=2, ep_placement="hotness"), 1: _run(NVLINK2)}
    ids = {}
    with session_scope(db) as s:
        model = get_or_create_model(s, {"path": "shape:olmoe-1b-7b", "fingerprint": "olmoe", "arch": "olmoe"})
        workload = get_or_create_workload(s, "simep", source="test", n_requests=10, duration_s=0.0)
        study = create_study(s, "ep", model_id=model, workload_id=workload, backend="sim", search_space_hash="h",
                             objectives=["output_tokens_per_s"], slo={}, hardware={}, software={},
                             optuna_study_name="ep-h")
        for ranks, res in results.items():
            ids[ranks] = start_trial(s, study, ranks, {}, f"c{ranks}")
            finish_trial(s, ids[ranks], res.to_dict())
    ep = results[2].meta["ep"]
    with session_scope(db) as s:
        t = s.get(Trial, ids[2])
        assert t.ep_ranks == 2 and t.ep_imbalance_mean == pytest.approx(ep["imbalance_mean"])
        assert t.ep_imbalance_max == pytest.approx(ep["imbalance_max"]) and t.ep_imbalance_max >= t.ep_imbalance_mean
        assert t.ep_bytes_combined_per_step == pytest.approx(ep["bytes_combined_per_step_mean"])
        assert t.ep_bytes_combined_per_step > 0 and t.ep_imbalance_mean >= 1.0
        assert t.ep_bytes_dispatched_per_step == 0  # attention replicated: nothing to dispatch
        steps = s.scalars(select(StepRow).where(StepRow.trial_id == ids[2]).order_by(StepRow.step)).all()
        assert [r.ep_bytes_combined for r in steps] == [x["bytes_combined"] for x in ep["steps"]]
        assert [r.ep_imbalance for r in steps] == pytest.approx([x["imbalance"] for x in ep["steps"]])
        one = s.get(Trial, ids[1])
        assert one.ep_ranks is None and one.ep_imbalance_mean is None
        assert all(r.ep_bytes_combined is None for r in s.scalars(select(StepRow).where(StepRow.trial_id == ids[1])))
    db.dispose()


def test_sim_bench_rows_carry_the_live_benchs_ep_columns(capsys):
    """``engine bench --backend sim --ep 2`` rows: per-rank pairs, step imbalance and combine bytes over the
    decode steps (the live bench's names); one rank has none."""
    import json

    rc = engine_main(["bench", "--backend", "sim", "--profile", NVLINK2, "--model", "shape:olmoe-1b-7b",
                      "--batch", "1,4", "--prompt-len", "16", "--new-tokens", "4", "--ep", "2", "--json"])
    assert rc in (0, None)
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for row in out["rows"]:
        assert len(row["ep_tokens_per_rank"]) == 2 and sum(row["ep_tokens_per_rank"]) > 0
        assert row["ep_step_imbalance"] >= 1.0 and row["ep_bytes_combined_per_step"] > 0
    rc = engine_main(["bench", "--backend", "sim", "--profile", NVLINK2, "--model", "shape:olmoe-1b-7b",
                      "--batch", "1", "--prompt-len", "16", "--new-tokens", "4", "--json"])
    assert "ep_tokens_per_rank" not in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"][0]
