"""The serving runtime: sequences, KV cache slots, continuous batching steps and sampling.

``Engine`` holds one loaded model. Requests join with :meth:`Engine.add`; each :meth:`Engine.step`
runs one forward pass over what the scheduler picked and returns the tokens it produced. The same
code runs on CUDA and on the CPU.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.calibrate import cpu_compute_dtype
from engine.config import ConfigError, EngineConfig
from engine.model.checkpoint import Checkpoint
from engine.model.decoder import KVCache, MoEDecoder, Segment, StepBatch, kv_dtype
from engine.model.maker import resolve_model
from engine.scheduler import plan_step

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Sequence:
    seq_id: int
    key: str  # the caller's request id
    prompt: list[int]
    max_new_tokens: int
    slot: int = -1
    n_prefilled: int = 0
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def decoding(self) -> bool:
        return self.n_prefilled >= len(self.prompt)

    @property
    def cached_len(self) -> int:
        """Tokens whose keys and values are in the cache."""
        return self.n_prefilled + max(0, len(self.output) - 1)


@dataclass
class StepOutcome:
    """What one step did: timing, batch shape, and the tokens it produced per request key."""

    duration_s: float
    batch_seqs: int
    prefill_tokens: int
    decode_tokens: int
    tokens: list[tuple[str, int]]  # (request key, token id) in step order
    finished: list[Sequence]


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("runtime.device='cuda': no CUDA device is available on this machine")
    return torch.device(name)


def pick_dtype(name: str, stored: torch.dtype, device: torch.device, hidden: int, inter: int) -> torch.dtype:
    if name == "checkpoint":
        return stored
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return stored  # GPUs have native bf16/fp16 products
    return cpu_compute_dtype(stored, hidden, inter)


def pick_weight_dtype(choice: str, compute: torch.dtype, stored: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the weight matrices are kept in: the stored half precision where the native CPU kernels
    compute fp32 products straight from it (``runtime.cpu_kernels``), else the compute dtype."""
    from engine import kernels

    if device.type != "cpu" or compute != torch.float32 or stored not in kernels.HALF_DTYPES or choice == "torch":
        return compute
    if kernels.load() is None:
        st = kernels.status()
        if choice == "native":
            raise ConfigError(f"runtime.cpu_kernels='native': the kernels cannot be built here "
                              f"({st['error']}); use 'auto' or 'torch'")
        if st["state"] == "broken":  # a compiler that fails is a bug to fix, not a reason to run at half speed
            raise ConfigError(f"runtime.cpu_kernels='auto': the native kernels failed to build with "
                              f"{st['compiler']} ({st['error']}); fix the build (see `engine doctor`) or "
                              "pass --cpu-kernels torch")
        return compute  # no compiler at all: PyTorch's products, and every result says so
    return stored


def is_plain(config: EngineConfig) -> bool:
    """True when no hybrid knob departs from "every expert resident, as loaded, coalesced"."""
    r, x, ro = config.experts, config.execution, config.routing
    return (r.residency == "all" and r.hi_precision == "auto" and r.lo_precision == "none" and x.max_replicas == 0
            and x.expert_batching == "coalesced" and x.host_expert_threads == 0 and x.expert_sm_share == 1.0
            and ro.top_k_override == 0
            and ro.min_gate_weight == 0.0)


def weights_key(config: EngineConfig) -> tuple[str, str, str]:
    """The knobs that decide how the weights are loaded: a change of any of them reloads them."""
    rt = config.runtime
    return rt.device, rt.compute_dtype, rt.cpu_kernels


def fast_tier_bytes(device: torch.device) -> int:
    """Memory of the fast tier: the GPU's, or host memory on a machine without one."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    import psutil

    return int(psutil.virtual_memory().total)


class Engine:
    """One loaded model plus the runtime state of the sequences it serves."""

    def __init__(self, model: str | Path, config: EngineConfig | None = None):
        self.config = config or EngineConfig()
        self.config.validate()
        rt = self.config.runtime
        if rt.threads:
            torch.set_num_threads(rt.threads)
        self.model_path = resolve_model(str(model))
        self.ckpt = Checkpoint(self.model_path)
        self.spec = self.ckpt.spec
        self.device = pick_device(rt.device)
        # Every check that needs the model or the machine runs before any weight is read.
        self.config.validate_for(self.spec, fast_tier_bytes(self.device))
        self.dtype = pick_dtype(rt.compute_dtype, self.ckpt.dtype, self.device, self.spec.hidden_size,
                                self.spec.expert_intermediate)
        self.weight_dtype = pick_weight_dtype(rt.cpu_kernels, self.dtype, self.ckpt.dtype, self.device)
        self.expert_device = self._expert_device(self.config)
        t = time.perf_counter()
        self.model = MoEDecoder(self.ckpt, self.dtype, self.device, self.expert_device, self.weight_dtype)
        self.load_s = time.perf_counter() - t
        self.fingerprint = self.ckpt.fingerprint()
        log.info("loaded %s (%s, %s products of %s weights on %s) in %.1fs", self.model_path, self.spec.arch,
                 self.dtype, self.weight_dtype, self.device, self.load_s)
        self.hotness = None
        self._setup_experts()
        self._reset_runtime()

    @property
    def kernels_label(self) -> str:
        """Which products run and why: "native (<ISA>; <path per precision and token count>)"
        (:func:`engine.kernels.dispatch_summary`) or "torch (<reason>)"."""
        from engine import kernels

        if self.model.native:
            return f"native ({kernels.dispatch_summary()})"
        if self.device.type != "cpu":
            return f"torch ({self.device.type})"
        if self.config.runtime.cpu_kernels == "torch":
            return "torch (runtime.cpu_kernels=torch)"
        if self.weight_dtype == self.ckpt.dtype == self.dtype:
            return f"torch ({str(self.dtype).replace('torch.', '')} weights as stored)"
        if self.dtype != torch.float32:
            return f"torch ({str(self.dtype).replace('torch.', '')} compute)"
        return f"torch (no native kernels: {kernels.status()['error']})"

    def _expert_device(self, config: EngineConfig) -> torch.device:
        # With a GPU and partial residency, all experts load to host memory and the plan copies some up.
        if self.device.type == "cuda" and config.experts.residency != "all":
            return torch.device("cpu")
        return self.device

    def _setup_experts(self) -> None:
        """Build the hybrid expert executor for non-plain configs (re-planned on every reconfigure)."""
        old = self.model.hybrid
        if old is not None:
            old.close()
        self.model.hybrid = None
        self.model.top_k_override = self.config.routing.top_k_override
        self.model.min_gate_weight = self.config.routing.min_gate_weight
        if is_plain(self.config):
            return
        from engine.calibrate import expert_cost_model
        from engine.moe.experts import HybridExperts

        moe = {i: lw for i, lw in enumerate(self.model.layers) if lw.w13 is not None}
        cost = expert_cost_model(self.spec, self.dtype, self.device) \
            if self.config.execution.missing_expert == "auto" and self.config.experts.residency != "all" else None
        hybrid = HybridExperts(self.spec, self.config, {i: lw.w13 for i, lw in moe.items()},
                               {i: lw.w2 for i, lw in moe.items()}, self.device, self.dtype, cost)
        hybrid.plan(self.hotness)
        self.model.hybrid = hybrid

    def set_hotness(self, hotness) -> None:
        """Expert hotness [MoE layers, experts] (shares per layer) for static and dynamic residency."""
        self.hotness = hotness
        if self.model.hybrid is not None and self.config.experts.residency in ("static", "dynamic"):
            self._setup_experts()

    def warm_up_hotness(self, tokens: int | None = None) -> None:
        """Count expert hotness by routing synthetic tokens (when no router trace is given)."""
        import numpy as np

        n = self.config.experts.hotness_warmup_tokens if tokens is None else tokens
        if n <= 0 or self.config.experts.residency not in ("static", "dynamic"):
            return
        g = torch.Generator().manual_seed(self.config.runtime.seed + 17)
        ids = torch.randint(0, self.spec.vocab_size, (n,), generator=g).tolist()
        self.model.stats.reset()
        for start in range(0, n, 256):
            self.add(f"warmup-{start}", ids[start: start + 256], 1)
        while self.has_work:
            self.step()
        counts = np.stack([self.model.stats.counts[layer].numpy() for layer in self.spec.moe_layers])
        self.model.stats.reset()
        self.set_hotness(counts / np.maximum(counts.sum(axis=1, keepdims=True), 1))

    def _reset_runtime(self) -> None:
        s = self.config.scheduler
        cache_device = self.device
        if self.device.type == "cuda" and self.config.execution.decode_attention == "host":
            cache_device = torch.device("cpu")
        self.cache = KVCache(self.spec, s.max_batch_seqs, s.max_seq_len_tokens,
                             kv_dtype(self.config.runtime.kv_dtype, self.dtype), cache_device)
        self.free_slots = list(range(s.max_batch_seqs))
        heapq.heapify(self.free_slots)
        self.running: list[Sequence] = []
        self.waiting: deque[Sequence] = deque()
        self._next_id = 0
        self.last_token_owners: list[tuple[str, int, int]] = []
        self.generator = torch.Generator(device="cpu").manual_seed(self.config.runtime.seed)

    def reconfigure(self, config: EngineConfig) -> float:
        """Apply a new config without reloading weights when only runtime knobs change; returns seconds."""
        t = time.perf_counter()
        old = self.config
        config.validate()
        config.validate_for(self.spec, fast_tier_bytes(self.device))
        if (weights_key(config) != weights_key(old) or self._expert_device(config) != self.expert_device):
            hotness = self.hotness
            if self.model.hybrid is not None:
                self.model.hybrid.close()  # its copier and host-compute threads go with the old weights
            self.__init__(self.model_path, config)  # a different device or precision needs the weights again
            if hotness is not None:
                self.set_hotness(hotness)
            return time.perf_counter() - t
        self.config = config
        if config.runtime.threads:
            torch.set_num_threads(config.runtime.threads)
        self._setup_experts()
        self._reset_runtime()
        return time.perf_counter() - t

    # ------------------------------------------------------------------ requests
    def add(self, key: str, prompt: list[int], max_new_tokens: int) -> Sequence:
        if not prompt:
            raise ValueError(f"request {key}: empty prompt")
        bad = [t for t in prompt if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise ValueError(f"request {key}: token id {bad[0]} outside the vocabulary of {self.spec.vocab_size}")
        seq = Sequence(self._next_id, key, list(prompt), max_new_tokens)
        self._next_id += 1
        if len(prompt) + max_new_tokens > self.config.scheduler.max_seq_len_tokens:
            seq.finish_reason = "rejected"
            log.warning("request %s: %d prompt + %d new tokens exceed max_seq_len_tokens=%d; rejected", key,
                        len(prompt), max_new_tokens, self.config.scheduler.max_seq_len_tokens)
            return seq
        self.waiting.append(seq)
        return seq

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # ------------------------------------------------------------------ one step
    def step(self) -> StepOutcome:
        """Schedule and run one forward pass; sample one token for every sequence that completed a prompt
        or decoded."""
        t0 = time.perf_counter()
        plan = plan_step(self.running, [s.prompt_len for s in self.waiting], self.config.scheduler)
        for _ in range(plan.admit):
            seq = self.waiting.popleft()
            seq.slot = heapq.heappop(self.free_slots)
            self.running.append(seq)
        by_id = {s.seq_id: s for s in self.running}
        admitted = self.running[len(self.running) - plan.admit:] if plan.admit else []
        ids: list[int] = []
        pos: list[int] = []
        segments: list[Segment] = []
        order: list[Sequence] = []  # sequences whose logits come back, in order
        seg_owner: list[Sequence] = []
        decode_seqs = [by_id[i] for i in plan.decode]
        # Decode tokens first, in slot order, so their cache rows are often one contiguous view.
        for seq in sorted(decode_seqs, key=lambda s: s.slot):
            p = seq.cached_len
            segments.append(Segment(seq.slot, len(ids), 1, p, True))
            seg_owner.append(seq)
            ids.append(seq.output[-1])
            pos.append(p)
            order.append(seq)
        prefill_tokens = 0
        for sid, n in plan.prefill:
            seq = admitted[-sid - 1] if sid < 0 else by_id[sid]
            start = seq.n_prefilled
            done = start + n >= seq.prompt_len
            segments.append(Segment(seq.slot, len(ids), n, start, done))
            seg_owner.append(seq)
            ids += seq.prompt[start: start + n]
            pos += range(start, start + n)
            seq.n_prefilled += n
            prefill_tokens += n
            if done:
                order.append(seq)
        # Which request owns which rows of the step (router traces split by it).
        self.last_token_owners = [(seq.key, seg.start, seg.n_tokens) for seg, seq in zip(segments, seg_owner, strict=True)]
        if not segments:
            return StepOutcome(time.perf_counter() - t0, 0, 0, 0, [], [])
        batch = StepBatch(torch.tensor(ids, device=self.device), torch.tensor(pos, device=self.device), segments)
        logits = self.model.forward(batch, self.cache)  # [S', V]
        hybrid = self.model.hybrid
        if hybrid is not None and (hybrid.state.dynamic is not None or self.config.execution.max_replicas > 0):
            hybrid.observe(self.model.stats.step_counts(self.spec.moe_layers), len(ids))
        next_ids = self._sample(logits).tolist()
        produced: list[tuple[str, int]] = []
        finished: list[Sequence] = []
        eos = set(self.spec.eos_token_ids)
        for seq, tok in zip(order, next_ids, strict=True):
            seq.output.append(tok)
            produced.append((seq.key, tok))
            if len(seq.output) >= seq.max_new_tokens:
                seq.finish_reason = "length"
            elif not self.config.sampling.ignore_eos and tok in eos:
                seq.finish_reason = "eos"
            if seq.finish_reason:
                finished.append(seq)
        if finished:
            done_ids = {s.seq_id for s in finished}
            self.running = [s for s in self.running if s.seq_id not in done_ids]
            for s in finished:
                heapq.heappush(self.free_slots, s.slot)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return StepOutcome(time.perf_counter() - t0, len({s.slot for s in segments}), prefill_tokens,
                           len(decode_seqs), produced, finished)

    def _sample(self, logits: torch.Tensor) -> torch.Tensor:
        sp = self.config.sampling
        if sp.temperature == 0.0:
            return logits.argmax(dim=-1)
        logits = logits.cpu() / sp.temperature
        if sp.top_k:
            kth = torch.topk(logits, min(sp.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if sp.top_p < 1.0:
            sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
            keep = sorted_p.cumsum(-1) - sorted_p < sp.top_p  # always keeps the most likely token
            sorted_p = sorted_p * keep
            probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
        return torch.multinomial(probs, 1, generator=self.generator)[:, 0]

    # ------------------------------------------------------------------ conveniences
    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Generate for a list of prompts (offline, continuous batching); returns the new token ids."""
        seqs = [self.add(str(i), p, max_new_tokens) for i, p in enumerate(prompts)]
        while self.has_work:
            self.step()
        return [s.output for s in seqs]
