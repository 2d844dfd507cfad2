"""Read bandwidth of the native kernels' products at a few tokens (decode), for A/B between builds.

    python scripts/kernel_ops_bench.py [--lib A.so --lib B.so] [--precision bf16|int8|int4] [--group 128]
                                       [--mode f32|q8|q16|bf16dp|tile] [--threads 2] [--tokens 1] [--rounds 5]

Each library (default: the one this tree builds, `engine.kernels.load()`) is measured in its own process,
the processes interleaved A B A B ... so that the shared machine's drift hits them alike. A process times
the products of bf16 weights in the fp32 mode (or int8 weights with a scale per row, or int4 weights in the
native layout with group scales, in the q8 mode; ``--mode`` names another, e.g. bf16dp, on the library's
best ISA variant) as decode runs them: a 32000x512 lm head, a 768x512 projection
(64 copies), and one fused MoE layer of the small (4 of 32 experts, 512/320) and medium (8 of 64,
1024/384) presets, the weights rotating over copies so that they come from memory. Prints a table of
medians (min-max) in GB/s per library, then one JSON line. The bytes counted are the weights' and their
scales', as stored.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time

ROW = "--one"


def default_mode(precision: str) -> str:
    return "f32" if precision == "bf16" else "q8"


def one(lib: str, threads: int, tokens: int, precision: str = "bf16", group: int = 128,
        mode: str | None = None) -> dict[str, float]:
    """GB/s of each product with library ``lib`` (this process)."""
    import torch

    torch.ops.load_library(lib)
    ops = torch.ops.moetune
    torch.set_num_threads(threads)
    path = f"{ops.isa()}:{mode or default_mode(precision)}"
    g = torch.Generator().manual_seed(0)

    def weight(n: int, k: int, group: int = group) -> tuple[torch.Tensor, torch.Tensor | None, float]:
        """A [n, k] weight in ``precision`` as the kernels read it: (data, scales, bytes)."""
        w = torch.randn(n, k, generator=g) * 0.05
        if precision == "bf16":
            return w.to(torch.bfloat16), None, n * k * 2
        if precision == "int8":
            q, s = ops.quantize_int8(w)
            return q, s, q.numel() + s.numel() * s.element_size()
        n_pad = -(-n // 16) * 16
        q, s = ops.quantize_int4(w, group, n_pad, "native")
        return q, s, q.numel() + s.numel() * s.element_size()

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

    def linear(ws: list[tuple[torch.Tensor, torch.Tensor | None, float]], n: int):
        return lambda i: ops.linear_q(x, ws[i % len(ws)][0], ws[i % len(ws)][1], group if precision == "int4" else 0,
                                      n, path, None)

    out: dict[str, float] = {}
    x = torch.randn(tokens, 512, generator=g)
    lm = [weight(32000, 512) for _ in range(2)]
    out["lm_head 32000x512"] = gbps(linear(lm, 32000), lm[0][2])
    proj = [weight(768, 512) for _ in range(64)]
    out["proj 768x512"] = gbps(linear(proj, 768), proj[0][2])
    for name, n_exp, k, hidden, inter, copies in (("moe small", 32, 4, 512, 320, 8), ("moe medium", 64, 8, 1024, 384, 3)):
        xs = torch.randn(tokens, hidden, generator=g)
        grp = math.gcd(group, hidden, inter)  # one group size per call (the small preset's 320: 64)
        w13 = [[weight(2 * inter, hidden, grp) for _ in range(n_exp)] for _ in range(copies)]
        w2 = [[weight(hidden, inter, grp) for _ in range(n_exp)] for _ in range(copies)]
        ids = routes(n_exp, k)
        gates = torch.full((tokens, k), 1.0 / k)
        nbytes = touched(ids) * (w13[0][0][2] + w2[0][0][2])
        if precision == "bf16":  # the stacked form, as the engine passes bf16 experts
            s13 = [torch.stack([w for w, _, _ in c]) for c in w13]
            s2 = [torch.stack([w for w, _, _ in c]) for c in w2]

            def fn(i, s13=s13, s2=s2, ids=ids, xs=xs, gates=gates, c=copies):
                return ops.moe(xs, s13[i % c], s2[i % c], ids[i % 64], gates, path)
        else:
            lists = [([w for w, _, _ in a], [s for _, s, _ in a], [w for w, _, _ in b], [s for _, s, _ in b])
                     for a, b in zip(w13, w2, strict=True)]

            def fn(i, lists=lists, ids=ids, xs=xs, gates=gates, c=copies, grp=grp if precision == "int4" else 0):
                return ops.moe_q(xs, *lists[i % c], ids[i % 64], gates, grp, path)
        out[name] = gbps(fn, nbytes)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lib", action="append", help="a built moetune_kernels.so (repeat for A/B; default: this tree's)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--precision", choices=("bf16", "int8", "int4"), default="bf16",
                   help="the weights' precision: bf16 in the fp32 mode, int8 or int4 in the q8 mode")
    p.add_argument("--group", type=int, default=128, help="int4 group size")
    p.add_argument("--mode", choices=("f32", "q8", "q16", "bf16dp", "tile"), help="arithmetic mode (default: f32 for bf16, "
                   "else q8)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(ROW, action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args.lib[0], args.threads, args.tokens, args.precision, args.group, args.mode)))
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
                   str(args.tokens), "--precision", args.precision, "--group", str(args.group)]
            cmd += ["--mode", args.mode] if args.mode else []
            res = subprocess.run(cmd, capture_output=True, text=True, check=True)
            runs[lib].append(json.loads(res.stdout.strip().splitlines()[-1]))
    summary = {lib: {op: {"median_gb_per_s": statistics.median(r[op] for r in rs), "min": min(r[op] for r in rs),
                          "max": max(r[op] for r in rs)} for op in rs[0]} for lib, rs in runs.items()}
    mode = args.mode or default_mode(args.precision)
    print(f"GB/s read, {args.precision} weights ({mode} mode), {args.threads} "
          f"threads, {args.tokens} token(s), median (min-max) of {args.rounds} interleaved runs")
    ops_ = list(next(iter(summary.values())))
    print("library".ljust(30) + "".join(op.rjust(24) for op in ops_))
    for lib, s in summary.items():
        label = "/".join(lib.split("/")[-2:])[-30:]
        print(label.ljust(30) + "".join(f"{s[op]['median_gb_per_s']:.1f} ({s[op]['min']:.1f}-{s[op]['max']:.1f})".rjust(24)
                                        for op in ops_))
    print(json.dumps({"precision": args.precision, "mode": mode, "group": args.group, "threads": args.threads,
                      "tokens": args.tokens,
                      "rounds": args.rounds, "libraries": summary}))


if __name__ == "__main__":
    main()
