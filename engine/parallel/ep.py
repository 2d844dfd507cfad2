"""One rank's experts and the MoE layer's dispatch and combine under expert parallelism.

Every rank holds the step's hidden states of every token (attention is replicated), so the dispatch
moves nothing: each rank picks the (token, slot) pairs that
:func:`~engine.moe.policy.placement.assign_pairs` gives it, maps their expert ids to its local stacked
weights (-1 for every other pair) and runs them through the decoder's own kernels (the
``run_experts`` it is handed: fused native call, one token, or grouped products). The combine sums the
ranks' partial outputs with ``dist.all_reduce``; with ``parallel.ep_combine_chunks`` = C > 1 the rows
are cut into C chunks and each chunk's all-reduce runs (``async_op``) while the next chunk's experts
compute. Measured on gloo (2 ranks, loopback, this repository's README): one all-reduce costs less
than the all-to-all plus all-gather an owner-based combine would need when tokens are replicated.

Rank 0 also keeps the run's figures (:class:`~engine.moe.policy.placement.EPStats`): every rank sees
the same routes, so rank 0 counts every rank's pairs without asking.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.model.checkpoint import Checkpoint
from engine.moe.experts import sm_partition
from engine.moe.policy.placement import (
    EPStats,
    Placement,
    assign_pairs,
    chunk_bounds,
    ep_record,
    place_experts,
)

log = logging.getLogger(__name__)

RunExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray],
                      torch.Tensor]


class EPExperts:
    """Rank ``rank``'s experts of every MoE layer, placed by ``parallel.ep_placement``; ``driver`` is
    rank 0's :class:`~engine.parallel.group.Driver` (None on the other ranks)."""

    def __init__(self, ckpt: Checkpoint, config: EngineConfig, rank: int, n_ranks: int, dtype: torch.dtype,
                 weight_dtype: torch.dtype, device: torch.device, driver=None):
        spec = ckpt.spec
        self.ckpt, self.spec, self.rank, self.n_ranks = ckpt, spec, rank, n_ranks
        self.weight_dtype, self.device, self.driver = weight_dtype, device, driver
        p = config.parallel
        self.policy, self.redundant, self.chunks = p.ep_placement, p.redundant_experts, p.ep_combine_chunks
        self.moe_layers = list(spec.moe_layers)
        # CUDA with execution.expert_sm_share < 1: experts on a green context of that share of the SMs, the
        # combine's NCCL kernels capped to the rest (engine.parallel.group.group_options), so a chunk's
        # all-reduce runs beside the next chunk's experts on SMs of its own.
        self.sm_share = config.execution.expert_sm_share
        self.part = sm_partition(device, self.sm_share)
        self.stats = EPStats(n_ranks, len(self.moe_layers), spec.hidden_size, torch.empty((), dtype=dtype).element_size())
        self.placement: Placement | None = None
        self.w13: list[torch.Tensor] = []
        self.w2: list[torch.Tensor] = []
        self.local_index: list[np.ndarray] = []  # per MoE layer: expert id -> row in w13/w2, -1 elsewhere
        self.place(None)

    def place(self, hotness: np.ndarray | None) -> None:
        """Place the experts from a hotness profile ``[MoE layers, E]`` (None: equally hot) and read this
        rank's from the checkpoint; rank 0 first tells every other rank to do the same."""
        if self.driver is not None:
            self.driver.send_place(hotness)
        spec = self.spec
        placement = place_experts(self.policy, self.n_ranks, spec.n_experts, len(self.moe_layers),
                                  hotness if self.policy != "contiguous" else None, self.redundant)
        if placement == self.placement:
            return
        w13s, w2s, index = [], [], []
        for li, layer in enumerate(self.moe_layers):
            local = placement.experts_on(li, self.rank)
            w13 = torch.empty(len(local), 2 * spec.expert_intermediate, spec.hidden_size, dtype=self.weight_dtype,
                              device=self.device)
            w2 = torch.empty(len(local), spec.hidden_size, spec.expert_intermediate, dtype=self.weight_dtype,
                             device=self.device)
            self.ckpt.read_experts(layer, w13, w2, experts=local)
            idx = np.full(spec.n_experts, -1, np.int64)
            idx[list(local)] = np.arange(len(local))
            w13s.append(w13)
            w2s.append(w2)
            index.append(idx)
        self.w13, self.w2, self.local_index, self.placement = w13s, w2s, index, placement
        log.info("rank %d holds %s experts per MoE layer (%s placement)", self.rank,
                 [len(w) for w in w13s], placement.policy)

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.w13, *self.w2))

    def before_forward(self, batch, cache) -> None:
        """Rank 0: send the step to every other rank (they run the same forward pass)."""
        if self.driver is not None:
            self.driver.send_step(batch.token_ids, batch.positions, batch.segments, cache)

    def forward(self, layer: int, h: torch.Tensor, weights: torch.Tensor, ids: np.ndarray,
                run: RunExperts) -> torch.Tensor:
        """MoE layer ``layer`` (index among MoE layers) of a step: this rank's pairs, then the sum over
        ranks. h [T, H]; weights [T, K]; ids [T, K] on the host (-1 = skipped slot)."""
        assert self.placement is not None
        t = h.shape[0]
        owner = assign_pairs(ids, self.placement, layer)  # [T, K] rank of each pair
        if self.driver is not None:
            self.stats.add_layer(layer, np.bincount(owner[owner >= 0], minlength=self.n_ranks), t)
        index = self.local_index[layer]
        local = np.where(owner == self.rank, index[np.maximum(ids, 0)], -1)  # [T, K] rows of w13/w2
        local_t = torch.from_numpy(local).to(h.device)
        n_local = self.w13[layer].shape[0]
        bounds = chunk_bounds(t, self.chunks)
        chunks = len(bounds) - 1
        out = torch.empty_like(h)
        pending = []
        green = self.part.stream
        current = torch.cuda.current_stream(h.device) if green is not None else None
        with self._guard("the combine of a MoE layer"):
            for a, b in zip(bounds[:-1], bounds[1:], strict=True):
                rows = local[a:b]
                counts = np.bincount(rows[rows >= 0], minlength=n_local)

                def experts(a: int = a, b: int = b, counts: np.ndarray = counts) -> torch.Tensor:
                    if counts.sum():
                        return run(self.w13[layer], self.w2[layer], h[a:b], weights[a:b], local_t[a:b],
                                   counts).contiguous()
                    return torch.zeros(b - a, h.shape[1], dtype=h.dtype, device=h.device)

                if green is None:
                    y = experts()
                else:  # on the experts' SMs, after what produced h; the all-reduce waits for this chunk only
                    green.wait_stream(current)
                    with torch.cuda.stream(green):
                        y = experts()
                    current.wait_stream(green)
                    y.record_stream(current)
                # The last chunk's sum is waited on at once; earlier ones run behind the next chunk's experts.
                pending.append((a, b, y, dist.all_reduce(y, async_op=chunks > 1)))
            for a, b, y, work in pending:
                if work is not None:
                    work.wait()
                out[a:b] = y
        return out

    def _guard(self, during: str):
        if self.driver is not None:
            return self.driver.collective(during)
        return _NoGuard()

    def describe(self) -> dict:
        """The placement and the run's figures, JSON-able (rank 0's view of every rank)."""
        assert self.placement is not None
        part = self.part
        if part.stream is not None:
            from engine.parallel.group import comm_ctas

            sm = {"expert_sms": part.expert_sms, "sms": part.sms,
                  "comm_max_ctas": comm_ctas(self.sm_share, part.sms)}
        else:
            sm = {"inert": part.inert} if part.inert else None
        return ep_record(self.placement, self.stats, self.chunks, self.redundant, sm)


class _NoGuard:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> bool:
        return False
