"""The simulator backend: profiles, models without weights, synthetic routing, pricing, validate-sim parts.

Decision parity with the live engine is in test_backend_parity.py; timings (a 1000-request trial,
`engine calibrate`, `engine validate-sim`) are commands, not tests.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from engine.backend import make_backend
from engine.cli import main as engine_main
from engine.config import ConfigError, EngineConfig
from engine.model.shapes import shape_config, shape_names
from engine.runner import run_workload
from engine.sim.profile import BUILTIN, ProfileError, builtin_profile, load_profile
from engine.sim.routes import RoutingShape, SyntheticRoutes, SyntheticRouting
from engine.sim.validate import spearman
from workloads import Request, Workload

DATASHEET_GPUS = ("h100-pcie", "h100-sxm", "h200", "a100-80gb", "l40s", "rtx4090", "rtx5090")


def _workload(n: int = 12, prompt: int = 40, out: int = 12) -> Workload:
    rng = np.random.default_rng(3)
    return Workload("simtest", [Request(f"r{i}", 0.05 * i, int(rng.integers(prompt // 2, prompt)),
                                        int(rng.integers(out // 2, out))) for i in range(n)], {"source": "test"})


def _small(**knobs) -> EngineConfig:
    return EngineConfig().replace(max_batch_seqs=8, max_seq_len_tokens=512, **knobs)


# ------------------------------------------------------------------------------------------ profiles
@pytest.mark.parametrize("name", DATASHEET_GPUS)
def test_datasheet_gpu_profiles_pair_a_host_and_say_uncalibrated(name):
    p = builtin_profile(name)
    assert p.device is not None and p.link is not None and p.host.cores > 0
    assert p.calibrated is False and p.describe()["calibrated"] is False
    assert name in BUILTIN


def test_a_sim_result_records_backend_profile_and_calibrated():
    b = make_backend("shape:olmoe-1b-7b", _small(), kind="sim", profile="builtin:l40s")
    res = run_workload(b, _workload(), mode="offline")
    assert res.meta["backend"] == "sim" and res.meta["calibrated"] is False
    assert res.meta["profile"]["name"] == "l40s" and res.meta["hardware"]["profile"]["calibrated"] is False
    assert res.meta["hardware"]["gpu"]["name"].startswith("NVIDIA L40S")
    assert res.duration_s > 0 and all(s.duration_ms > 0 for s in res.steps)
    assert set(res.meta["sim"]["breakdown_s"]) >= {"dense_s", "attention_s", "experts_fast_s", "copies_s"}


def test_profile_round_trips_through_its_file(tmp_path):
    p = builtin_profile("rtx4090")
    back = load_profile(p.save(tmp_path / "p.json"))
    assert back == p


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["host"].update(mem_bw_bytes_per_s=-1), r"host\.mem_bw_bytes_per_s=-1: must be > 0"),
    (lambda d: d["host"].update(bw_efficiency=3), r"host\.bw_efficiency=3: must be within"),
    (lambda d: d["device"].update(colour="red"), r"device: unknown field 'colour' \(value 'red'\)"),
    (lambda d: d.update(calibrated="yes"), r"field 'calibrated'='yes'"),
    (lambda d: d.pop("link"), r"field 'link' is needed with a device"),
    (lambda d: d["host"]["tables"].update(bad={"x": [1, 2], "seconds": [1.0]}),
     r"host\.tables\.bad\.seconds=\[1\.0\]: expected a list as long as 'x'"),
    (lambda d: d["host"]["tables"].update(bad={"x": [2, 1], "seconds": [1.0, 2.0]}), r"must be strictly increasing"),
    (lambda d: d.update(version=99), r"field 'version'=99"),
])
def test_a_bad_profile_is_one_line_naming_file_field_and_value(tmp_path, edit, message):
    data = builtin_profile("h100-pcie").to_dict()
    data["host"]["tables"] = {}
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=message) as info:
        load_profile(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_profile_file_errors_and_the_cli_exit(tmp_path, capsys):
    with pytest.raises(ProfileError, match="no such profile file"):
        load_profile(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile(tmp_path / "x.json")
    with pytest.raises(ProfileError, match="unknown profile"):
        load_profile("builtin:rtx9999")
    rc = engine_main(["run", "--backend", "sim", "--profile", str(tmp_path / "x.json"), "--model",
                      "shape:olmoe-1b-7b", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "x.json: not valid JSON" in err[0]
    assert engine_main(["run", "--backend", "sim", "--model", "shape:olmoe-1b-7b"]) == 2
    assert "needs --profile" in capsys.readouterr().err
    assert engine_main(["run", "--profile", "builtin:h200"]) == 2
    assert "need --backend sim" in capsys.readouterr().err


# ------------------------------------------------------------------------------- models without weights
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b", "olmoe-1b-7b"])
def test_a_config_only_directory_prices_as_its_built_in_shape(tmp_path, name):
    assert name in shape_names()
    cfg, _ = shape_config(name)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    wl = _workload(6)
    runs = [run_workload(make_backend(m, _small(), kind="sim", profile="builtin:h200"), wl, mode="offline")
            for m in (f"shape:{name}", str(tmp_path))]
    assert [s.duration_ms for s in runs[0].steps] == [s.duration_ms for s in runs[1].steps]
    assert runs[1].meta["model"]["layout"] == "config only"
    assert runs[1].meta["model"]["fingerprint"].startswith("config:")


def test_the_qwen3_shape_is_the_released_one():
    from engine.model.shapes import shape_spec

    spec, _ = shape_spec("qwen3-30b-a3b")
    assert (spec.n_layers, spec.n_experts, spec.top_k, spec.hidden_size, spec.expert_intermediate) == \
        (48, 128, 8, 2048, 768)


def test_a_directory_without_config_is_one_clear_line(tmp_path):
    from engine.model.arch import CheckpointError

    with pytest.raises(CheckpointError, match="config.json"):
        make_backend(str(tmp_path), _small(), kind="sim", profile="builtin:h200")
    with pytest.raises(CheckpointError, match="unknown model shape"):
        make_backend("shape:nope", _small(), kind="sim", profile="builtin:h200")


def test_a_config_that_does_not_fit_the_device_is_refused():
    with pytest.raises(ConfigError, match="GiB on NVIDIA GeForce RTX 4090"):
        make_backend("shape:qwen3-30b-a3b", _small(), kind="sim", profile="builtin:rtx4090")  # 57 GiB of experts


# ------------------------------------------------------------------------------------ synthetic routing
SHAPE = RoutingShape((0, 1, 2), 32, 4, 3, 64)


def _hot_top_share(routes: SyntheticRoutes, window_start: int, n: int = 2000) -> np.ndarray:
    routes.add("q", window_start + n)
    ids, _ = routes.rows("q", window_start, n)
    routes.forget("q")
    return np.stack([np.bincount(ids[:, li].reshape(-1), minlength=32) for li in range(3)])


def test_synthetic_routing_is_deterministic_skewed_and_drifts():
    a = SyntheticRoutes(SHAPE, SyntheticRouting(skew=1.5, drift=0.3, drift_window_tokens=500, pool_tokens=512))
    b = a.fresh()
    for r in (a, b):
        r.add("x", 50)
    np.testing.assert_array_equal(a.rows("x", 0, 50)[0], b.rows("x", 0, 50)[0])
    ids, gates = a.rows("x", 0, 50)
    assert ids.shape == (50, 3, 4) and gates.shape == (50, 3, 4) and ids.min() >= 0 and ids.max() < 32
    flat = SyntheticRoutes(SHAPE, SyntheticRouting(skew=0.0, drift=0.0, pool_tokens=512))
    top = lambda c: np.sort(c, 1)[:, -4:].sum() / c.sum()  # noqa: E731 - share of the 4 hottest experts
    assert top(_hot_top_share(a.fresh(), 0)) > top(_hot_top_share(flat, 0)) + 0.1
    assert a.drift_tv() > 0.05 and SyntheticRoutes(SHAPE, SyntheticRouting(drift=0.0)).drift_tv() == 0.0
    with pytest.raises(ValueError, match="skew >= 0"):
        SyntheticRouting(skew=-1)


@pytest.mark.parametrize("routing", [
    SyntheticRouting(skew=1.5, drift=0.3, drift_window_tokens=500, pool_tokens=512),
    SyntheticRouting(drift=0.0, pool_tokens=100),
    SyntheticRouting(drift=0.5, drift_window_tokens=7, pool_tokens=37),  # windows shorter than a run
])
def test_counting_routed_tokens_without_their_ids_counts_what_rows_route(routing):
    """counts_many (prefix sums over the pool for long runs, gathered for short ones) against counting
    the ids rows_many builds: runs of 0, 1 and a few tokens, runs crossing drift windows, runs longer
    than the pool, several requests in one step."""
    from engine.moe.policy.plan import counts_by_layer

    rng = np.random.default_rng(5)
    routes = SyntheticRoutes(SHAPE, routing).fresh()
    keys = [f"k{i}" for i in range(12)]
    for k in keys:
        routes.add(k, int(rng.integers(1, 5000)))
    for trial in range(60):
        sel = [str(k) for k in rng.choice(keys, size=int(rng.integers(1, 6)), replace=False)]
        starts = [int(rng.integers(0, 3000)) for _ in sel]
        ns = [1] * len(sel) if trial % 3 == 0 else [int(rng.choice([0, 1, 3, 16, 40, 700, 3000])) for _ in sel]
        got = routes.counts_many(sel, starts, ns)
        want = counts_by_layer(routes.rows_many(sel, starts, ns, gates=False)[0], SHAPE.n_experts)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want, err_msg=f"{sel} {starts} {ns}")


@pytest.mark.parametrize("prune", [(None, 0.1), (2, 0.0), (3, 0.3)])
def test_synthetic_routes_pruned_per_pool_row_as_prune_routes_prunes_each_token(prune):
    """rows_many(prune=...) (decided once per pool row) against prune_routes of every token's own gate
    weights, and counts_many(prune=...) against counting those ids, across drift windows."""
    from engine.moe.policy.plan import counts_by_layer
    from engine.moe.policy.routing import prune_routes

    rng = np.random.default_rng(8)
    routes = SyntheticRoutes(SHAPE, SyntheticRouting(drift=0.4, drift_window_tokens=300, pool_tokens=256)).fresh()
    keys = [f"k{i}" for i in range(8)]
    for k in keys:
        routes.add(k, 3000)
    for _ in range(30):
        sel = [str(k) for k in rng.choice(keys, size=int(rng.integers(1, 5)), replace=False)]
        starts = [int(rng.integers(0, 2000)) for _ in sel]
        ns = [int(rng.choice([1, 2, 30, 400])) for _ in sel]
        ids, gates = routes.rows_many(sel, starts, ns)
        t, n_layers, k = ids.shape
        want = prune_routes(gates.reshape(t * n_layers, k).astype(np.float32), ids.reshape(t * n_layers, k),
                            *prune)[1].reshape(t, n_layers, k)
        got, no_gates = routes.rows_many(sel, starts, ns, prune=prune)
        assert no_gates is None and got.dtype == want.dtype and (want < 0).any()
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(routes.counts_many(sel, starts, ns, prune=prune),
                                      counts_by_layer(want, SHAPE.n_experts))


def test_sim_without_a_trace_routes_synthetically_and_the_same_twice():
    wl = _workload()
    b = make_backend("shape:mixtral-8x7b", _small(), kind="sim", profile="builtin:h200")
    r1, r2 = run_workload(b, wl, mode="offline"), run_workload(b, wl, mode="offline")
    assert r1.meta["routing"]["synthetic"] is True
    assert [s.duration_ms for s in r1.steps] == [s.duration_ms for s in r2.steps]


# --------------------------------------------------------------------------------------------- pricing
def _tok_s(profile: str, **knobs) -> float:
    b = make_backend("shape:qwen3-30b-a3b", _small(**knobs), kind="sim", profile=profile)
    return run_workload(b, _workload(16, 64, 24), mode="offline").summary()["output_tokens_per_s"]


def test_pricing_orders_what_the_hardware_orders():
    # More of the experts resident is faster; the H200 is faster than the H100 PCIe for the same config.
    small = _tok_s("builtin:h100-pcie", residency="static", resident_budget_gib=4, missing_expert="host")
    large = _tok_s("builtin:h100-pcie", residency="static", resident_budget_gib=40, missing_expert="host")
    allres = _tok_s("builtin:h100-pcie")
    assert small < large < allres * 1.01
    assert _tok_s("builtin:h200") > allres
    # On a PCIe 4 card with a desktop host, fetching every missing expert is slower than the host.
    host = _tok_s("builtin:rtx4090", residency="static", resident_budget_gib=8, missing_expert="host")
    fetch = _tok_s("builtin:rtx4090", residency="static", resident_budget_gib=8, missing_expert="fetch")
    assert fetch != host


def test_int8_dense_matrices_price_faster_on_a_host_and_are_refused_where_the_engine_refuses_them():
    """Host-only: the dense products and the lm head read half the bytes; with a device (the dense matrices on
    the GPU) or without native kernels the simulator refuses the knob as the live engine does."""
    as_loaded = _tok_s("builtin:zen4-desktop", compute_dtype="float32")
    assert _tok_s("builtin:zen4-desktop", compute_dtype="float32", dense_precision="int8") > as_loaded
    for profile, knobs in (("builtin:h100-pcie", {}), ("builtin:zen4-desktop", {"compute_dtype": "bfloat16"})):
        with pytest.raises(ConfigError, match=r"^sim backend: runtime.dense_precision='int8': "):
            _tok_s(profile, dense_precision="int8", **knobs)


def test_int8_dense_copies_count_in_the_memory_a_config_needs():
    """runtime.dense_precision=int8 keeps int8 copies beside the weights as loaded: a host that fits the
    model as loaded may not fit the copies too, and the refusal counts them among the dense weights."""
    import dataclasses
    import re

    from engine.model.shapes import shape_spec
    from engine.sim.profile import load_profile

    spec, _ = shape_spec("qwen3-30b-a3b")
    prof = load_profile("builtin:zen4-desktop")
    tiny = dataclasses.replace(prof, host=dataclasses.replace(prof.host, mem_bytes=2**30))
    dense = {}
    for precision in ("as_loaded", "int8"):
        with pytest.raises(ConfigError, match=r"dense weights [0-9.]+") as e:
            make_backend("shape:qwen3-30b-a3b", _small(compute_dtype="float32", dense_precision=precision),
                         kind="sim", profile=tiny)
        dense[precision] = float(re.search(r"dense weights ([0-9.]+)", str(e.value)).group(1))
    assert dense["int8"] - dense["as_loaded"] == pytest.approx(spec.int8_dense_bytes() / 2**30, abs=0.1)
    assert spec.int8_dense_bytes() > 2**30  # the attention projections and the lm head of 48 layers, in int8


SIM_WITHOUT_TORCH = """
import json, sys
sys.modules["torch"] = None  # any import of torch now fails
from engine.backend import make_backend
from engine.config import EngineConfig
from engine.runner import run_workload
from workloads import Request, Workload
wl = Workload("w", [Request(f"r{i}", 0.0, 20, 5) for i in range(4)], {})
b = make_backend("shape:olmoe-1b-7b", EngineConfig().replace(max_batch_seqs=4, max_seq_len_tokens=256,
                 residency="cache", resident_budget_gib=1.0, missing_expert="auto"), kind="sim",
                 profile="builtin:a100-80gb")
print(json.dumps(run_workload(b, wl, mode="offline").summary()["output_tokens_per_s"]))
"""


def test_sim_runs_without_torch():
    proc = subprocess.run([sys.executable, "-c", SIM_WITHOUT_TORCH], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert float(proc.stdout.strip().splitlines()[-1]) > 0


# ---------------------------------------------------------------------------------------- validate-sim
def test_spearman_matches_its_definition():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]) == pytest.approx(1 - 6 * 4 / (5 * 24))
    assert spearman([1, 2], [1, 2]) is None


def test_validate_draws_configs_from_the_tuner_space():
    from engine.sim.validate import draw_configs

    prof = builtin_profile("spr")
    a = draw_configs(prof, 5, 1, EngineConfig())
    b = draw_configs(prof, 5, 1, EngineConfig())
    assert len(a) == 5 and [c.config_hash() for _, c in a] == [c.config_hash() for _, c in b]
    assert len({c.config_hash() for _, c in a}) == 5


@pytest.mark.parametrize("knobs", [
    dict(residency="static", resident_budget_gib=16, missing_expert="auto"),
    dict(residency="dynamic", resident_budget_gib=16, missing_expert="fetch", lo_precision="int8"),
    dict(residency="static", resident_budget_gib=20, missing_expert="host", decode_attention="host"),
    dict(residency="cache", resident_budget_gib=16, missing_expert="fetch"),
    dict(residency="cache", resident_budget_gib=12, missing_expert="host", cache_policy="lfu"),
])
def test_pricing_all_layers_at_once_equals_layer_by_layer(monkeypatch, knobs):
    from engine.sim import step

    wl = _workload(10, 64, 16)
    b = make_backend("shape:qwen3-30b-a3b", _small(**knobs), kind="sim", profile="builtin:h100-pcie")
    fast = [s.duration_ms for s in run_workload(b, wl, mode="offline").steps]
    monkeypatch.setattr(step.StepPricer, "_step_plan", lambda self, d, out: [self._layer(x, out) for x in d])
    slow = [s.duration_ms for s in run_workload(b, wl, mode="offline").steps]
    np.testing.assert_allclose(fast, slow, rtol=1e-12)


@pytest.mark.parametrize("knobs, profile", [
    (dict(residency="cache", resident_budget_gib=20, max_replicas=3, replica_window_tokens=64), "builtin:h100-pcie"),
    (dict(max_replicas=2, resident_budget_gib=4, replica_window_tokens=64, missing_expert="host"), "builtin:h100-pcie"),
    (dict(max_replicas=2, resident_budget_gib=2, replica_window_tokens=64), "builtin:spr"),
])
def test_step_plans_with_replicas_price_as_their_layer_decisions(monkeypatch, knobs, profile):
    """A step plan with replicated runs (or on a host-only profile) is priced from its arrays; against
    pricing the LayerDecision each layer builds: the same step times, bit for bit."""
    from engine.sim import step

    wl = _workload(10, 64, 16)
    b = make_backend("shape:qwen3-30b-a3b", _small(**knobs), kind="sim", profile=profile)
    fast = run_workload(b, wl, mode="offline")
    assert fast.meta["tiers"]["replica_calls"] > 0
    monkeypatch.setattr(step.StepPricer, "_plan_two_tier", lambda self, d, out: [self._layer(x, out) for x in d])
    monkeypatch.setattr(step.StepPricer, "_plan_parts",
                        staticmethod(lambda d: (p for x in d for p in step.StepPricer._parts(x))))
    slow = run_workload(b, wl, mode="offline")
    assert [s.duration_ms for s in fast.steps] == [s.duration_ms for s in slow.steps]


def test_validate_sim_command_ends_with_its_json(make_ckpt, capsys):
    model = str(make_ckpt("qwen2_moe", seed=4, experts=16, top_k=4, width=32))
    rc = engine_main(["validate-sim", "--model", model, "--workload", "builtin:tiny", "--profile", "builtin:spr",
                      "--configs", "1", "--max-requests", "2", "--grid", "hybrid", "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    got = json.loads(out[-1])
    assert got["configs"] == 1 and got["profile"]["calibrated"] is False
    row = got["rows"][0]
    assert row["same_steps"] and row["live"]["output_tokens_per_s"] > 0 and row["sim"]["output_tokens_per_s"] > 0
    assert set(got["summary"]) >= {"output_tokens_per_s", "tpot_p99_ms", "ttft_p99_ms", "spearman_output_tokens_per_s"}
    for side in ("live", "sim"):  # every metric read from the run's summary under its registered name
        assert all(row[side][m] is not None and row[side][m] > 0 for m in ("tpot_p99_ms", "ttft_p99_ms")), row[side]


def test_bench_runs_simulated_and_refuses_sim_flags_live(capsys):
    rc = engine_main(["bench", "--backend", "sim", "--profile", "builtin:h100-pcie", "--model", "shape:olmoe-1b-7b",
                      "--batch", "1,8", "--prompt-len", "32", "--new-tokens", "8", "--json"])
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and got["backend"] == "sim" and got["calibrated"] is False
    one, eight = got["rows"]
    assert eight["decode_tokens_per_s"] > one["decode_tokens_per_s"] > 0 and one["prefill_tokens_per_s"] > 0
    assert engine_main(["bench", "--profile", "builtin:h100-pcie"]) == 2
    assert "need --backend sim" in capsys.readouterr().err


@pytest.mark.parametrize("knobs", [
    dict(residency="cache", resident_budget_gib=16, missing_expert="fetch"),
    dict(residency="cache", resident_budget_gib=10, missing_expert="auto", cache_policy="lfu"),
])
def test_cache_planned_all_layers_at_once_decides_as_layer_by_layer(monkeypatch, knobs):
    """The cache's step-wide access (no prefetch, one micro-batch) against one layer after another:
    the same decisions (cache hits, misses, evictions, admissions, runs) and the same step times."""
    from engine.moe.policy import controller as ctl
    from engine.moe.policy.plan import counts_by_layer

    wl = _workload(10, 64, 16)
    b = make_backend("shape:qwen3-30b-a3b", _small(**knobs), kind="sim", profile="builtin:h100-pcie")
    fast = run_workload(b, wl, mode="offline", decisions=True)

    def layer_by_layer(self, ids):
        counts = counts_by_layer(ids, self.settings.n_experts)
        return [self.plan_layer(li, ids[:, li, :], counts[li]) for li in range(counts.shape[0])], counts

    monkeypatch.setattr(ctl.ResidencyController, "plan_step", layer_by_layer)
    monkeypatch.setattr(ctl.ResidencyController, "reads_ids", lambda self, n_tokens: True)
    slow = run_workload(b, wl, mode="offline", decisions=True)
    np.testing.assert_allclose([s.duration_ms for s in fast.steps], [s.duration_ms for s in slow.steps], rtol=1e-12)
    assert fast.decisions and fast.decisions == slow.decisions


def test_tables_extrapolate_at_most_in_proportion_to_tokens():
    """A noisy last pair of points (1e-7 s then 1e-3 s: slope 13 in log-log) must not extrapolate as a
    power: beyond the table the cost grows at most linearly, and never falls."""
    from engine.sim.cost import _log_lut
    from engine.sim.profile import Table

    steep = Table((8.0, 16.0, 32.0), (1e-4, 1e-7, 1e-3))
    assert steep.at(64) == pytest.approx(2e-3) and _log_lut(steep, 64)[64] == pytest.approx(2e-3)
    falling = Table((1.0, 2.0), (2e-3, 1e-3))
    assert falling.at(8) == pytest.approx(1e-3) and _log_lut(falling, 8)[8] == pytest.approx(1e-3)
    assert Table((1.0, 4.0), (1e-3, 2e-3)).at(16) == pytest.approx(4e-3)  # sub-linear kept


# ------------------------------------------------------------------------------------------ engine plan
def _plan_rows(capsys, *slo: str) -> tuple[str, list[list[str]]]:
    args = ["plan", "--model", "shape:olmoe-1b-7b", "--profile", "builtin:h100-pcie", "--workload", "builtin:tiny",
            "--max-requests", "6", "--max-batch-seqs", "8", "--max-seq-len-tokens", "1024", "--quiet", "--no-db"]
    for s in slo:
        args += ["--slo", s]
    assert engine_main(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    head = lines[0]
    table = [ln.split() for ln in lines if ln[:1].isdigit() or ln.startswith("all")]
    return head, table


def test_plan_prices_capacity_at_the_slo_it_names(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --no-db: no moetune.db appears where it ran
    head, loose = _plan_rows(capsys, "ttft_p99_ms=4000", "tpot_p99_ms=400")
    assert "SLO ttft_p99_ms=4000, tpot_p99_ms=400, attainment 90 %" in head
    head, tight = _plan_rows(capsys, "ttft_p99_ms=20", "tpot_p99_ms=2")
    assert "SLO ttft_p99_ms=20, tpot_p99_ms=2" in head
    assert len(loose) == len(tight) > 3
    # The capacity column (capacity_rps) is the last but the error column (empty): a tighter SLO never
    # admits a higher rate, and a 2 ms TPOT admits none on these profiles.
    cap = [float(r[8]) for r in loose], [float(r[8]) for r in tight]
    assert all(t <= lo_ for lo_, t in zip(*cap, strict=True)) and max(cap[1]) == 0 and max(cap[0]) > 0
    assert list(tmp_path.iterdir()) == []


def test_plan_refuses_an_slo_without_a_latency_bound(capsys):
    for slo, message in (("quality_min=0.9", "capacity needs a per-request latency bound"),
                         ("ttft_p99=9", "unknown SLO metric")):
        assert engine_main(["plan", "--model", "shape:olmoe-1b-7b", "--profile", "builtin:h100-pcie",
                            "--workload", "builtin:tiny", "--slo", slo, "--quiet"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--slo" in err[0] and slo in err[0] and message in err[0]
