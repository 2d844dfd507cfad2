"""Read bandwidth of the native kernels' products at a few tokens (decode), for A/B between builds.

    python scripts/kernel_ops_bench.py [--lib A.so --lib B.so] [--threads 2] [--tokens 1] [--rounds 5]

Each library (default: the one this tree builds, `engine.kernels.load()`) is measured in its own process,
the processes interleaved A B A B ... so that the shared machine's drift hits them alike. A process times
the fp32-mode products of bf16 weights as decode runs them: a 32000x512 lm head, a 768x512 projection
(64 copies), and one fused MoE layer of the small (4 of 32 experts, 512/320) and medium (8 of 64,
1024/384) presets, the weights rotating over copies so that they come from memory. Prints a table of
medians (min-max) in GB/s per library, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

ROW = "--one"


def one(lib: str, threads: int, tokens: int) -> dict[str, float]:
    """GB/s of each product with library ``lib`` (this process)."""
    import torch

    torch.ops.load_library(lib)
    ops = torch.ops.moetune
    torch.set_num_threads(threads)
    path = f"{ops.isa()}:f32"
    g = torch.Generator().manual_seed(0)

    def bf(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    def gbps(fn, nbytes: float, calls: int = 120) -> float:
        fn(0)
        ts = []
        for i in range(calls):
            t = time.perf_counter()
            fn(i)
            ts.append(time.perf_counter() - t)
        return nbytes / statistics.median(ts) / 1e9

    def routes(n_experts: int, k: int, copies: int = 64) -> list[torch.Tensor]:
        return [torch.stack([torch.randperm(n_experts, generator=g)[:k] for _ in range(tokens)]) for _ in range(copies)]

    def touched(ids: list[torch.Tensor]) -> float:
        return sum(len(set(r.flatten().tolist())) for r in ids) / len(ids)

    out: dict[str, float] = {}
    x = torch.randn(tokens, 512, generator=g)
    lm = [bf(32000, 512) for _ in range(2)]
    out["lm_head 32000x512"] = gbps(lambda i: ops.linear_q(x, lm[i % 2], None, 0, 0, path, None), 32000 * 512 * 2)
    proj = [bf(768, 512) for _ in range(64)]
    out["proj 768x512"] = gbps(lambda i: ops.linear_q(x, proj[i % 64], None, 0, 0, path, None), 768 * 512 * 2)
    for name, n_exp, k, hidden, inter, copies in (("moe small", 32, 4, 512, 320, 8), ("moe medium", 64, 8, 1024, 384, 3)):
        xs = torch.randn(tokens, hidden, generator=g)
        w13 = [bf(n_exp, 2 * inter, hidden) for _ in range(copies)]
        w2 = [bf(n_exp, hidden, inter) for _ in range(copies)]
        ids = routes(n_exp, k)
        gates = torch.full((tokens, k), 1.0 / k)
        nbytes = touched(ids) * 3 * hidden * inter * 2
        out[name] = gbps(lambda i, w13=w13, w2=w2, ids=ids, xs=xs, gates=gates, c=copies:
                         ops.moe(xs, w13[i % c], w2[i % c], ids[i % 64], gates, path), nbytes)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lib", action="append", help="a built moetune_kernels.so (repeat for A/B; default: this tree's)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(ROW, action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args.lib[0], args.threads, args.tokens)))
        return
    if not args.lib:
        from engine import kernels

        if kernels.load() is None:
            sys.exit(f"kernel_ops_bench: the native kernels did not build: {kernels.status()['error']}")
        args.lib = [kernels.status()["library"]]
    runs: dict[str, list[dict[str, float]]] = {lib: [] for lib in args.lib}
    for _ in range(args.rounds):
        for lib in args.lib:
            cmd = [sys.executable, __file__, ROW, "--lib", lib, "--threads", str(args.threads), "--tokens",
                   str(args.tokens)]
            res = subprocess.run(cmd, capture_output=True, text=True, check=True)
            runs[lib].append(json.loads(res.stdout.strip().splitlines()[-1]))
    summary = {lib: {op: {"median_gb_per_s": statistics.median(r[op] for r in rs), "min": min(r[op] for r in rs),
                          "max": max(r[op] for r in rs)} for op in rs[0]} for lib, rs in runs.items()}
    print(f"GB/s read, {args.threads} threads, {args.tokens} token(s), median (min-max) of {args.rounds} interleaved runs")
    ops_ = list(next(iter(summary.values())))
    print("library".ljust(30) + "".join(op.rjust(24) for op in ops_))
    for lib, s in summary.items():
        label = "/".join(lib.split("/")[-2:])[-30:]
        print(label.ljust(30) + "".join(f"{s[op]['median_gb_per_s']:.1f} ({s[op]['min']:.1f}-{s[op]['max']:.1f})".rjust(24)
                                        for op in ops_))
    print(json.dumps({"threads": args.threads, "tokens": args.tokens, "rounds": args.rounds, "libraries": summary}))


if __name__ == "__main__":
    main()
