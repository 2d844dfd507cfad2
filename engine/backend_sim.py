"""The simulator backend: the stub's scheduler and expert plans, each step priced by a hardware profile.

Everything that decides is the stub's (:mod:`engine.backend_stub`), hence the live engine's: the
same :class:`~engine.sequences.SequenceTable` lays out the same steps, each token's experts come
from the workload's router trace (token by token) or, without one, from synthetic routing with the
model's hotness (:mod:`engine.sim.routes`), and the same
:class:`~engine.moe.policy.controller.ResidencyController` plans every MoE layer. Each step is then
priced by :class:`engine.sim.step.StepPricer` from a :class:`~engine.sim.profile.Profile`, and the
virtual clock advances by that many seconds. ``missing_expert="auto"`` decides by costs derived
from the same profile (:func:`engine.sim.step.decision_costs`) unless others are given.

Models need no weights: ``shape:<name>`` (a built-in config), or any directory holding a
``config.json``; a checkpoint works too (its router fingerprint ties it to recorded traces).

No torch here (a checkpoint's fingerprint is read with the checkpoint loader, imported only then).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import numpy as np

from engine.backend import RunStart, RunTail
from engine.backend_stub import StubBackend
from engine.config import ConfigError, EngineConfig, inert_knobs
from engine.model.arch import CheckpointError, ModelSpec, config_fingerprint, read_config
from engine.moe.planning import tier_precisions
from engine.moe.policy.execution import CostModel
from engine.moe.policy.placement import Placement, ep_record, place_experts
from engine.moe.policy.plan import LayerDecision, StepMoves
from engine.precision import FLOAT_PRECISIONS, PRECISIONS, precision_of
from engine.sequences import Sequence, StepLayout
from engine.sim.profile import Profile, ProfileError, load_profile
from engine.sim.routes import RoutingShape, SyntheticRoutes, SyntheticRouting, tokens_of
from engine.sim.step import StepPricer, decision_costs, memory_need

GIB = 2**30


class SimBackend(StubBackend):
    """See the module docstring. ``stored_precision``: the precision the model's weights are stored in
    (the engine keeps or converts them as the config says); ``routing``: the synthetic routing used
    when the workload has no router trace; ``cost_model``: costs for ``missing_expert="auto"``
    instead of the profile's."""

    kind = "sim"
    allow_synthetic = True

    def __init__(self, spec: ModelSpec, config: EngineConfig | None, *, profile: Profile, identity: dict[str, Any],
                 stored_precision: str = "bf16", trace: Any = None, cost_model: CostModel | None = None,
                 routing: SyntheticRouting | None = None, describe_model: dict[str, Any] | None = None) -> None:
        if stored_precision not in FLOAT_PRECISIONS:
            raise ConfigError(f"sim backend: stored_precision={stored_precision!r}: must be one of "
                              f"{', '.join(FLOAT_PRECISIONS)}")
        self.profile = profile
        self.stored = stored_precision
        self.routing = routing or SyntheticRouting()
        self._given_cost = cost_model
        self.pricer: StepPricer | None = None
        self.routes: SyntheticRoutes | None = None
        self._pool: SyntheticRoutes | None = None
        super().__init__(spec, config, identity=identity, weight_precision=stored_precision, trace=trace,
                         cost_model=cost_model, describe_model=describe_model)

    @classmethod
    def from_model(cls, model: str | Path, config: EngineConfig | None = None, *, profile: Profile | str,
                   **options: Any) -> SimBackend:
        """A simulator for ``model``: ``shape:<name>``, a directory holding a ``config.json`` (weights or
        not), or ``builtin:<arch>-<preset>``; ``profile`` a :class:`Profile` or what
        :func:`~engine.sim.profile.load_profile` reads."""
        prof = load_profile(profile) if not isinstance(profile, Profile) else profile
        spec, identity, described, stored = resolve_sim_model(str(model))
        return cls(spec, config, profile=prof, identity=identity, stored_precision=stored, describe_model=described,
                   **options)

    # ------------------------------------------------------------------------------ configuration
    def _apply(self, config: EngineConfig) -> None:  # type: ignore[override]
        self.loaded, self.compute, self.native = sim_precisions(config, self.profile, self.stored)
        self.weight_precision = self.loaded
        super()._apply(config, int(self.profile.fast.mem_bytes))
        problem = memory_need(self._spec, config, self.settings, self.loaded, self.compute, self.profile)
        if problem:
            raise ConfigError(f"sim backend: {problem}")
        hi, lo = tier_precisions(config, self.loaded)
        self._pricer_args = dict(profile=self.profile, spec=self._spec, config=config, settings=self.settings,
                                 loaded=self.loaded, compute=self.compute, hi=hi, lo=lo, native=self.native,
                                 hybrid=not self.plain)
        self.pricer = StepPricer(**self._pricer_args)

    def _routing(self, run: RunStart) -> Any:
        if self._given_trace is not None or run.trace is not None:
            self.routes = None
            return super()._routing(run)
        shape = RoutingShape(tuple(self._spec.moe_layers), self._spec.n_experts, self._spec.top_k,
                             self._spec.n_layers, self._spec.hidden_size)
        if self._pool is None or self._pool.shape != shape or self._pool.routing != self.routing:
            self._pool = SyntheticRoutes(shape, self.routing)  # drawn once, reused by every run
        self.routes = self._pool.fresh()
        return self.routes

    def _decision_costs(self) -> CostModel | None:
        r, x = self._config.experts, self._config.execution
        if x.missing_expert != "auto" or r.residency == "all":
            return None
        if self._given_cost is not None:
            return self._given_cost
        assert self.pricer is not None
        return decision_costs(self.pricer)

    def start(self, run: RunStart) -> None:
        super().start(run)
        self.pricer = StepPricer(**self._pricer_args, placement=self._placement(run))

    def _placement(self, run: RunStart) -> Placement | None:
        """Expert parallelism: the experts' ranks, placed as the live engine places them (from the
        workload's router trace, else the trace the run routes from, when the policy reads hotness)."""
        p, spec = self._config.parallel, self._spec
        if p.ep_size <= 1:
            return None
        source = run.trace if run.trace is not None else self._trace
        hotness = source.hotness() if p.ep_placement != "contiguous" else None
        return place_experts(p.ep_placement, p.ep_size, spec.n_experts, len(spec.moe_layers), hotness,
                             p.redundant_experts)

    # ---------------------------------------------------------------------------------- requests
    def add(self, key: str, prompt: list[int], max_new_tokens: int) -> Sequence:
        seq = super().add(key, prompt, max_new_tokens)
        if self.routes is not None and seq.finish_reason != "rejected":
            self.routes.add(key, tokens_of(len(prompt), max_new_tokens))
        return seq

    def _advance(self, owners: list[tuple[str, int, int]]) -> tuple[list[str], list[int], list[int]]:
        """(keys, first token of each, tokens of each) of the step's rows; each request's cursor moves on."""
        keys = [k for k, _, _ in owners]
        counts = [n for _, _, n in owners]
        starts = [self._cursor.get(k, 0) for k in keys]
        for k, at, n in zip(keys, starts, counts, strict=True):
            self._cursor[k] = at + n
        return keys, starts, counts

    def _rows(self, owners: list[tuple[str, int, int]]) -> tuple[np.ndarray, np.ndarray]:
        if self.routes is None:
            return super()._rows(owners)
        keys, starts, counts = self._advance(owners)
        rt = self._config.routing
        pruned = rt.min_gate_weight > 0 or 0 < rt.top_k_override < self._spec.top_k
        ids, gates = self.routes.rows_many(keys, starts, counts, gates=pruned or self._routes is not None)
        if gates is None:  # read by nothing this step (no routing pruning, no recorded routes)
            return ids, None  # type: ignore[return-value]
        if self._routes is not None:
            for k, (_key, first, n) in zip(keys, owners, strict=True):
                self._routes.setdefault(k, []).append((ids[first: first + n], gates[first: first + n]))
        return ids, gates

    def _pruning(self) -> tuple[int | None, float] | None:
        """(top-k override or None, minimum gate weight) where the config's routing prunes, else None."""
        rt = self._config.routing
        cut = rt.top_k_override if 0 < rt.top_k_override < self._spec.top_k else None
        return (cut, float(rt.min_gate_weight)) if cut is not None or rt.min_gate_weight > 0 else None

    def _routed_ids(self, owners: list[tuple[str, int, int]]) -> np.ndarray:
        if self.routes is None or self._routes is not None:  # a trace, or routes recorded as routed
            return super()._routed_ids(owners)
        # Synthetic routes prune per pool row (prune_routes decides a token by its own gate weights).
        return self.routes.rows_many(*self._advance(owners), gates=False, prune=self._pruning())[0]

    def _counts(self, owners: list[tuple[str, int, int]]) -> np.ndarray:
        if self.routes is None or self._routes is not None:
            return super()._counts(owners)
        return self.routes.counts_many(*self._advance(owners), prune=self._pruning())

    def _price_reads_ids(self) -> bool:
        # Expert parallelism with a chunked combine prices each chunk's rows (StepPricer._ep_step).
        return self.pricer is not None and self.pricer.ep_stats is not None \
            and self._config.parallel.ep_combine_chunks > 1

    def _finished(self, key: str) -> None:
        if self.routes is not None:
            self.routes.forget(key)
        self._cursor.pop(key, None)

    def _price(self, layout: StepLayout, decisions: Seq[LayerDecision], moves: StepMoves,
               counts: np.ndarray, ids: np.ndarray | None = None) -> float:
        assert self.pricer is not None
        return self.pricer.price(layout, decisions, moves, counts, ids)

    # ------------------------------------------------------------------------------ what it did
    def describe(self) -> dict[str, Any]:
        p = self.profile
        two_tier = p.device is not None
        kernels = "native (profile)" if self.native else ("none" if two_tier else "torch")
        inert = dict(inert_knobs(two_tier))
        inert["runtime.device"] = f"the profile decides: {'its device' if two_tier else 'the host alone'}"
        return {
            "backend": self.kind,
            "model": dict(self._describe_model),
            "device": p.fast.name,
            "compute_dtype": FLOAT_PRECISIONS.get(self.compute, self.compute),
            "weight_dtype": FLOAT_PRECISIONS.get(self.loaded, self.loaded),
            "cpu_kernels": kernels,
            "hybrid": two_tier and not self.plain,
            "ep_ranks": self._config.parallel.ep_size,
            "priced": True,
            "ep_pricing": self._ep_pricing(),
            "calibrated": p.calibrated,
            "profile": p.describe(),
            "routing": self.routes.describe() if self.routes is not None else {"synthetic": False},
            "inert_knobs": inert,
            "hardware": {**p.hardware(), "simulated_on": simulating_machine()},
            "software": sim_software(),
        }

    def _ep_pricing(self) -> dict[str, Any] | None:
        """How expert parallelism is priced (None with one rank): the scheme and the interconnect."""
        p, inter = self._config.parallel, self.profile.interconnect
        if p.ep_size <= 1 or inter is None:
            return None
        return {"priced": True, "ranks": p.ep_size, "devices": self.profile.devices,
                "combine": "ring all_reduce over the interconnect", "interconnect": inter.to_dict(),
                "calibrated": self.profile.calibrated}

    def _step_ep(self) -> dict[str, Any] | None:
        stats = self.pricer.ep_stats if self.pricer is not None else None
        return stats.last_step() if stats is not None else None

    def finish(self) -> RunTail:
        tail = super().finish()
        if self.pricer is not None:
            tail.extra_meta["sim"] = {"breakdown_s": self.pricer.summary(), "profile": self.profile.describe()}
            if self.pricer.ep_stats is not None and self.pricer.placement is not None:
                p = self._config.parallel
                tail.extra_meta["ep"] = ep_record(self.pricer.placement, self.pricer.ep_stats, p.ep_combine_chunks,
                                                  p.redundant_experts)
        return tail


def simulating_machine() -> dict[str, Any]:
    """The machine the simulation ran on (not the one it priced), without importing torch."""
    import os

    from engine.hwinfo import _cpu_model

    return {"cpu_model": _cpu_model(), "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count()}


def sim_software() -> dict[str, Any]:
    """Versions a simulated result depends on (torch plays no part)."""
    import platform
    import sys
    from importlib import metadata

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "absent"

    return {"python": sys.version.split()[0], "moetune": version("moetune"), "numpy": np.__version__,
            "torch": "not used (simulated)", "platform": platform.platform()}


def sim_precisions(config: EngineConfig, profile: Profile, stored: str) -> tuple[str, str, bool]:
    """(precision the weights are kept in, precision of activations, native CPU kernels) for ``config``
    on ``profile`` with weights stored in ``stored``, as the live engine would pick them there.

    With a device: products in the stored precision (``compute_dtype`` auto or checkpoint) or the one
    named. Host-only: ``compute_dtype="auto"`` takes what calibration measured on that machine
    (``measured.auto_compute_dtype``), else fp32 (bf16 products pay only with AMX-class units at many
    tokens per expert; the engine's measurement picks fp32 elsewhere); fp32 products of bf16/fp16
    weights read them as stored where the profile's host has native kernels and ``cpu_kernels`` allows.
    """
    rt = config.runtime
    two_tier = profile.device is not None
    if rt.device == "cuda" and not two_tier:
        raise ConfigError(f"sim backend: runtime.device='cuda': profile {profile.name} has no device")
    if rt.device == "cpu" and two_tier:
        raise ConfigError(f"sim backend: runtime.device='cpu' with profile {profile.name}, which has a device "
                          f"(use a host-only profile, e.g. builtin:spr, to price the host alone)")
    cd = rt.compute_dtype
    if two_tier:
        if rt.dense_precision == "int8":
            raise ConfigError(f"sim backend: runtime.dense_precision='int8': profile {profile.name} has a device, "
                              "where the dense matrices run as loaded (int8 dense matrices are a CPU engine's)")
        compute = stored if cd in ("auto", "checkpoint") else precision_of(cd)
        return compute, compute, False
    host = profile.host
    if rt.cpu_kernels == "native" and host.native_max_tokens <= 0:
        raise ConfigError(f"sim backend: runtime.cpu_kernels='native': profile {profile.name}'s host has no native "
                          "kernels; use 'auto' or 'torch'")
    if cd == "auto":
        cd = str(profile.measured.get("auto_compute_dtype") or "float32")
    compute = stored if cd == "checkpoint" else precision_of(cd)
    native = (compute == "fp32" and stored in ("bf16", "fp16") and rt.cpu_kernels != "torch"
              and host.native_max_tokens > 0)
    if rt.dense_precision == "int8" and not native:
        raise ConfigError(f"sim backend: runtime.dense_precision='int8': the live engine runs int8 dense matrices "
                          f"on the native kernels, which would not run here ({compute} products of {stored} "
                          f"weights on profile {profile.name})")
    return (stored if native else compute), compute, native


def has_weights(model: str) -> bool:
    """Whether ``model`` names weights the live engine can load: ``builtin:<arch>-<preset>`` (made on
    first use) or a directory with safetensors; ``shape:<name>`` and a directory holding only a
    ``config.json`` describe a model without its weights."""
    from engine.model.shapes import PREFIX

    if model.startswith("builtin:"):
        return True
    if model.startswith(PREFIX):
        return False
    path = Path(model)
    return path.is_dir() and (any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").exists())


def resolve_sim_model(model: str) -> tuple[ModelSpec, dict[str, Any], dict[str, Any], str]:
    """(spec, identity, description, stored precision) of ``shape:<name>``, a directory holding a
    ``config.json`` (weights or not) or ``builtin:<arch>-<preset>``. A directory without weights is
    identified by its config alone (``config:<hash>``); one with weights by the checkpoint's router
    fingerprint, as the live engine identifies it."""
    from engine.model.shapes import PREFIX, shape_config, shape_spec

    if model.startswith(PREFIX):
        name = model[len(PREFIX):]
        spec, fingerprint = shape_spec(name)
        cfg, path = shape_config(name)
        described = {"path": model, "arch": spec.arch, "dtype": _stored_name(cfg), "layout": "config only",
                     "params": spec.total_params(), "active_params_per_token": spec.active_params_per_token()}
        return spec, spec.identity(fingerprint), {**described, "fingerprint": fingerprint,
                                                   "identity": spec.identity(fingerprint)}, precision_of(
            _stored_name(cfg))
    path = Path(model)
    if not model.startswith("builtin:"):
        if not path.is_dir():
            raise CheckpointError(f"{path}: not a model directory (or use shape:<name>)")
        if not has_weights(model):
            cfg, spec = read_config(path)
            fingerprint = f"config:{config_fingerprint(cfg)}"
            described = {"path": str(path), "arch": spec.arch, "dtype": _stored_name(cfg), "layout": "config only",
                         "params": spec.total_params(), "active_params_per_token": spec.active_params_per_token(),
                         "fingerprint": fingerprint, "identity": spec.identity(fingerprint)}
            return spec, spec.identity(fingerprint), described, precision_of(_stored_name(cfg))
    from engine.model.checkpoint import Checkpoint  # reads tensors (torch)
    from engine.model.maker import resolve_model

    ckpt = Checkpoint(resolve_model(model))
    fingerprint = ckpt.fingerprint()
    return ckpt.spec, ckpt.spec.identity(fingerprint), {**ckpt.describe(), "fingerprint": fingerprint,
                                                        "identity": ckpt.spec.identity(fingerprint)}, \
        precision_of(ckpt.dtype)


def _stored_name(cfg: dict[str, Any]) -> str:
    """The dtype a config says its weights are stored in (bfloat16 when it says nothing)."""
    name = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    if name not in FLOAT_PRECISIONS.values():
        raise CheckpointError(f"config.json: field 'torch_dtype'={name!r}: expected one of "
                              f"{', '.join(FLOAT_PRECISIONS.values())}")
    return str(name)


__all__ = ["GIB", "PRECISIONS", "ProfileError", "SimBackend", "has_weights", "resolve_sim_model", "sim_precisions"]
