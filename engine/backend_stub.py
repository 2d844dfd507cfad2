"""The stub backend: the live engine's scheduler and expert plans, with no tensors.

Each step is laid out by the same :class:`~engine.sequences.SequenceTable` (so the same tokens run
in the same steps), each token's experts are read from a router trace (the request's next rows,
token by token), pruned by the same :func:`~engine.moe.policy.routing.prune_routes`, and planned
by the same :class:`~engine.moe.policy.controller.ResidencyController` the live executor runs.
Its decision log and its tier statistics are therefore the live engine's for the same workload
and trace; that is what ``tests/engine/test_backend_parity.py`` checks. It is the seed of the
simulator: it prices nothing yet (every step takes 0 s on its virtual clock) and produces no
tokens (each output token id is -1), so it needs ``sampling.ignore_eos`` (no end-of-sequence token
can be seen).

No torch: :meth:`StubBackend.from_checkpoint` reads a checkpoint's config and router fingerprint
(that needs the checkpoint loader), the constructor takes a model spec and identity directly.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.backend import RunStart, RunTail, VirtualClock
from engine.config import HOTNESS_RESIDENCIES, ConfigError, EngineConfig, departures_from_plain
from engine.model.arch import ModelSpec
from engine.moe.planning import plan_settings, tier_precisions
from engine.moe.policy.controller import ResidencyController
from engine.moe.policy.execution import CostModel
from engine.moe.policy.plan import DecisionLog, LayerDecision, MoEStats, StepMoves, counts_by_layer
from engine.moe.policy.routing import prune_routes
from engine.precision import FLOAT_PRECISIONS, PRECISIONS
from engine.results import ExpertStat, ExpertStats
from engine.sequences import Sequence, SequenceTable, StepLayout, StepOutcome

if TYPE_CHECKING:
    from workloads.router import RouterTrace

NO_TOKEN = -1
"""The token id the stub reports for every generated token (it computes no logits)."""


class StubBackend:
    """See the module docstring. ``weight_precision``: the precision the experts are loaded in (the
    live engine's ``weight_dtype``; ``hi_precision="auto"`` keeps it). ``trace``: route from this
    trace instead of the workload's (static and dynamic residency still take their hotness from the
    workload's trace when it has one, as the live engine does). ``cost_model``: the costs
    ``missing_expert="auto"`` decides by."""

    kind = "stub"
    allow_synthetic = False
    """Whether a synthetic router trace (``workloads synth``) may route a real model's tokens."""

    def __init__(self, spec: ModelSpec, config: EngineConfig | None, *, identity: dict[str, Any],
                 weight_precision: str, trace: RouterTrace | None = None, cost_model: CostModel | None = None,
                 describe_model: dict[str, Any] | None = None) -> None:
        if weight_precision not in PRECISIONS:
            raise ConfigError(f"{self.kind} backend: weight_precision={weight_precision!r}: must be one of "
                              f"{', '.join(PRECISIONS)}")
        self._spec = spec
        self._identity = dict(identity)
        self._describe_model = describe_model or {"arch": spec.arch}
        self.weight_precision = weight_precision
        self.cost_model = cost_model
        self._given_trace = trace
        self._config = EngineConfig()
        self._apply(config or EngineConfig())

    @classmethod
    def from_checkpoint(cls, model: str | Path, config: EngineConfig | None = None, *,
                        weight_precision: str | None = None, **options: Any) -> StubBackend:
        """A stub for a checkpoint (its config and router fingerprint are read, no weights).
        ``weight_precision`` defaults to what the config asks for: the compute dtype, or the stored
        half precision that native kernels read (``runtime.compute_dtype`` must then not be ``auto``,
        which the live engine decides by measuring this machine)."""
        from engine.model.checkpoint import Checkpoint
        from engine.model.maker import resolve_model
        from engine.precision import precision_of

        cfg = config or EngineConfig()
        ckpt = Checkpoint(resolve_model(str(model)))
        if weight_precision is None:
            rt = cfg.runtime
            stored = precision_of(ckpt.dtype)
            if rt.compute_dtype == "auto":
                raise ConfigError("stub backend: runtime.compute_dtype='auto' is decided by measuring a machine; "
                                  "give runtime.compute_dtype or the stub's weight_precision")
            compute = stored if rt.compute_dtype == "checkpoint" else precision_of(rt.compute_dtype)
            native = compute == "fp32" and stored in ("bf16", "fp16") and rt.cpu_kernels != "torch"
            weight_precision = stored if native else compute
        fingerprint = ckpt.fingerprint()
        return cls(ckpt.spec, cfg, identity=ckpt.spec.identity(fingerprint), weight_precision=weight_precision,
                   describe_model={**ckpt.describe(), "fingerprint": fingerprint,
                                   "identity": ckpt.spec.identity(fingerprint)}, **options)

    # ------------------------------------------------------------------ protocol
    @property
    def spec(self) -> ModelSpec:
        return self._spec

    @property
    def config(self) -> EngineConfig:
        return self._config

    def model_identity(self) -> dict[str, Any]:
        return dict(self._identity)

    def clock(self) -> VirtualClock:
        return VirtualClock()

    def _apply(self, config: EngineConfig, device_mem_bytes: int | None = None) -> None:
        who = f"{self.kind} backend"
        config.validate()
        config.validate_for(self._spec, device_mem_bytes, source=who)
        if not config.sampling.ignore_eos:
            raise ConfigError(f"{who}: sampling.ignore_eos=false needs the model's tokens; the {self.kind} backend "
                              "computes none (output lengths come from the workload)")
        if config.routing.top_k_override > self._spec.top_k:
            raise ConfigError(f"{who}: routing.top_k_override={config.routing.top_k_override} routes to more "
                              f"experts than a router trace holds (the model's top_k={self._spec.top_k})")
        self._config = config
        self.settings = plan_settings(config, self._spec, self.weight_precision)
        self.plain = not departures_from_plain(config)  # the live engine runs no hybrid executor then
        self.seqs = SequenceTable(config.scheduler, self._spec.vocab_size)
        self.stats = MoEStats()
        self.controller = ResidencyController(self.settings)
        self.hotness: np.ndarray | None = None
        self._trace: Any = None
        self._cursor: dict[str, int] = {}
        self._log: DecisionLog | None = None
        self._routes: dict[str, list[tuple[np.ndarray, np.ndarray]]] | None = None

    def reconfigure(self, config: EngineConfig) -> float:
        self._apply(config)
        return 0.0

    def _routing(self, run: RunStart) -> Any:
        """Where the run's tokens take their experts from: the given trace, else the workload's."""
        trace = self._given_trace if self._given_trace is not None else run.trace
        if trace is None:
            raise ConfigError(f"{self.kind} backend: {run.source} has no router trace to route its tokens from "
                              "(record one with `workloads record`)")
        trace.check_model(self._identity, f"the {self.kind} backend's router trace" if trace is self._given_trace
                          else run.source, allow_synthetic=self.allow_synthetic)
        return trace

    def _decision_costs(self) -> CostModel | None:
        """The costs ``missing_expert="auto"`` decides by (None where nothing is missing)."""
        r, x = self._config.experts, self._config.execution
        if x.missing_expert != "auto" or r.residency == "all":
            return None
        if self.cost_model is None:
            raise ConfigError(f"{self.kind} backend: execution.missing_expert='auto' needs calibrated costs (the "
                              "stub's cost_model); without them use missing_expert host or fetch")
        return self.cost_model

    def start(self, run: RunStart) -> None:
        trace = self._routing(run)
        if run.trace is not None and run.trace is not trace:
            run.trace.check_model(self._identity, run.source, allow_synthetic=self.allow_synthetic)
        self._trace = trace
        self._cursor = {}
        r = self._config.experts
        # Hotness as the live engine takes it: from the workload's trace (else from the routing trace).
        profile = run.trace if run.trace is not None else trace
        self.hotness = profile.hotness() if r.residency in HOTNESS_RESIDENCIES else None
        cost = self._decision_costs()
        self._log = DecisionLog() if run.decisions else None
        self.controller = ResidencyController(self.settings, self.hotness, cost, self._log)
        self.stats.reset()
        self._routes = {} if run.record_routes else None

    def add(self, key: str, prompt: list[int], max_new_tokens: int) -> Sequence:
        return self.seqs.add(key, prompt, max_new_tokens)

    def abort(self, key: str) -> Sequence | None:
        return self.seqs.abort(key)

    @property
    def has_work(self) -> bool:
        return self.seqs.has_work

    def step(self) -> StepOutcome:
        layout = self.seqs.next_step()
        if not layout.segments:
            return StepOutcome(0.0, 0, 0, 0, [], [])
        ctl = self.controller
        ids: np.ndarray | None = None
        if self._routes is None and not ctl.reads_ids(layout.n_tokens) and not self._price_reads_ids():
            # Nothing this step reads the routed ids themselves: their counts per expert are enough.
            decisions, counts = ctl.plan_step(None, self._counts(layout.owners), layout.n_tokens)
        else:
            ids = self._routed_ids(layout.owners)  # [T, L, K]
            decisions, counts = ctl.plan_step(ids)
        self.stats.add_step(self._spec.moe_layers, counts)
        moves = ctl.end_step(counts if ctl.wants_step_counts else None, layout.n_tokens)
        produced, finished = self.seqs.finish_step(layout, [NO_TOKEN] * len(layout.sampled), (), True)
        duration_s = self._price(layout, decisions, moves, counts, ids)
        for seq in finished:
            self._finished(seq.key)
        return StepOutcome(duration_s, layout.batch_seqs, layout.prefill_tokens, layout.decode_tokens, produced,
                           finished, self._step_ep())

    def _step_ep(self) -> dict[str, Any] | None:
        """The step's expert-parallel figures (the simulator prices ranks; the stub runs one)."""
        return None

    def _price_reads_ids(self) -> bool:
        """Whether :meth:`_price` reads the step's routed ids (not only their counts)."""
        return False

    def _routed_ids(self, owners: list[tuple[str, int, int]]) -> np.ndarray:
        """The step's routed expert ids ``[T, L, K]`` (:meth:`_rows`), pruned as the config's routing says."""
        ids, gates = self._rows(owners)
        rt = self._config.routing
        cut = rt.top_k_override if 0 < rt.top_k_override < ids.shape[2] else None
        if cut is not None or rt.min_gate_weight > 0:  # row by row: every layer of every token at once
            t, n_layers, k = ids.shape
            _, pruned, _ = prune_routes(gates.reshape(t * n_layers, k).astype(np.float32),
                                        ids.reshape(t * n_layers, k), cut, rt.min_gate_weight)
            ids = pruned.reshape(t, n_layers, k)
        return ids

    def _counts(self, owners: list[tuple[str, int, int]]) -> np.ndarray:
        """Routed tokens per expert ``[L, E]`` of the step's tokens (what :meth:`_routed_ids` routes)."""
        return counts_by_layer(self._routed_ids(owners), self._spec.n_experts)

    def _price(self, layout: StepLayout, decisions: Seq[LayerDecision], moves: StepMoves,
               counts: np.ndarray, ids: np.ndarray | None = None) -> float:
        """Seconds the step takes (``counts``: routed tokens per expert ``[L, E]``; ``ids``: the step's
        routed experts ``[T, L, K]``, -1 where pruned): the stub prices nothing (the simulator does)."""
        return 0.0

    def _finished(self, key: str) -> None:
        """A request finished: what the backend kept for it may go."""

    def _take(self, key: str, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The next ``n`` routed tokens of request ``key``: (ids, gates) ``[n, L, K]``."""
        trace = self._trace
        assert trace is not None
        if key not in trace:
            raise ConfigError(f"{self.kind} backend: the router trace has no tokens for request {key!r}")
        ids, gates = trace.request(key)
        at = self._cursor.get(key, 0)
        if at + n > ids.shape[0]:
            raise ConfigError(f"{self.kind} backend: the router trace holds {ids.shape[0]} tokens of request "
                              f"{key!r}; the run needs at least {at + n} (record the trace with the same requests)")
        self._cursor[key] = at + n
        return ids[at: at + n], gates[at: at + n]

    def _rows(self, owners: list[tuple[str, int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """The routed rows of the step's tokens, in step order: each request's next ``n`` tokens."""
        id_parts, gate_parts = [], []
        for key, _start, n in owners:
            ids, gates = self._take(key, n)
            id_parts.append(ids)
            gate_parts.append(gates)
            if self._routes is not None:
                self._routes.setdefault(key, []).append((ids, gates))
        if len(id_parts) == 1:
            return id_parts[0], gate_parts[0]
        return np.concatenate(id_parts), np.concatenate(gate_parts)

    def describe(self) -> dict[str, Any]:
        return {
            "backend": self.kind,
            "model": dict(self._describe_model),
            "device": "none",
            "compute_dtype": None,
            "weight_dtype": FLOAT_PRECISIONS.get(self.weight_precision, self.weight_precision),
            "cpu_kernels": "none",
            "hybrid": False,
            "priced": False,
            "inert_knobs": {k: "the stub backend executes plans without tensors" for k in (
                "runtime.device", "runtime.compute_dtype", "runtime.cpu_kernels", "runtime.threads",
                "execution.expert_sm_share", "execution.host_expert_threads", "execution.decode_attention")},
        }

    def finish(self) -> RunTail:
        hi, lo = tier_precisions(self._config, self.weight_precision)
        layer_index = {layer: i for i, layer in enumerate(self._spec.moe_layers)}
        ctl = self.controller
        names = {0: self.weight_precision, 1: lo or self.weight_precision, 2: hi}  # by tier code (expert_table's)
        # What the records are made of, as of now (the next run starts afresh), made into records when read.
        counts = [(layer, c.copy()) for layer, c in sorted(self.stats.counts.items())]
        tiers = None if self.plain else (ctl.tiers.copy(), ctl.replicas.copy())
        stats = ExpertStats(functools.partial(_expert_records, counts, [layer_index[layer] for layer, _ in counts],
                                              tiers, names))
        decisions = self._log.entries if self._log is not None else None
        self._log = None
        self.controller.log = None
        routes = None
        if self._routes is not None:
            routes = {k: (np.concatenate([c[0] for c in v]), np.concatenate([c[1] for c in v]))
                      for k, v in self._routes.items()}
            self._routes = None
        return RunTail(expert_stats=stats, tiers=None if self.plain else self.controller.stats,
                       fast_tier_expert_bytes=None if self.plain else self.controller.resident_bytes(),
                       routes=routes, decisions=decisions)


def _expert_records(counts: list[tuple[int, np.ndarray]], rows: list[int], tiers: tuple[np.ndarray, np.ndarray] | None,
                    names: dict[int, str]) -> list[ExpertStat]:
    """One :class:`ExpertStat` per expert of each MoE layer (``counts``: model layer index and routed tokens
    per expert; ``rows``: each one's row in ``tiers``, the tier codes and replicas; None: every expert
    resident in ``names[0]``, the loaded precision)."""
    stats: list[ExpertStat] = []
    for (layer, c), row in zip(counts, rows, strict=True):
        n_e = len(c)
        if tiers is None:  # every expert resident as loaded
            resident, precision, replicas = [True] * n_e, [names[0]] * n_e, [0] * n_e
        else:
            codes = tiers[0][row].tolist()
            resident, precision, replicas = [code > 0 for code in codes], [names[code] for code in codes], \
                tiers[1][row].tolist()
        # Positional, in field order (layer, expert, tokens, resident, precision, replicas): one per expert.
        stats.extend(itertools.starmap(ExpertStat, zip(itertools.repeat(layer, n_e), range(n_e), c.tolist(), resident,
                                                       precision, replicas, strict=True)))
    return stats
