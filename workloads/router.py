"""Router traces: which experts each token of each request was routed to, tied to one model.

A trace holds, for every request it covers and every token the model processed for it (the prompt,
then each generated token fed back, in order), the ``top_k`` expert ids and gate weights chosen at
each MoE layer. All requests are concatenated into two arrays plus an offsets array, and stored in
one safetensors file (no pickle); the model identity and request ids go in its metadata as JSON.

Hotness (share of routed tokens per expert, per layer) and skew metrics are derived from it; those
are what static residency and replication read. "Time" for drift is the order of the concatenated
tokens: requests in arrival order, each request's tokens in order (an approximation of the
interleaving a batched run sees).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from workloads.errors import WorkloadError, workload_error

log = logging.getLogger(__name__)

TRACE_FORMAT_NAME = "moetune-router-trace"
TRACE_FORMAT_VERSION = 1
IDENTITY_SHAPE_KEYS = ("arch", "n_layers", "moe_layers", "n_experts", "top_k", "hidden_size")
"""Identity keys that describe the model's shapes; with ``fingerprint`` they are all required."""
SYNTHETIC_PREFIX = "synthetic:"
"""Fingerprints of generated (not recorded) traces start with this."""
NO_EXPERT = -1
"""Expert id marking a slot no expert was computed for (e.g. skipped below a gate threshold)."""


def normalize_identity(identity: Mapping[str, Any], source: str = "model identity") -> dict[str, Any]:
    """Check the required keys and types of a model identity and return it as plain JSON types."""
    out = dict(identity)
    for key in (*IDENTITY_SHAPE_KEYS, "fingerprint"):
        if key not in out:
            raise WorkloadError(f"{source}: field {key!r}: missing from the model identity", field=key)
    for key in ("n_layers", "n_experts", "top_k", "hidden_size"):
        value = out[key]
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
            raise WorkloadError(f"{source}: field {key!r}: {value!r} is not an integer >= 0", field=key)
        out[key] = int(value)
    layers = out["moe_layers"]
    if isinstance(layers, (str, bytes)) or not isinstance(layers, (Sequence, np.ndarray)) or not all(
            isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in layers):
        raise WorkloadError(f"{source}: field 'moe_layers': must be a list of layer indices", field="moe_layers")
    out["moe_layers"] = [int(v) for v in layers]
    for key in ("arch", "fingerprint"):
        if not isinstance(out[key], str):
            raise WorkloadError(f"{source}: field {key!r}: {out[key]!r} is not a string", field=key)
    return out


class RouterTrace:
    """Expert choices and gate weights per token, per MoE layer, for a set of requests.

    Arrays: ``expert_ids`` int16 ``[n_tokens, n_moe_layers, top_k]``, ``gate_weights`` float16 of the
    same shape, ``offsets`` int64 ``[n_requests + 1]`` (request ``i`` owns tokens
    ``offsets[i]:offsets[i+1]``).
    """

    def __init__(self, model_identity: Mapping[str, Any], request_ids: Sequence[str], offsets: np.ndarray,
                 expert_ids: np.ndarray, gate_weights: np.ndarray, *, source: str = "router trace") -> None:
        self.model_identity = normalize_identity(model_identity, source)
        self.request_ids: list[str] = [str(r) for r in request_ids]
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.expert_ids = np.asarray(expert_ids)
        self.gate_weights = np.asarray(gate_weights)
        problem = self._problem()
        if problem is not None:
            field, text = problem
            raise WorkloadError(f"{source}: field {field!r}: {text}", file=source, field=field)
        self._index = {rid: i for i, rid in enumerate(self.request_ids)}

    def _problem(self) -> tuple[str, str] | None:
        ident = self.model_identity
        n_layers, top_k, n_experts = len(ident["moe_layers"]), ident["top_k"], ident["n_experts"]
        if len(set(self.request_ids)) != len(self.request_ids):
            return "request_ids", "ids repeat"
        if self.expert_ids.dtype != np.int16:
            return "expert_ids", f"dtype {self.expert_ids.dtype}, expected int16"
        if self.gate_weights.dtype != np.float16:
            return "gate_weights", f"dtype {self.gate_weights.dtype}, expected float16"
        if self.expert_ids.ndim != 3 or self.expert_ids.shape[1:] != (n_layers, top_k):
            return "expert_ids", (f"shape {list(self.expert_ids.shape)}, expected [n_tokens, {n_layers}, "
                                  f"{top_k}] (n_moe_layers, top_k of the model identity)")
        if self.gate_weights.shape != self.expert_ids.shape:
            return "gate_weights", f"shape {list(self.gate_weights.shape)} differs from expert_ids"
        if self.offsets.ndim != 1 or self.offsets.size != len(self.request_ids) + 1:
            return "offsets", f"needs {len(self.request_ids) + 1} entries (one per request, plus one)"
        if self.offsets[0] != 0 or self.offsets[-1] != self.expert_ids.shape[0] or np.any(np.diff(self.offsets) < 0):
            return "offsets", "must rise from 0 to n_tokens"
        if self.expert_ids.size and (self.expert_ids.min() < NO_EXPERT or self.expert_ids.max() >= n_experts):
            return "expert_ids", f"ids must lie in [{NO_EXPERT}, {n_experts})"
        return None

    # ------------------------------------------------------------------------------- construction

    @classmethod
    def from_requests(cls, model_identity: Mapping[str, Any],
                      per_request: Mapping[str, tuple[np.ndarray, np.ndarray]] | Iterable[
                          tuple[str, np.ndarray, np.ndarray]]) -> RouterTrace:
        """Build a trace from ``{request_id: (expert_ids [T, L, K], gate_weights [T, L, K])}``.

        Arrays of any integer / float dtype are converted (to int16 / float16).
        """
        items = [(rid, e, g) for rid, (e, g) in per_request.items()] if isinstance(per_request, Mapping) \
            else list(per_request)
        identity = normalize_identity(model_identity)
        shape = (len(identity["moe_layers"]), identity["top_k"])
        lengths = [int(np.shape(e)[0]) for _, e, _ in items]
        offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        if items:
            expert_ids = np.concatenate([np.asarray(e).reshape(-1, *shape) for _, e, _ in items]).astype(np.int16)
            gates = np.concatenate([np.asarray(g).reshape(-1, *shape) for _, _, g in items]).astype(np.float16)
        else:
            expert_ids = np.zeros((0, *shape), np.int16)
            gates = np.zeros((0, *shape), np.float16)
        return cls(identity, [rid for rid, _, _ in items], offsets, expert_ids, gates)

    @classmethod
    def from_arrays(cls, *, request_ids: Sequence[str], expert_ids: Sequence[np.ndarray],
                    gate_weights: Sequence[np.ndarray], model_identity: Mapping[str, Any]) -> RouterTrace:
        """Build a trace from parallel lists: one ``[T_i, L, K]`` array of ids and of weights per request."""
        if not len(request_ids) == len(expert_ids) == len(gate_weights):
            raise ValueError(f"got {len(request_ids)} request ids, {len(expert_ids)} expert_ids arrays and "
                             f"{len(gate_weights)} gate_weights arrays")
        return cls.from_requests(model_identity, list(zip(request_ids, expert_ids, gate_weights, strict=True)))

    # ------------------------------------------------------------------------------------ access

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._index

    def __len__(self) -> int:
        return len(self.request_ids)

    def __repr__(self) -> str:
        return (f"RouterTrace({len(self)} requests, {self.n_tokens} tokens, {self.n_moe_layers} MoE layers, "
                f"top-{self.top_k} of {self.n_experts}, model {self.model_identity['arch']})")

    @property
    def n_tokens(self) -> int:
        return int(self.expert_ids.shape[0])

    @property
    def n_moe_layers(self) -> int:
        return len(self.model_identity["moe_layers"])

    @property
    def n_experts(self) -> int:
        return int(self.model_identity["n_experts"])

    @property
    def top_k(self) -> int:
        return int(self.model_identity["top_k"])

    @property
    def is_synthetic(self) -> bool:
        return self.model_identity["fingerprint"].startswith(SYNTHETIC_PREFIX)

    def tokens_per_request(self) -> dict[str, int]:
        """Number of traced tokens of each request."""
        return dict(zip(self.request_ids, np.diff(self.offsets).tolist(), strict=True))

    def request(self, request_id: str) -> tuple[np.ndarray, np.ndarray]:
        """``(expert_ids [T, L, K] int16, gate_weights [T, L, K] float16)`` of one request (views)."""
        i = self._index[request_id]
        lo, hi = self.offsets[i], self.offsets[i + 1]
        return self.expert_ids[lo:hi], self.gate_weights[lo:hi]

    def subset(self, request_ids: Sequence[str], max_tokens: Mapping[str, int] | None = None, *,
               as_ids: Sequence[str] | None = None) -> RouterTrace:
        """A trace of these requests in this order; ``max_tokens`` cuts a request's tokens short.
        ``as_ids`` names the entries of the new trace (then ``request_ids`` may repeat: copies)."""
        missing = [rid for rid in request_ids if rid not in self._index]
        if missing:
            raise KeyError(f"request {missing[0]!r} is not in the router trace")
        if as_ids is not None and len(as_ids) != len(request_ids):
            raise ValueError(f"as_ids: {len(as_ids)} ids for {len(request_ids)} requests")
        max_tokens = max_tokens or {}
        if list(request_ids) == self.request_ids and not max_tokens and as_ids is None:
            return self
        slices, lengths = [], []
        for rid in request_ids:
            i = self._index[rid]
            lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
            if rid in max_tokens:
                hi = min(hi, lo + max(int(max_tokens[rid]), 0))
            slices.append(np.arange(lo, hi))
            lengths.append(hi - lo)
        take = np.concatenate(slices) if slices else np.zeros(0, np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        return RouterTrace(self.model_identity, list(as_ids if as_ids is not None else request_ids), offsets,
                           self.expert_ids[take], self.gate_weights[take])

    # ------------------------------------------------------------------------------- model check

    def check_model(self, identity: Mapping[str, Any], source: str, *, allow_synthetic: bool = False) -> None:
        """Refuse (``WorkloadError``) to use this trace with a model other than the one it was recorded on.

        ``identity`` is the model's identity (same keys as ``model_identity``); ``source`` names the
        workload or trace file in the message. A synthetic trace is refused for a real model unless
        ``allow_synthetic``, in which case only the routing shapes (MoE layer count, experts, top-k)
        must agree.
        """
        model = normalize_identity(identity, f"{source}: model")
        mine = self.model_identity
        if self.is_synthetic and allow_synthetic:
            pairs = [("number of MoE layers", len(mine["moe_layers"]), len(model["moe_layers"])),
                     ("n_experts", mine["n_experts"], model["n_experts"]),
                     ("top_k", mine["top_k"], model["top_k"])]
            for what, a, b in pairs:
                if a != b:
                    raise WorkloadError(f"{source}: synthetic router trace has {what} {a}, the model has {b}",
                                        file=source, field=what)
            return
        for key in IDENTITY_SHAPE_KEYS:
            if mine[key] != model[key]:
                raise WorkloadError(
                    f"{source}: router trace was recorded with {key}={mine[key]!r} but the model has "
                    f"{key}={model[key]!r}; record the workload again with this model (workloads record)",
                    file=source, field=key)
        if mine["fingerprint"] != model["fingerprint"]:
            what = "a synthetic trace" if self.is_synthetic else "a model with other weights"
            raise WorkloadError(
                f"{source}: router trace comes from {what} (fingerprint {mine['fingerprint'][:24]!r}, "
                f"this model {model['fingerprint'][:24]!r}); record the workload again with this model "
                "(workloads record)", file=source, field="fingerprint")

    # --------------------------------------------------------------------------------- hotness

    def _counts(self, expert_ids: np.ndarray) -> np.ndarray:
        """Routed-token counts ``[n_moe_layers, n_experts]`` (slots with ``NO_EXPERT`` ignored)."""
        counts = np.zeros((self.n_moe_layers, self.n_experts), dtype=np.int64)
        for layer in range(self.n_moe_layers):  # per layer keeps the work arrays small
            ids = expert_ids[:, layer, :].ravel()
            counts[layer] = np.bincount(ids[ids >= 0], minlength=self.n_experts)
        return counts

    def hotness(self, window_tokens: int | None = None) -> np.ndarray:
        """Per layer, each expert's share of routed tokens: float64 ``[n_moe_layers, n_experts]``, rows sum to 1.

        Over the whole trace, or over its last ``window_tokens`` tokens (recent hotness). A layer
        with no routed tokens has all-zero shares.
        """
        ids = self.expert_ids if window_tokens is None else self.expert_ids[-int(window_tokens):]
        return _shares(self._counts(ids))

    def hotness_windows(self, window_tokens: int) -> np.ndarray:
        """Hotness of consecutive windows of ``window_tokens`` tokens: ``[n_windows, n_moe_layers, n_experts]``.

        The last window may be shorter; it is dropped when under half a window (unless it is the only one).
        """
        if window_tokens < 1:
            raise ValueError(f"window_tokens must be >= 1, got {window_tokens}")
        starts = list(range(0, max(self.n_tokens, 1), window_tokens))
        if len(starts) > 1 and self.n_tokens - starts[-1] < window_tokens / 2:
            starts.pop()
        ends = starts[1:] + [self.n_tokens]
        return np.stack([_shares(self._counts(self.expert_ids[a:b])) for a, b in zip(starts, ends, strict=True)])

    def skew_stats(self, window_tokens: int | None = None) -> dict[str, Any]:
        """Per-layer skew (top-10 % share, normalised entropy) and drift between token windows.

        ``window_tokens`` defaults to an eighth of the trace (at least one token).
        """
        hot = self.hotness()
        window = window_tokens or max(1, math.ceil(self.n_tokens / 8))
        windows = self.hotness_windows(window)
        top = top_share(hot)
        entropy = normalized_entropy(hot)
        drift = drift_tv(windows)
        return {
            "n_requests": len(self),
            "n_tokens": self.n_tokens,
            "window_tokens": window,
            "n_windows": int(windows.shape[0]),
            "top10_share": top.tolist(),
            "entropy_norm": entropy.tolist(),
            "drift_tv": drift.tolist(),
            "mean_top10_share": float(top.mean()) if top.size else None,
            "mean_entropy_norm": float(entropy.mean()) if entropy.size else None,
            "mean_drift_tv": float(drift.mean()) if drift.size and windows.shape[0] > 1 else None,
        }

    # ---------------------------------------------------------------------------------- storage

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the trace to a safetensors file (arrays + JSON metadata)."""
        from safetensors.numpy import save_file

        path = Path(path)
        metadata = {
            "format": TRACE_FORMAT_NAME,
            "format_version": str(TRACE_FORMAT_VERSION),
            "model_identity": json.dumps(self.model_identity, sort_keys=True),
            "request_ids": json.dumps(self.request_ids),
        }
        tensors = {"expert_ids": np.ascontiguousarray(self.expert_ids),
                   "gate_weights": np.ascontiguousarray(self.gate_weights),
                   "offsets": np.ascontiguousarray(self.offsets)}
        tmp = path.with_name(path.name + ".tmp")
        save_file(tensors, str(tmp), metadata=metadata)
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RouterTrace:
        """Read and validate a trace written by :meth:`save`; errors name the file and the field."""
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise workload_error(path, "missing")
        try:
            with safe_open(str(path), framework="numpy") as f:
                metadata = f.metadata() or {}
                keys = set(f.keys())
                for key in ("expert_ids", "gate_weights", "offsets"):
                    if key not in keys:
                        raise workload_error(path, "tensor missing", field=key)
                tensors = {key: f.get_tensor(key) for key in ("expert_ids", "gate_weights", "offsets")}
        except WorkloadError:
            raise
        except Exception as e:  # safetensors raises its own error types for a corrupt header
            raise workload_error(path, f"not a readable safetensors file ({type(e).__name__}: {e})") from None
        if metadata.get("format") != TRACE_FORMAT_NAME:
            raise workload_error(path, f"{metadata.get('format')!r} is not {TRACE_FORMAT_NAME!r}", field="format")
        version = metadata.get("format_version", "")
        if not version.isdigit() or not 1 <= int(version) <= TRACE_FORMAT_VERSION:
            raise workload_error(path, f"version {version!r} is not supported (this moetune reads "
                                 f"version {TRACE_FORMAT_VERSION})", field="format_version")
        parsed = {}
        for key in ("model_identity", "request_ids"):
            try:
                parsed[key] = json.loads(metadata[key])
            except (KeyError, json.JSONDecodeError):
                raise workload_error(path, "missing or not valid JSON", field=key) from None
        if not isinstance(parsed["model_identity"], dict):
            raise workload_error(path, "must be a JSON object", field="model_identity")
        ids = parsed["request_ids"]
        if not isinstance(ids, list) or not all(isinstance(r, str) for r in ids):
            raise workload_error(path, "must be a JSON list of strings", field="request_ids")
        if tensors["offsets"].dtype != np.int64:
            raise workload_error(path, f"dtype {tensors['offsets'].dtype}, expected int64", field="offsets")
        return cls(parsed["model_identity"], ids, tensors["offsets"], tensors["expert_ids"],
                   tensors["gate_weights"], source=str(path))


# ------------------------------------------------------------------------------------- metrics


def _shares(counts: np.ndarray) -> np.ndarray:
    totals = counts.sum(axis=-1, keepdims=True)
    return np.divide(counts, totals, out=np.zeros(counts.shape, np.float64), where=totals > 0)


def top_share(hotness: np.ndarray, fraction: float = 0.1) -> np.ndarray:
    """Per layer, the share of routed tokens taken by the hottest ``fraction`` of experts (at least one)."""
    n_top = max(1, math.ceil(hotness.shape[-1] * fraction))
    return np.sort(hotness, axis=-1)[..., ::-1][..., :n_top].sum(axis=-1)


def normalized_entropy(hotness: np.ndarray) -> np.ndarray:
    """Per layer, entropy of the expert shares divided by log(n_experts): 1 = uniform, 0 = one expert."""
    n_experts = hotness.shape[-1]
    if n_experts < 2:
        return np.zeros(hotness.shape[:-1])
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(hotness > 0, hotness * np.log(hotness), 0.0)
    return -terms.sum(axis=-1) / math.log(n_experts)


def drift_tv(windows: np.ndarray) -> np.ndarray:
    """Per layer, mean total-variation distance between consecutive windows' shares (0 = stable, 1 = disjoint).

    ``windows`` is ``[n_windows, n_layers, n_experts]``; fewer than two windows give zeros.
    """
    if windows.shape[0] < 2:
        return np.zeros(windows.shape[1])
    return 0.5 * np.abs(np.diff(windows, axis=0)).sum(axis=-1).mean(axis=0)
