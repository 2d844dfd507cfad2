"""``engine doctor``: the real command, on this machine, with a working compiler, a broken one and none."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine import kernels
from engine.env import cache_dir
from engine.hwinfo import ISA_FLAGS, cpu_flags

ENGINE_CLI = [sys.executable, "-c", "import sys; from engine.cli import main; sys.exit(main())"]


def doctor(env: dict[str, str]) -> tuple[int, list[str], dict]:
    proc = subprocess.run([*ENGINE_CLI, "doctor", "--json"], env=env, capture_output=True, text=True, timeout=600)
    lines = proc.stdout.strip().splitlines()
    return proc.returncode, lines[:-1], json.loads(lines[-1])


def private_cache(tmp_path: Path) -> str:
    """An empty cache holding only this machine's calibrations (so the doctor does not re-measure)."""
    calib = cache_dir() / "calibration.json"
    if calib.exists():
        shutil.copy(calib, tmp_path / "calibration.json")
    return str(tmp_path)


def test_doctor_reports_this_machine(require_component):
    code, text, report = doctor(dict(os.environ))
    k = report["kernels"]
    require_component("a C++ compiler", k["state"] != "missing", "apt-get install g++")
    assert code == 0, text
    assert k["state"] == "available" and k["available"] and Path(k["library"]).exists()
    assert k["isa"] in kernels.ISA_VARIANTS and k["compiler"]
    # The chosen path per precision and token-count range, in the JSON and in the text.
    d = k["dispatch"]
    assert d["available"] and d["isa"] == k["isa"] and k["isa"] in d["runnable"]
    assert set(d["paths"]) == {"bf16", "fp16", "int8", "int4"}
    for prec, t in d["paths"].items():
        ranges = t["ranges"]
        assert ranges and ranges[-1][0] is None, (prec, ranges)  # the last range is open-ended
        uppers = [u for u, _ in ranges[:-1]]
        assert uppers == sorted(uppers) and all(u >= 1 for u in uppers)
        assert all(p.startswith(("torch:", *d["runnable"])) for _, p in ranges), ranges
        line = next(x for x in text if x.strip().startswith(f"{prec} "))
        assert ranges[0][1] in line and ("tokens" in line)
    assert k["dispatch_summary"].startswith(k["isa"])
    assert any(line.startswith("paths     ") for line in text)
    att = d["attention"]
    assert att == kernels.attention_kernels()
    if "avx2" in d["runnable"]:  # a vector variant: its own attention kernels, named on the attention line
        assert att["decode"] and att["prompts"]
        assert (f"attention decode on the {att['decode']} kernel; prompts on the {att['prompts']} kernel (blocks of "
                "16 tokens)") in "\n".join(text)
    flags = cpu_flags()
    assert report["cpu"]["isa"] == {f: f in flags for f in ISA_FLAGS}
    for name in ("bfloat16", "float16"):
        d = report["compute_dtype"][name]
        assert d["torch_only_picks"] in ("float32", name) and set(d["times_s"]) == {"m1", "m16"}
        assert d["auto_picks"] == "float32"  # the kernels are available: fp32 activations on the weights as stored
        assert any(x.startswith(f"compute   {name} checkpoints: auto computes in float32, weights read as stored")
                   for x in text)
    assert set(report["quant"]["kernels"]["cpu"]) == {"fp32", "bf16", "fp16", "int8", "int4"}
    assert report["cuda"]["available"] is False or report["cuda"]["devices"]
    assert report["problems"] == []
    assert text[-1] == "ok: nothing the engine needs is broken"
    assert any(line.startswith("kernels   available: ") for line in text)


def test_a_compiler_that_fails_is_a_problem_with_its_error(tmp_path):
    env = {**os.environ, "CXX": "/bin/false", "MOETUNE_CACHE": private_cache(tmp_path)}
    code, text, report = doctor(env)
    assert code == 1
    assert report["kernels"]["state"] == "broken" and report["kernels"]["compiler"] == "/bin/false"
    assert any("/bin/false" in p and "exit status 1" in p for p in report["problems"])
    assert any(line.startswith("PROBLEM   native CPU kernels") for line in text)


def test_no_compiler_at_all_is_a_note_not_a_problem(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "CXX"}
    env.update(PATH="/nonexistent", MOETUNE_CACHE=private_cache(tmp_path))
    code, text, report = doctor(env)
    assert code == 0, text
    assert report["kernels"]["state"] == "missing" and report["kernels"]["compiler"] is None
    assert any("no C++ compiler" in n for n in report["notes"])


@pytest.mark.parametrize("field", ["software", "provenance"])
def test_json_results_say_which_path_produced_them(field, make_ckpt):
    """`engine generate --json` and `engine eval --json` record the kernels, the ISA, the dtypes, the experts'
    precision and the KV cache's."""
    path = make_ckpt("qwen3_moe", dtype="bfloat16")
    args = (["generate", "--prompt-ids", "1,2,3", "--max-new-tokens", "2"] if field == "software"
            else ["eval", "--max-prompts", "1", "--hi-precision", "int8", "--kv-dtype", "bfloat16",
                  "--dense-precision", "int8"])
    proc = subprocess.run([*ENGINE_CLI, *args, "--model", str(path), "--json"], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    prov = out if field == "software" else out["provenance"]
    assert prov["cpu_kernels"].startswith("native (") or prov["cpu_kernels"].startswith("torch (")
    assert prov["weight_dtype"] in ("bfloat16", "float32") and prov["compute_dtype"]
    kern = prov["software"]["kernels"]
    assert kern["cpu_kernels"] in ("available", "missing", "broken") and "quant" in kern
    assert prov["hardware"]["cpu_features"] is not None
    if field == "provenance":  # the experts' precision and the KV cache's dtype, as run
        assert (prov["experts"], prov["kv_dtype"], prov["dense"]) == ("int8", "bfloat16", "int8")
    else:
        assert prov["kv_dtype"] == "float32" and prov["experts"]
