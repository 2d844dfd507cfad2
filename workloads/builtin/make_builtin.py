"""Regenerate the built-in workloads (``builtin:<name>``) shipped in this directory.

Run ``python workloads/builtin/make_builtin.py`` from the repository root; the output is
deterministic (seeded), so the committed files change only when this script does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workloads.schema import save_workload
from workloads.synth import synth_workload

HERE = Path(__file__).resolve().parent
COMMAND = "python workloads/builtin/make_builtin.py"

BUILTINS: dict[str, dict[str, Any]] = {
    "chat": dict(
        description="Interactive chat mix: Poisson arrivals at 1 req/s, short-to-medium prompts and replies.",
        n_requests=60, arrival="poisson", rate_per_s=1.0, prompt_len="lognormal:128:0.7:32:512",
        output_len="lognormal:48:0.5:16:128", seed=1, tag="chat"),
    "bursty": dict(
        description="Bursty traffic: gamma inter-arrival gaps with CV 3 at a mean 2 req/s.",
        n_requests=80, arrival="gamma", rate_per_s=2.0, cv=3.0, prompt_len="lognormal:128:0.8:16:1024",
        output_len="lognormal:48:0.6:8:256", seed=2, tag="bursty"),
    "offline": dict(
        description="Offline batch: 64 requests all at t=0, for throughput.",
        n_requests=64, arrival="offline", prompt_len="lognormal:256:0.6:32:1024", output_len="uniform:64:128",
        seed=3, tag="offline"),
    "long-prompt": dict(
        description="Long prompts (1k-4k tokens) with short replies, Poisson at 0.5 req/s.",
        n_requests=24, arrival="poisson", rate_per_s=0.5, prompt_len="uniform:1024:4096",
        output_len="lognormal:64:0.5:16:256", seed=4, tag="long-prompt"),
    "quick": dict(
        description="48 short chat turns at 24 req/s: the default `tuner run`, where one capacity probe of the "
                    "small model takes a few seconds on a laptop CPU. 48 requests so that a 90 % attainment "
                    "target tolerates 4 misses (24 requests: 2, and a prefix of 8: none) and a burst of them "
                    "queues past a 1 s TTFT on an idle 2-core CPU.",
        n_requests=48, arrival="poisson", rate_per_s=24.0, prompt_len="lognormal:24:0.5:8:64",
        output_len="lognormal:8:0.5:4:24", seed=6, tag="quick"),
    "tiny": dict(
        description="12 short requests over about 3 s: for tests and the default tuner run on a laptop CPU.",
        n_requests=12, arrival="poisson", rate_per_s=4.0, prompt_len="uniform:8:48", output_len="uniform:4:16",
        seed=5, tag="tiny"),
}


def main() -> None:
    for name, spec in BUILTINS.items():
        spec = dict(spec)
        description = spec.pop("description")
        metadata = {"description": description, "command": COMMAND,
                    "license": "generated data, Apache-2.0 with moetune"}
        workload = synth_workload(name, exact_rate=True, metadata=metadata, **spec)
        save_workload(workload, HERE / name)
        print(f"builtin:{name}: {len(workload)} requests over {workload.duration_s:.1f} s")


if __name__ == "__main__":
    main()
