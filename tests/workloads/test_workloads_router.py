"""Router traces: storage, model checks, hotness and skew metrics, the synthetic generator."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from workloads.router import RouterTrace, drift_tv, normalized_entropy, top_share
from workloads.schema import Request, Workload, WorkloadError, load_workload, save_workload
from workloads.synth import synth_router_trace

IDENTITY = {"arch": "mixtral", "n_layers": 3, "moe_layers": [0, 2], "n_experts": 8, "top_k": 2,
            "hidden_size": 64, "fingerprint": "abc123"}


def _trace(lengths=(5, 3, 1), seed: int = 0) -> RouterTrace:
    rng = np.random.default_rng(seed)
    per_request = {}
    for i, n in enumerate(lengths):
        ids = np.stack([rng.permutation(8)[:2] for _ in range(n * 2)]).reshape(n, 2, 2)
        per_request[f"r{i}"] = (ids, rng.random((n, 2, 2)))
    return RouterTrace.from_requests(IDENTITY, per_request)


def test_save_load_round_trip(tmp_path: Path):
    trace = _trace()
    trace.save(tmp_path / "t.safetensors")
    back = RouterTrace.load(tmp_path / "t.safetensors")
    assert back.request_ids == ["r0", "r1", "r2"] and back.model_identity == IDENTITY
    assert back.expert_ids.dtype == np.int16 and back.gate_weights.dtype == np.float16
    np.testing.assert_array_equal(back.expert_ids, trace.expert_ids)
    np.testing.assert_array_equal(back.gate_weights, trace.gate_weights)
    ids, gates = back.request("r1")
    assert ids.shape == (3, 2, 2) and gates.shape == (3, 2, 2)


def test_from_arrays_matches_from_requests():
    a = _trace()
    b = RouterTrace.from_arrays(request_ids=a.request_ids, expert_ids=[a.request(r)[0] for r in a.request_ids],
                                gate_weights=[a.request(r)[1] for r in a.request_ids], model_identity=IDENTITY)
    np.testing.assert_array_equal(a.expert_ids, b.expert_ids)
    np.testing.assert_array_equal(a.offsets, b.offsets)


def test_workload_with_trace_round_trip(tmp_path: Path):
    requests = [Request(f"r{i}", float(i), 3, 2) for i in range(3)]
    w = Workload("w", requests, {}, _trace())
    save_workload(w, tmp_path / "w")
    back = load_workload(tmp_path / "w")
    assert back.router_trace is not None and back.router_trace.n_tokens == 9
    # the trace must name requests of the workload
    with pytest.raises(WorkloadError, match="request_ids"):
        Workload("w", requests[:2], {}, _trace())


def test_check_model():
    trace = _trace()
    trace.check_model(dict(IDENTITY), "w")
    with pytest.raises(WorkloadError, match="fingerprint") as info:
        trace.check_model({**IDENTITY, "fingerprint": "def456"}, "builtin:x")
    assert str(info.value).startswith("builtin:x: ") and "other weights" in str(info.value)
    with pytest.raises(WorkloadError, match="n_experts=8 but the model has n_experts=16"):
        trace.check_model({**IDENTITY, "n_experts": 16, "fingerprint": "zzz"}, "w")
    with pytest.raises(WorkloadError, match="moe_layers"):
        trace.check_model({**IDENTITY, "moe_layers": [1, 2]}, "w")


def test_synthetic_trace_refused_unless_allowed():
    requests = [Request(f"r{i}", float(i), 4, 3) for i in range(4)]
    trace = synth_router_trace(requests, n_layers=2, n_experts=8, top_k=2)
    model = {**IDENTITY, "moe_layers": [0, 1]}
    with pytest.raises(WorkloadError, match="synthetic"):
        trace.check_model(model, "w")
    trace.check_model(model, "w", allow_synthetic=True)
    with pytest.raises(WorkloadError, match="n_experts"):
        trace.check_model({**model, "n_experts": 4}, "w", allow_synthetic=True)


def test_load_rejects_bad_files(tmp_path: Path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(WorkloadError, match="bad.safetensors: not a readable safetensors"):
        RouterTrace.load(bad)
    from safetensors.numpy import save_file

    trace = _trace()
    meta = {"format": "moetune-router-trace", "format_version": "1", "request_ids": '["r0", "r1", "r2"]',
            "model_identity": '{"arch": "mixtral"}'}
    save_file({"expert_ids": trace.expert_ids, "gate_weights": trace.gate_weights, "offsets": trace.offsets},
              str(bad), metadata=meta)
    with pytest.raises(WorkloadError, match="field 'n_layers'"):
        RouterTrace.load(bad)
    save_file({"expert_ids": trace.expert_ids.astype(np.int32), "gate_weights": trace.gate_weights,
               "offsets": trace.offsets}, str(bad), metadata={**meta, "model_identity": json_identity()})
    with pytest.raises(WorkloadError, match="field 'expert_ids': dtype int32"):
        RouterTrace.load(bad)
    save_file({"expert_ids": trace.expert_ids, "gate_weights": trace.gate_weights, "offsets": trace.offsets},
              str(bad), metadata={**meta, "model_identity": json_identity(), "format_version": "9"})
    with pytest.raises(WorkloadError, match="format_version"):
        RouterTrace.load(bad)


def json_identity() -> str:
    import json

    return json.dumps(IDENTITY)


def test_hotness_and_metrics():
    ids = np.zeros((4, 2, 2), np.int16)
    ids[:, 0] = [0, 1]  # layer 0: experts 0 and 1 only
    ids[:, 1] = [[0, 1], [2, 3], [4, 5], [6, 7]]  # layer 1: uniform, and drifting
    trace = RouterTrace.from_requests(IDENTITY, {"r": (ids, np.full((4, 2, 2), 0.5))})
    hot = trace.hotness()
    np.testing.assert_allclose(hot[0], [0.5, 0.5, 0, 0, 0, 0, 0, 0])
    np.testing.assert_allclose(hot[1], np.full(8, 1 / 8))
    np.testing.assert_allclose(hot.sum(axis=1), 1.0)
    np.testing.assert_allclose(top_share(hot), [0.5, 0.125])  # top-10 % of 8 experts = 1 expert
    np.testing.assert_allclose(normalized_entropy(hot), [np.log(2) / np.log(8), 1.0])
    windows = trace.hotness_windows(1)
    assert windows.shape == (4, 2, 8)
    np.testing.assert_allclose(drift_tv(windows), [0.0, 1.0])
    np.testing.assert_allclose(trace.hotness(window_tokens=1)[1, 6:], [0.5, 0.5])
    stats = trace.skew_stats(window_tokens=2)
    assert stats["n_windows"] == 2 and stats["drift_tv"] == [0.0, 1.0]


def test_skipped_slots_not_counted():
    ids = np.array([[[0, -1]]], np.int16).repeat(2, axis=1)
    trace = RouterTrace.from_requests(IDENTITY, {"r": (ids, np.ones((1, 2, 2)))})
    np.testing.assert_allclose(trace.hotness()[:, 0], [1.0, 1.0])


def test_subset_and_truncate():
    trace = _trace()
    sub = trace.subset(["r2", "r0"], {"r0": 2})
    assert sub.request_ids == ["r2", "r0"] and sub.tokens_per_request() == {"r2": 1, "r0": 2}
    np.testing.assert_array_equal(sub.request("r0")[0], trace.request("r0")[0][:2])


def test_synth_router_trace_properties():
    requests = [Request(f"r{i}", float(i), 200, 57) for i in range(20)]
    kwargs = dict(n_layers=4, n_experts=32, top_k=2, skew=1.2, drift=0.0, layer_corr=0.0, seed=7)
    trace = synth_router_trace(requests, **kwargs)
    assert trace.n_tokens == 20 * 256 and trace.expert_ids.shape == (5120, 4, 2)
    again = synth_router_trace(requests, **kwargs)
    np.testing.assert_array_equal(trace.expert_ids, again.expert_ids)
    assert not np.array_equal(trace.expert_ids, synth_router_trace(requests, **{**kwargs, "seed": 8}).expert_ids)
    ids = trace.expert_ids.astype(int)
    assert (ids[:, :, 0] != ids[:, :, 1]).all()  # top-k without repeats
    np.testing.assert_allclose(trace.gate_weights.astype(np.float32).sum(axis=-1), 1.0, atol=2e-3)
    skewed = top_share(trace.hotness()).mean()
    flat = top_share(synth_router_trace(requests, **{**kwargs, "skew": 0.0}).hotness()).mean()
    assert skewed > 0.3 > flat  # 4 of 32 experts take a large share only with skew
    drifting = synth_router_trace(requests, **{**kwargs, "drift": 1.0, "drift_window_tokens": 256})
    assert drift_tv(drifting.hotness_windows(640)).mean() > drift_tv(trace.hotness_windows(640)).mean()


def test_synth_layer_correlation():
    requests = [Request(f"r{i}", float(i), 100, 1) for i in range(20)]

    def follow_rate(corr: float) -> float:
        trace = synth_router_trace(requests, n_layers=2, n_experts=16, top_k=2, layer_corr=corr, drift=0.0, seed=1)
        first = trace.expert_ids[:, :, 0].astype(int)
        pairs = np.zeros((16, 16))
        np.add.at(pairs, (first[:, 0], first[:, 1]), 1)
        return float(pairs.max(axis=1).sum() / pairs.sum())  # how predictable layer 1 is from layer 0

    assert follow_rate(0.9) > follow_rate(0.0) + 0.3
