"""The live backend: :class:`engine.runtime.Engine` behind the step interface of :mod:`engine.backend`."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from engine.backend import RunStart, RunTail, WallClock
from engine.config import HOTNESS_RESIDENCIES, inert_knobs
from engine.moe.policy.plan import DecisionLog
from engine.precision import dtype_name, precision_of
from engine.results import ExpertStat
from engine.sequences import Sequence, StepOutcome


class LiveBackend:
    """Runs steps through the torch model; ``engine`` may be an :class:`~engine.runtime.Engine` or a
    stand-in that forwards to one."""

    kind = "live"

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._routes: dict[str, list[np.ndarray]] | None = None
        self._log: DecisionLog | None = None

    @property
    def spec(self):
        return self.engine.spec

    @property
    def config(self):
        return self.engine.config

    def model_identity(self) -> dict[str, Any]:
        return self.engine.spec.identity(self.engine.fingerprint)

    def clock(self) -> WallClock:
        return WallClock()

    def start(self, run: RunStart) -> None:
        eng = self.engine
        if run.trace is not None:
            # A trace recorded with another model would mislead every placement decision built on it.
            run.trace.check_model(self.model_identity(), run.source)
            if eng.config.experts.residency in HOTNESS_RESIDENCIES:
                eng.set_hotness(run.trace.hotness())
        if eng.hotness is None:
            eng.warm_up_hotness()  # no-op unless static or dynamic residency needs a profile
        self._log = DecisionLog() if run.decisions else None
        # Each run starts from the initial placement, so its plans and statistics are its own.
        eng.model.reset_plans(self._log)
        eng.model.stats.reset()
        eng.model.record_routes = run.record_routes
        self._routes = {} if run.record_routes else None
        if eng.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(eng.device)

    def add(self, key: str, prompt: list[int], max_new_tokens: int) -> Sequence:
        return self.engine.add(key, prompt, max_new_tokens)

    def abort(self, key: str) -> Sequence | None:
        return self.engine.abort(key)

    @property
    def has_work(self) -> bool:
        return self.engine.has_work

    def step(self) -> StepOutcome:
        out = self.engine.step()
        if self._routes is not None:
            self._collect_routes()
        return out

    def _collect_routes(self) -> None:
        """Split the last step's per-layer expert choices by request."""
        recs = self.engine.model.routes
        if not recs or self._routes is None:
            return
        ids = torch.stack([r.expert_ids for r in recs], dim=1).cpu().numpy().astype(np.int16)  # [T, L, K]
        ws = torch.stack([r.gate_weights for r in recs], dim=1).float().cpu().numpy().astype(np.float16)
        for key, start, n in self.engine.last_token_owners:
            self._routes.setdefault(key, []).append(np.stack([ids[start: start + n], ws[start: start + n]]))

    def reconfigure(self, config) -> float:
        return self.engine.reconfigure(config)

    def describe(self) -> dict[str, Any]:
        eng = self.engine
        hybrid = eng.model.hybrid
        return {
            "backend": self.kind,
            "model": {**eng.ckpt.describe(), "fingerprint": eng.fingerprint, "identity": self.model_identity()},
            "device": str(eng.device),
            "compute_dtype": dtype_name(eng.dtype),
            "weight_dtype": dtype_name(eng.weight_dtype),
            "cpu_kernels": eng.kernels_label,
            # Tiers are distinct only with an accelerator; elsewhere the hybrid code runs on host memory alone.
            "hybrid": eng.device.type == "cuda" and hybrid is not None,
            "inert_knobs": {**inert_knobs(eng.device.type == "cuda"), **(hybrid.inert if hybrid is not None else {})},
        }

    def finish(self) -> RunTail:
        eng = self.engine
        eng.model.record_routes = False
        hybrid = eng.model.hybrid
        if hybrid is not None:
            hybrid.drain()
        routes = None
        if self._routes is not None:
            routes = {k: _stack_routes(v) for k, v in self._routes.items()}
        self._routes = None
        decisions = self._log.entries if self._log is not None else None
        self._log = None
        eng.model.controller.log = None
        peak = int(torch.cuda.max_memory_allocated(eng.device)) if eng.device.type == "cuda" else None
        return RunTail(expert_stats=self.expert_stats(), tiers=hybrid.stats if hybrid is not None else None,
                       fast_tier_expert_bytes=hybrid.fast_bytes() if hybrid is not None else None,
                       routes=routes, decisions=decisions, peak_device_mem_bytes=peak)

    def expert_stats(self) -> list[ExpertStat]:
        """Tokens routed to each expert, and where it lived and in which precision at the end of the run."""
        eng = self.engine
        loaded = precision_of(eng.weight_dtype)
        table = eng.model.hybrid.expert_table() if eng.model.hybrid is not None else {}
        out = []
        for layer, counts in sorted(eng.model.stats.counts.items()):
            for e, n in enumerate(counts.tolist()):
                resident, prec, replicas = table.get((layer, e), (True, loaded, 0))
                out.append(ExpertStat(layer, e, int(n), resident=resident, precision=prec, replicas=replicas))
        return out


def _stack_routes(chunks: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    arr = np.concatenate(chunks, axis=1)  # [2, tokens, L, K]
    return arr[0].astype(np.int16), arr[1].astype(np.float16)
