"""``engine bench --backend sim``: prefill and decode tokens/s per batch size, simulated on a profile.

For each batch size B, B requests of ``prompt_len`` tokens arrive at once and generate
``new_tokens`` each; steps that prefill count toward prefill tokens/s, decode-only steps toward
decode tokens/s (the live bench's split), on the profile's virtual clock.
"""

from __future__ import annotations

from typing import Any


def sim_bench(backend: Any, batches: list[int], prompt_len: int, new_tokens: int) -> dict[str, Any]:
    from engine.runner import run_workload
    from workloads import Request, Workload

    rows = []
    for b in batches:
        wl = Workload(f"bench-{b}", [Request(f"b{i}", 0.0, prompt_len, new_tokens) for i in range(b)], {})
        res = run_workload(backend, wl, mode="offline")
        pre = [s for s in res.steps if s.prefill_tokens > 0]
        dec = [s for s in res.steps if s.prefill_tokens == 0]
        pre_s = sum(s.duration_ms for s in pre) / 1e3
        dec_s = sum(s.duration_ms for s in dec) / 1e3
        row = {"batch": b,
               "prefill_tokens_per_s": sum(s.prefill_tokens for s in pre) / pre_s if pre_s else None,
               "decode_tokens_per_s": sum(s.decode_tokens for s in dec) / dec_s if dec_s else None,
               "decode_step_ms": 1e3 * dec_s / len(dec) if dec else None}
        ep = res.meta.get("ep")
        if ep and dec:  # the live bench's expert-parallel columns, over the decode steps
            per_rank = [s["tokens_per_rank"] for s, r in zip(ep["steps"], res.steps, strict=True)
                        if r.prefill_tokens == 0]
            row.update(ep_tokens_per_rank=[int(sum(col)) for col in zip(*per_rank, strict=True)],
                       ep_step_imbalance=sum(s.ep_imbalance for s in dec) / len(dec),
                       ep_bytes_combined_per_step=sum(s.ep_bytes_combined for s in dec) / len(dec))
        rows.append(row)
    d = backend.describe()
    return {"backend": "sim", "model": d["model"]["path"], "profile": d["profile"], "calibrated": d["calibrated"],
            "device": d["device"], "compute_dtype": d["compute_dtype"], "prompt_len": prompt_len,
            "new_tokens": new_tokens, "rows": rows}
