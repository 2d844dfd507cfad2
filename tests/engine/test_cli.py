"""The `engine` command: every measuring subcommand ends with one JSON object; bad input is one line."""

from __future__ import annotations

import json

import pytest

from engine.cli import main
from engine.model.maker import make_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli-model")
    make_model(d, "olmoe", "tiny", seed=1)
    return str(d)


def last_json(capsys) -> dict:
    out = capsys.readouterr().out.strip().splitlines()
    return json.loads(out[-1])


def test_make_model_and_generate(tmp_path, capsys):
    out = tmp_path / "m"
    assert main(["make-model", "--arch", "mixtral", "--preset", "tiny", "--out", str(out), "--seed", "2"]) == 0
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    capsys.readouterr()
    assert main(["generate", "--model", str(out), "--prompt-ids", "1,2,3,4", "--max-new-tokens", "5", "--json"]) == 0
    res = last_json(capsys)
    assert res["prompt_ids"] == [1, 2, 3, 4] and len(res["output_ids"]) == 5


def test_run_json_has_requests_steps_totals_for_50_requests(model_dir, capsys):
    assert main(["run", "--model", model_dir, "--workload", "builtin:chat", "--mode", "offline",
                 "--popularity", "--json", "--quiet"]) == 0
    res = last_json(capsys)
    assert len(res["requests"]) >= 50
    r = res["requests"][0]
    for key in ("ttft_ms", "tpot_ms", "e2e_ms", "itl_ms", "prompt_tokens", "output_tokens", "arrival_s"):
        assert key in r
    s = res["summary"]
    for key in ("output_tokens_per_s", "requests_per_s", "peak_rss_bytes", "ttft_p99_ms", "tpot_p99_ms"):
        assert s[key] is not None
    assert res["steps"] and {"duration_ms", "batch_seqs", "prefill_tokens", "decode_tokens"} <= set(res["steps"][0])
    assert res["telemetry"] and "cpu_percent" in res["telemetry"][0]
    roof = res["roofline"]  # decode steps against the roofline of their batch, bytes from the precisions used
    assert roof["bytes_per_step"] > roof["kv_bytes_per_step"] > 0 and roof["bound"] in ("bandwidth", "compute")
    assert roof["roofline_fraction"] > 0 and roof["decode_tokens_per_s"] > 0
    assert res["popularity"] and res["meta"]["hybrid"] is False


def test_bench_json(model_dir, capsys):
    assert main(["bench", "--model", model_dir, "--batch", "1,3", "--prompt-len", "8", "--new-tokens", "4",
                 "--repeats", "1", "--json"]) == 0
    res = last_json(capsys)
    assert [r["batch"] for r in res["rows"]] == [1, 3]
    for row in res["rows"]:
        assert row["decode_tokens_per_s"] > 0 and row["prefill_tokens_per_s"] > 0
        assert row["roofline_decode_tokens_per_s"] > 0 and row["weight_bytes_per_decode_step"] > 0
        assert row["limits"]["device"] == "cpu" and row["limits"]["read_gbps"] == row["mem_bw_gb_per_s"]
        assert row["bandwidth_bound_by"] == "memory" and row["host_weight_bytes_per_decode_step"] == 0
        assert row["decode_paths"]["router"] in ("fp32/native", "fp32/torch")
        # Every decode step of the plain config runs fused where the native kernels run (recorded per row).
        assert row["decode_steps_fused"] == (1.0 if res["cpu_kernels"].startswith("native") else 0.0)


def test_knobs(capsys):
    assert main(["knobs"]) == 0
    out = capsys.readouterr().out
    assert "scheduler.max_batch_seqs" in out and "runtime.compute_dtype" in out


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["run", "--model", "/nonexistent/model", "--workload", "builtin:tiny"], "/nonexistent/model"),
        (["run", "--model", "builtin:nope-tiny", "--workload", "builtin:tiny"], "builtin:nope-tiny"),
        (["run", "--workload", "builtin:nope"], "nope"),
        (["generate", "--prompt-ids", "1,x"], "--prompt-ids"),
        (["run", "--max-batch-seqs", "0", "--workload", "builtin:tiny"], "scheduler.max_batch_seqs='0': below the minimum 1"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("engine: error: ") and needle in err and "\n" not in err


def test_bad_config_file(tmp_path, model_dir, capsys):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"scheduler": {"max_batch_size": 4}}))
    assert main(["generate", "--model", model_dir, "--prompt-ids", "1", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'scheduler.max_batch_size'" in err and str(cfg) in err


def test_sweep_and_eval_json(model_dir, capsys):
    assert main(["sweep", "--model", model_dir, "--knobs", "top_k_override,expert_batching", "--batch", "2",
                 "--prompt-len", "8", "--new-tokens", "3", "--repeats", "1", "--quality-prompts", "2", "--json"]) == 0
    res = last_json(capsys)
    by = {(r["knob"], r["value"]): r for r in res["rows"]}
    assert by[("top_k_override", "0")]["top1_agreement"] == 1.0  # the model's own routing
    assert by[("top_k_override", "1")]["mean_kl"] > 0  # fewer experts: a measured change
    assert ("expert_batching", "micro:4") in by
    assert all(r["decode_tokens_per_s"] > 0 and r["peak_rss_gib"] > 0 for r in res["rows"])
    assert main(["eval", "--model", model_dir, "--hi-precision", "int8", "--max-prompts", "2", "--json"]) == 0
    q = last_json(capsys)
    assert 0.5 < q["top1_agreement"] <= 1.0 and q["mean_kl"] >= 0 and q["prompts"] == 2


def test_run_writes_decisions_and_replays_them_on_the_stub(model_dir, tmp_path, capsys):
    """`engine run --decisions` writes the plan of every step and MoE layer; `workloads record` then
    `engine run --backend stub` on the recorded workload writes plans of the same steps and layers
    without tensors (identical plans are test_backend_parity's: here the trace was recorded in the
    machine's own compute precision, which may route a near tie differently)."""
    from workloads.cli import main as workloads_main

    recorded = tmp_path / "recorded"
    assert workloads_main(["record", "--model", model_dir, "--workload", "builtin:tiny", "--out", str(recorded),
                           "--max-requests", "4"]) == 0
    from pathlib import Path

    from engine.model.arch import read_config

    _, spec = read_config(Path(model_dir))
    two_bf16_experts_gib = 2 * 3 * spec.hidden_size * spec.expert_intermediate * 2 * len(spec.moe_layers) / 2**30
    knobs = ["--compute-dtype", "float32", "--residency", "cache", "--resident-budget-gib", f"{two_bf16_experts_gib:.9f}",
             "--missing-expert", "host", "--mode", "offline", "--quiet"]
    files = {}
    for backend in ("live", "stub"):
        out = tmp_path / f"{backend}.jsonl"
        capsys.readouterr()
        assert main(["run", "--model", model_dir, "--workload", str(recorded), "--backend", backend,
                     "--decisions", str(out), "--json", *knobs]) == 0
        res = last_json(capsys)
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        assert lines == res["decisions"] and res["meta"]["backend"] == backend
        files[backend] = lines
    live = files["live"]
    assert live[0]["step"] == -1  # the initial placement
    assert {d["layer"] for d in live if "layer" in d} == set(range(len(live[0]["hi"])))
    assert all({"step", "layer", "parts"} <= set(d) for d in live[1:] if "moves" not in d)
    assert any("host" in p for d in live[1:] for p in d.get("parts", ()))

    def where(d: dict) -> tuple:
        return d["step"], d.get("layer"), [p["rows"] for p in d.get("parts", ())]

    assert [where(d) for d in files["stub"]] == [where(d) for d in live]


def test_stub_backend_without_a_trace_is_one_line(model_dir, capsys):
    assert main(["run", "--model", model_dir, "--workload", "builtin:tiny", "--backend", "stub",
                 "--compute-dtype", "float32", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("engine: error: stub backend:") and "no router trace" in err and "\n" not in err
