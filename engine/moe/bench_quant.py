"""Weight-only expert kernels, per precision and tokens per call: us per expert and GB/s of weight bytes.

    python -m engine.moe.bench_quant [--hidden 1024 --inter 384] [--tokens 1,8,32] [--pool-mib 256]

One "expert call" is what the engine runs per expert: gate+up ``[2I, H]``, SiLU-and-multiply, down
``[H, I]``, on fp32 activations (the CPU compute dtype). The pool of distinct experts is sized to exceed
the caches (at least ``--pool-mib`` of weights and 64 experts), so each call streams its weights from
memory, as decode does. Beside each figure: the machine's read bandwidth (a ``sum`` over a buffer of the
pool's size), the limit a streaming kernel can reach. Medians over ``--repeats`` passes; the machine is
shared, so compare rows of one run, not runs. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.moe.quant import QWeight, expert_nbytes, kernel_report, qlinear, quantize


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_s(fn: Callable[[], None], repeats: int, device: torch.device) -> float:
    fn()  # warm-up pass
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def read_gbps(nbytes: int, device: torch.device, repeats: int) -> float:
    """Read bandwidth: ``sum`` over a float32 buffer of ``nbytes``."""
    buf = torch.ones(max(nbytes // 4, 1), device=device)

    def read() -> None:
        buf.sum()

    t = _median_s(read, repeats, device)
    return buf.numel() * 4 / t / 1e9


def make_pool(hidden: int, inter: int, precision: str, group_size: int, pool_bytes: int, device: torch.device,
              distinct: int = 64, seed: int = 0) -> list[tuple[QWeight, QWeight]]:
    """Experts in ``precision`` on ``device``: ``distinct`` quantized ones, cloned until ``pool_bytes``."""
    g = torch.Generator().manual_seed(seed)
    base = []
    for _ in range(distinct):
        w13 = torch.randn(2 * inter, hidden, generator=g) * hidden ** -0.5
        w2 = torch.randn(hidden, inter, generator=g) * inter ** -0.5
        base.append((quantize(w13, precision, group_size).to(device),  # type: ignore[arg-type]
                     quantize(w2, precision, group_size).to(device)))  # type: ignore[arg-type]
    per = expert_nbytes(hidden, inter, precision, group_size)  # type: ignore[arg-type]
    n = max(distinct, -(-pool_bytes // per))
    pool = list(base)
    while len(pool) < n:
        a, b = base[len(pool) % distinct]
        pool.append((_clone(a), _clone(b)))
    return pool


def _clone(q: QWeight) -> QWeight:
    from dataclasses import replace
    return replace(q, data=q.data.clone(), scales=None if q.scales is None else q.scales.clone())


def run(hidden: int = 1024, inter: int = 384, tokens: tuple[int, ...] = (1, 8, 32),
        precisions: tuple[str, ...] = ("fp32", "bf16", "int8", "int4"), group_size: int = 128,
        pool_mib: int = 256, repeats: int = 5, device: str = "cpu", dequant_rows: bool = True) -> dict:
    """Measure; returns the result dict that :func:`main` prints as a table and a JSON line."""
    dev = torch.device(device)
    pool_bytes = pool_mib * 2**20
    rows = []
    for precision in precisions:
        pool = make_pool(hidden, inter, precision, group_size, pool_bytes, dev)
        per = pool[0][0].nbytes() + pool[0][1].nbytes()
        paths = ["kernel", "dequant"] if dequant_rows and precision in ("int8", "int4") else ["kernel"]
        for m in tokens:
            x = torch.randn(m, hidden, device=dev)
            for path in paths:
                def one_pass(x: torch.Tensor = x, path: str = path, pool: list = pool) -> None:
                    for w13, w2 in pool:
                        h = qlinear(x, w13, path)  # type: ignore[arg-type]  # [T, 2I]
                        qlinear(F.silu(h[:, :inter]) * h[:, inter:], w2, path)  # type: ignore[arg-type]

                t = _median_s(one_pass, repeats, dev) / len(pool)
                rows.append({"precision": precision, "kernel": pool[0][0].kernel if path == "kernel" else "dequant",
                             "tokens": m, "us_per_expert": round(t * 1e6, 1),
                             "weight_gb_per_s": round(per / t / 1e9, 2), "bytes_per_expert": per,
                             "pool_experts": len(pool)})
        pool = []  # free before the next precision's pool
    return {"device": str(dev), "threads": torch.get_num_threads(), "hidden": hidden, "inter": inter,
            "group_size": group_size, "pool_mib": pool_mib, "read_gb_per_s": round(read_gbps(pool_bytes, dev, repeats), 1),
            "torch": torch.__version__, "kernels": kernel_report(), "rows": rows}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=384)
    ap.add_argument("--tokens", default="1,8,32", help="tokens per call, comma-separated")
    ap.add_argument("--precisions", default="fp32,bf16,int8,int4")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--pool-mib", type=int, default=256, help="minimum weight bytes per pool (beyond caches)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: PyTorch's)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-dequant-rows", action="store_true", help="skip the dequantise-then-matmul rows")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    res = run(args.hidden, args.inter, tuple(int(t) for t in args.tokens.split(",")),
              tuple(args.precisions.split(",")), args.group_size, args.pool_mib, args.repeats, args.device,
              not args.no_dequant_rows)
    print(f"device {res['device']}, {res['threads']} threads, torch {res['torch']}, expert H={res['hidden']} "
          f"I={res['inter']}, int4 group {res['group_size']}; read bandwidth {res['read_gb_per_s']} GB/s")
    print(f"{'precision':9s} {'kernel':22s} {'tokens':>6s} {'us/expert':>10s} {'GB/s':>7s} {'KiB/expert':>10s} "
          f"{'vs fp32':>7s}")
    fp32 = {r["tokens"]: r["us_per_expert"] for r in res["rows"] if r["precision"] == "fp32"}
    for r in sorted(res["rows"], key=lambda r: (r["tokens"], r["precision"] != "fp32")):
        speedup = f"{fp32[r['tokens']] / r['us_per_expert']:.2f}x" if r["tokens"] in fp32 else ""
        print(f"{r['precision']:9s} {r['kernel']:22s} {r['tokens']:6d} {r['us_per_expert']:10.1f} "
              f"{r['weight_gb_per_s']:7.2f} {r['bytes_per_expert'] / 1024:10.1f} {speedup:>7s}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
