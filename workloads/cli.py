"""The ``workloads`` command: import, synth, transform, show, list-builtin, record, replay.

Bad input ends with one line on stderr (``workloads: error: ...``) and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from workloads import importers, synth
from workloads.errors import WorkloadError
from workloads.replay import ReplayOptions
from workloads.schema import Workload, builtin_names, load_workload, save_workload

EXIT_BAD_INPUT = 2


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line, like every other error of the command."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is less than 1")
    return value


def _nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number > 0")
    return value


def _nonneg_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number >= 0")
    return value


def _int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``workloads`` command."""
    parser = _Parser(prog="workloads", description="Request traces, router traces and built-in workloads for moetune.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("import", help="import a public trace file")
    p.add_argument("--format", required=True, choices=importers.FORMATS)
    p.add_argument("src", metavar="SRC", help="the trace file")
    p.add_argument("--out", required=True, help="workload directory to write")
    p.add_argument("--name", help="workload name (default: the output directory's name)")
    p.add_argument("--limit", type=_positive_int, help="keep the first N usable requests")
    p.add_argument("--max-prompt-len", type=_positive_int, help="clip prompts to this many tokens")
    p.add_argument("--max-output-len", type=_positive_int, help="clip outputs to this many tokens")
    p.add_argument("--keep-failed", action="store_true",
                   help="burstgpt: keep failed requests (0 response tokens) as 1-token requests tagged failed")
    p.add_argument("--tokenizer", metavar="DIR", help="sharegpt: directory with tokenizer.json to count tokens")
    p.add_argument("--rate", type=_positive_float, default=importers.ImportOptions.rate_per_s,
                   help="sharegpt: Poisson arrival rate, req/s")
    p.add_argument("--seed", type=_nonneg_int, default=importers.ImportOptions.seed,
                   help="sharegpt: seed of the arrivals")

    p = sub.add_parser("synth", help="generate a seeded synthetic workload")
    p.add_argument("--out", required=True, help="workload directory to write")
    p.add_argument("--name", help="workload name (default: the output directory's name)")
    p.add_argument("--n-requests", type=_positive_int, default=100)
    p.add_argument("--arrival", choices=synth.ARRIVALS, default="poisson")
    p.add_argument("--rate", type=_positive_float, default=synth.DEFAULT_RATE_PER_S,
                   help="mean arrival rate, req/s (onoff: the rate during on-periods)")
    p.add_argument("--exact-rate", action="store_true",
                   help="poisson/gamma: scale gaps so the sample's mean rate is exactly --rate")
    p.add_argument("--cv", type=_positive_float, default=synth.DEFAULT_CV,
                   help="gamma: coefficient of variation of gaps")
    p.add_argument("--on-s", type=_positive_float, default=synth.DEFAULT_ON_S, help="onoff: seconds of each burst")
    p.add_argument("--off-s", type=_nonneg_float, default=synth.DEFAULT_OFF_S,
                   help="onoff: seconds of silence between bursts")
    p.add_argument("--prompt-len", default=synth.DEFAULT_PROMPT_LEN,
                   help="N | uniform:LO:HI | lognormal:MEDIAN:SIGMA[:LO:HI] | fit:W")
    p.add_argument("--output-len", default=synth.DEFAULT_OUTPUT_LEN,
                   help="N | uniform:LO:HI | lognormal:MEDIAN:SIGMA[:LO:HI] | fit:W")
    p.add_argument("--tag", help="tag every request")
    p.add_argument("--seed", type=_nonneg_int, default=0)
    g = p.add_argument_group("synthetic router trace (for the simulator; give --n-layers, --n-experts, --top-k)")
    g.add_argument("--n-layers", type=_positive_int)
    g.add_argument("--n-experts", type=_positive_int)
    g.add_argument("--top-k", type=_positive_int)
    g.add_argument("--moe-layers", type=_int_list, help="comma-separated MoE layer indices (default: all)")
    defaults = synth.ROUTER_DEFAULTS
    g.add_argument("--hidden-size", type=_nonneg_int, default=defaults["hidden_size"])
    g.add_argument("--skew", type=_nonneg_float, default=defaults["skew"], help="Zipf exponent of expert popularity")
    g.add_argument("--drift", type=_nonneg_float, default=defaults["drift"],
                   help="std of the logit step per drift window")
    g.add_argument("--drift-window-tokens", type=_positive_int, default=defaults["drift_window_tokens"])
    g.add_argument("--layer-corr", type=_nonneg_float, default=defaults["layer_corr"],
                   help="probability that a token follows its previous layer's expert rank (0..1)")

    p = sub.add_parser("transform", help="rescale, window, sample or clip a workload")
    p.add_argument("workload", metavar="W", help="workload path or builtin:NAME")
    p.add_argument("--out", required=True, help="workload directory to write")
    p.add_argument("--name", help="workload name (default: the output directory's name)")
    p.add_argument("--window", metavar="A:B", help="keep arrivals in [A, B) seconds, moved to start at 0")
    p.add_argument("--sample", type=_positive_int, metavar="N", help="keep a seeded random N requests")
    p.add_argument("--seed", type=_nonneg_int, default=0)
    p.add_argument("--rate-scale", type=_positive_float, metavar="X", help="divide arrival times by X")
    p.add_argument("--max-prompt-len", type=_positive_int)
    p.add_argument("--max-output-len", type=_positive_int)

    p = sub.add_parser("show", help="statistics of a workload")
    p.add_argument("workload", metavar="W", help="workload path or builtin:NAME")
    p.add_argument("--json", action="store_true", help="end with one line of JSON")
    p.add_argument("--window-tokens", type=_positive_int, help="token window for router drift (default: 1/8)")

    p = sub.add_parser("list-builtin", help="list the built-in workloads")
    p.add_argument("--json", action="store_true", help="end with one line of JSON")

    p = sub.add_parser("record", help="run the engine over a workload and store its router trace")
    p.add_argument("--model", required=True, help="model directory (Hugging Face layout)")
    p.add_argument("--workload", required=True, help="workload path or builtin:NAME")
    p.add_argument("--out", required=True, help="workload directory to write")
    p.add_argument("--max-requests", type=_positive_int, help="record only the first N requests")

    p = sub.add_parser("replay", help="replay a workload against an OpenAI-compatible server, measured as "
                       "`engine run` measures")
    p.add_argument("--url", required=True, help="the server's OpenAI API base, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--workload", required=True, help="workload path or builtin:NAME")
    p.add_argument("--model", help="model id to ask for (default: the first of the server's /v1/models)")
    p.add_argument("--mode", choices=["realtime", "offline"], default=ReplayOptions.mode,
                   help="realtime: each request at its arrival time; offline: all at t=0")
    p.add_argument("--rate-scale", type=_positive_float, default=ReplayOptions.rate_scale, metavar="X",
                   help="divide arrival times by X")
    p.add_argument("--max-requests", type=_positive_int, help="replay the first N requests")
    p.add_argument("--prompts", choices=["auto", "ids", "text"], default=ReplayOptions.prompts,
                   help="token ids or text of the recorded length (auto: ids where the server takes them)")
    p.add_argument("--tokenizer", metavar="DIR", help="the model's tokenizer.json directory, for text prompts")
    p.add_argument("--vocab-size", type=_positive_int,
                   help="the model's vocabulary, for token-id prompts (moetune servers report it)")
    p.add_argument("--seed", type=_nonneg_int,
                   help="seed of the synthetic prompt ids (default: the server's runtime.seed, else the knob's)")
    p.add_argument("--stop-at-eos", action="store_true",
                   help="do not send ignore_eos (for servers that reject it); outputs may end early")
    p.add_argument("--api-key", help="sent as Authorization: Bearer (default: $MOETUNE_API_KEY)")
    p.add_argument("--db", help="store the run in this results database (default: $MOETUNE_DB; neither: "
                   "not stored)")
    p.add_argument("--study", help="study name in the database (default: http-<model>-<workload>)")
    p.add_argument("--slo", action="append", default=[], metavar="NAME=VALUE",
                   help="SLO bound for the stored attainment and goodput (as tuner run --slo)")
    p.add_argument("--out", help="write the full result JSON here")
    p.add_argument("--json", action="store_true", help="end with one line of JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def _with_command(metadata: dict[str, Any], command: str) -> dict[str, Any]:
    out = dict(metadata)
    if "command" in out:
        out["history"] = [*out.get("history", []), out["command"]]
    out["command"] = command
    return out


def _summary(workload: Workload) -> str:
    rate = workload.rate_per_s
    rate_text = f"{rate:.3g} req/s" if rate is not None else "all at t=0"
    trace = workload.router_trace
    trace_text = f", router trace of {trace.n_tokens} tokens" if trace is not None else ""
    return (f"{len(workload)} requests over {workload.duration_s:.2f} s ({rate_text}), prompts "
            f"{workload.total_prompt_tokens} tokens, outputs {workload.total_output_tokens} tokens{trace_text}")


def _write(workload: Workload, out: str) -> None:
    path = save_workload(workload, out)
    print(f"wrote {path}: {_summary(workload)}")


def _cmd_import(args: argparse.Namespace, command: str) -> None:
    options = importers.ImportOptions(limit=args.limit, max_prompt_len=args.max_prompt_len,
                            max_output_len=args.max_output_len, keep_failed=args.keep_failed,
                            tokenizer_dir=args.tokenizer, rate_per_s=args.rate, seed=args.seed)
    workload = importers.import_trace(args.format, args.src, options, name=args.name or Path(args.out).stem)
    workload = Workload(workload.name, workload.requests, _with_command(workload.metadata, command))
    for reason, count in workload.metadata["dropped"].items():
        print(f"dropped {count} rows: {reason.replace('_', ' ')}")
    for what, count in workload.metadata["clipped"].items():
        print(f"clipped {count} {what} lengths")
    _write(workload, args.out)


def _cmd_synth(args: argparse.Namespace, command: str) -> None:
    router_args = (args.n_layers, args.n_experts, args.top_k)
    if any(v is not None for v in router_args) and any(v is None for v in router_args):
        raise WorkloadError("synth: a router trace needs all of --n-layers, --n-experts and --top-k")
    workload = synth.synth_workload(args.name or Path(args.out).stem, args.n_requests, arrival=args.arrival,
                              rate_per_s=args.rate, cv=args.cv, on_s=args.on_s, off_s=args.off_s,
                              prompt_len=args.prompt_len, output_len=args.output_len, seed=args.seed,
                              tag=args.tag, exact_rate=args.exact_rate, metadata={"command": command})
    if args.n_layers is not None:
        trace = synth.synth_router_trace(workload.requests, n_layers=args.n_layers, n_experts=args.n_experts,
                                   top_k=args.top_k, moe_layers=args.moe_layers, hidden_size=args.hidden_size,
                                   skew=args.skew, drift=args.drift, drift_window_tokens=args.drift_window_tokens,
                                   layer_corr=args.layer_corr, seed=args.seed)
        workload = workload.with_router_trace(trace)
    _write(workload, args.out)


def _cmd_transform(args: argparse.Namespace, command: str) -> None:
    from workloads.transform import apply_transforms, parse_window

    if all(v is None for v in (args.window, args.sample, args.rate_scale, args.max_prompt_len, args.max_output_len)):
        raise WorkloadError("transform: nothing to do (give --rate-scale, --window, --sample, --max-prompt-len "
                            "or --max-output-len)")
    window_s = parse_window(args.window) if args.window is not None else None
    workload = load_workload(args.workload)
    workload = apply_transforms(workload, window_s=window_s, sample_n=args.sample, seed=args.seed,
                                rate_scale_factor=args.rate_scale, max_prompt_len=args.max_prompt_len,
                                max_output_len=args.max_output_len)
    name = args.name or Path(args.out).stem
    workload = Workload(name, workload.requests, _with_command(workload.metadata, command), workload.router_trace)
    _write(workload, args.out)


def _cmd_show(args: argparse.Namespace, command: str) -> None:
    from workloads.show import format_stats, workload_stats

    stats = workload_stats(load_workload(args.workload), window_tokens=args.window_tokens)
    print(format_stats(stats))
    if args.json:
        print(json.dumps(stats, separators=(",", ":")))


def _cmd_list_builtin(args: argparse.Namespace, command: str) -> None:
    rows = []
    for name in builtin_names():
        workload = load_workload(f"builtin:{name}")
        rows.append({"name": f"builtin:{name}", "n_requests": len(workload), "duration_s": workload.duration_s,
                     "rate_per_s": workload.rate_per_s,
                     "description": workload.metadata.get("description", "")})
        print(f"builtin:{name:<14}{_summary(workload)}")
        if rows[-1]["description"]:
            print(f"{'':<22}{rows[-1]['description']}")
    if args.json:
        print(json.dumps(rows, separators=(",", ":")))


def _cmd_record(args: argparse.Namespace, command: str) -> None:
    from workloads.record import record_workload

    try:  # the command wires the engine in; the workloads library never imports it
        from engine.runner import record_router_trace
    except ImportError as e:
        raise WorkloadError(f"recording needs the engine (engine.runner.record_router_trace): {e}") from None
    workload = load_workload(args.workload)
    recorded = record_workload(args.model, workload, lambda w: record_router_trace(args.model, w),
                               max_requests=args.max_requests)
    recorded = recorded.with_router_trace(recorded.router_trace, metadata=_with_command(recorded.metadata, command))
    _write(recorded, args.out)


def _cmd_replay(args: argparse.Namespace, command: str) -> None:
    from tqdm import tqdm

    from engine.env import api_key, db_url
    from workloads.replay import record_replay, replay

    workload = load_workload(args.workload)
    options = ReplayOptions(mode=args.mode, rate_scale=args.rate_scale, max_requests=args.max_requests,
                            prompts=args.prompts, tokenizer_dir=args.tokenizer, vocab_size=args.vocab_size,
                            seed=args.seed, ignore_eos=not args.stop_at_eos, api_key=args.api_key or api_key())
    slo = {}
    if args.slo:
        from tuner.slo import parse_slo

        slo = parse_slo(args.slo).to_dict()
    total = min(len(workload), args.max_requests or len(workload))
    with tqdm(total=total, desc="requests", unit="req", disable=args.quiet or not sys.stderr.isatty()) as bar:
        result = replay(args.url, workload, args.model, options, on_done=lambda: bar.update(1))
    s = result.summary()
    meta = result.meta
    print(f"server {meta['server']['url']} model {meta['server']['model']}"
          + (f" (config {meta['config_hash']})" if meta.get("config_hash") else "")
          + f"; workload {workload.name} ({args.mode}, x{args.rate_scale:g}); prompts as {meta['prompts']['format']}; "
          f"{s['requests_done']}/{s['requests']} requests in {s['duration_s']:.1f}s")
    print(_table([{"metric": m, **{f"p{q}": s.get(f"{m}_p{q}") for q in (50, 90, 99)}, "mean": s.get(f"{m}_mean")}
                  for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")]))
    print(f"output {s['output_tokens_per_s']:.1f} tok/s, {s['requests_per_s']:.2f} req/s, "
          f"{s['prompt_tokens']} prompt and {s['output_tokens']} output tokens")
    for key, what in (("prompt_length_mismatch", "prompt lengths differ from the workload's"),
                      ("output_length_mismatch", "output lengths differ from the workload's"),
                      ("errors", "requests failed")):
        if meta[key]:
            first = next(iter(meta[key].items()))
            print(f"warning: {len(meta[key])} {what} (first: {first[0]}: {first[1]})")
    url = args.db or db_url()
    if url:
        study, trial_id = record_replay(url, result, workload, args.workload, args.study, slo)
        print(f"stored as trial {trial_id} of study {study}")
    full = result.to_dict()
    if args.out:
        Path(args.out).write_text(json.dumps(full))
        print(f"wrote {args.out}")
    if args.json:
        print(json.dumps(full, separators=(",", ":")))


def _table(rows: list[dict[str, Any]]) -> str:
    cols = ["metric", "p50", "p90", "p99", "mean"]
    cells = [[r["metric"]] + ["-" if r[c] is None else f"{r[c]:.1f}" for c in cols[1:]] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in [cols, *cells])


COMMANDS = {"import": _cmd_import, "synth": _cmd_synth, "transform": _cmd_transform, "show": _cmd_show,
            "list-builtin": _cmd_list_builtin, "record": _cmd_record, "replay": _cmd_replay}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``workloads`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="workloads: %(message)s")
    command = shlex.join(["workloads", *argv])
    try:
        COMMANDS[args.command](args, command)
    except WorkloadError as e:
        return _fail(str(e))
    except OSError as e:
        return _fail(f"{e.filename}: {e.strerror}" if e.filename else str(e))
    except ValueError as e:  # e.g. the engine's config or checkpoint errors while recording
        return _fail(str(e))
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    return 0


def _fail(message: str, status: int = EXIT_BAD_INPUT) -> int:
    print(f"workloads: error: {' '.join(message.split())}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
