"""The serving runtime: sequences, KV cache slots, continuous batching steps and sampling.

``Engine`` holds one loaded model. Requests join with :meth:`Engine.add`; each :meth:`Engine.step`
runs one forward pass over what the scheduler picked and returns the tokens it produced. The same
code runs on CUDA and on the CPU.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from engine.calibrate import cpu_compute_dtype
from engine.config import HOTNESS_RESIDENCIES, ConfigError, EngineConfig, departures_from_plain, uses_hotness
from engine.model.checkpoint import Checkpoint
from engine.model.decoder import KVCache, MoEDecoder, StepBatch, kv_dtype
from engine.model.maker import resolve_model
from engine.moe.planning import plan_settings
from engine.precision import precision_of, torch_dtype
from engine.sequences import SamplingParams, Sequence, SequenceTable, StepOutcome

__all__ = ["Engine", "SamplingParams", "Sequence", "StepOutcome", "fast_tier_bytes", "is_plain", "pick_device",
           "pick_dtype", "pick_weight_dtype", "weights_key"]

log = logging.getLogger(__name__)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("runtime.device='cuda': no CUDA device is available on this machine")
    return torch.device(name)


def pick_dtype(name: str, stored: torch.dtype, device: torch.device, hidden: int, inter: int,
               cpu_kernels: str = "auto") -> torch.dtype:
    """The compute dtype for the ``runtime.compute_dtype`` knob ``name`` (``cpu_kernels``: that knob, which
    decides what ``auto`` means on a CPU: see :func:`engine.calibrate.cpu_compute_dtype`)."""
    if name == "checkpoint":
        return stored
    if name != "auto":
        return torch_dtype(name)
    if device.type == "cuda":
        return stored  # GPUs have native bf16/fp16 products
    return cpu_compute_dtype(stored, hidden, inter, cpu_kernels)


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
    """True when no expert knob departs from its default ("every expert resident, as loaded,
    coalesced"): the model runs its experts without the hybrid executor."""
    return not departures_from_plain(config)


def weights_key(config: EngineConfig) -> tuple[str, str, str]:
    """The knobs that decide how the weights are loaded: a change of any of them reloads them."""
    rt = config.runtime
    return rt.device, rt.compute_dtype, rt.cpu_kernels


#: Decoders of other weight layouts an engine keeps for reconfigure (CPU only), and the share of the
#: memory available at the time that they may take together.
MAX_SPARE_MODELS = 2
SPARE_MEMORY_SHARE = 0.25


def fast_tier_bytes(device: torch.device) -> int:
    """Memory of the fast tier: the GPU's, or host memory on a machine without one."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    import psutil

    return int(psutil.virtual_memory().total)


class Engine:
    """One loaded model plus the runtime state of the sequences it serves.

    ``cost_model`` replaces this machine's calibrated expert costs (``missing_expert="auto"``), e.g.
    to replay the decisions of another machine's profile.
    """

    def __init__(self, model: str | Path, config: EngineConfig | None = None, cost_model=None, *,
                 spare_models: dict[tuple[Any, ...], MoEDecoder] | None = None):
        self.config = config or EngineConfig()
        # Decoders of other weight layouts this engine loaded before, kept while memory allows (reconfigure).
        self._spare_models: dict[tuple[Any, ...], MoEDecoder] = spare_models if spare_models is not None else {}
        self.config.validate()
        rt = self.config.runtime
        self.ep_driver = None
        self._threads_before = torch.get_num_threads()
        if rt.threads:
            torch.set_num_threads(rt.threads)
        self.model_path = resolve_model(str(model))
        self.ckpt = Checkpoint(self.model_path)
        self.spec = self.ckpt.spec
        self.device = pick_device(rt.device)
        # Every check that needs the model or the machine runs before any weight is read.
        self.config.validate_for(self.spec, fast_tier_bytes(self.device))
        self.dtype = pick_dtype(rt.compute_dtype, self.ckpt.dtype, self.device, self.spec.hidden_size,
                                self.spec.expert_intermediate, rt.cpu_kernels)
        self.weight_dtype = pick_weight_dtype(rt.cpu_kernels, self.dtype, self.ckpt.dtype, self.device)
        self.expert_device = self._expert_device(self.config)
        t = time.perf_counter()
        n_ranks = self.config.parallel.ep_size
        if n_ranks > 1:
            self._start_ranks(n_ranks)  # the other ranks load their part while this one loads its own
        try:
            spare = self._spare_models.pop(self._layout_key(), None) if n_ranks == 1 else None
            self.model = spare or MoEDecoder(self.ckpt, self.dtype, self.device, self.expert_device,
                                             self.weight_dtype, load_experts=n_ranks == 1)
            if n_ranks > 1:
                from engine.parallel.ep import EPExperts

                self.model.ep = EPExperts(self.ckpt, self.config, 0, n_ranks, self.dtype, self.weight_dtype,
                                          self.device, self.ep_driver)
        except BaseException:
            if self.ep_driver is not None:  # the other ranks must not outlive a failed start
                self.ep_driver.close()
            raise
        self.load_s = time.perf_counter() - t
        self.fingerprint = self.ckpt.fingerprint()
        log.info("loaded %s (%s, %s products of %s weights on %s) in %.1fs", self.model_path, self.spec.arch,
                 self.dtype, self.weight_dtype, self.device, self.load_s)
        self.hotness = None
        self._given_cost = cost_model
        self.cost_model = cost_model  # the costs in use for missing_expert=auto (calibrated when not given)
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

    def _start_ranks(self, n_ranks: int) -> None:
        """Spawn ranks 1..N-1 of expert parallelism and join their process group (see engine.parallel)."""
        from engine.parallel.group import Driver, RankSetup
        from engine.precision import dtype_name

        if self.device.type == "cuda":
            if n_ranks > torch.cuda.device_count():
                raise ConfigError(f"parallel.ep_size={n_ranks}: one GPU per rank, {torch.cuda.device_count()} here")
            self.device = torch.device("cuda:0")
        threads = self.config.runtime.threads or max(1, len(os.sched_getaffinity(0)) // n_ranks)
        torch.set_num_threads(threads)  # the ranks share this machine's cores
        setup = RankSetup(str(self.model_path), self.config.to_dict(), dtype_name(self.dtype),
                          dtype_name(self.weight_dtype), self.device.type, n_ranks, threads)
        self.ep_driver = Driver(setup, self.config.parallel.ep_timeout_s)

    def close(self) -> None:
        """Release what the engine started: the hybrid executor's threads, expert-parallel ranks."""
        if self.model.hybrid is not None:
            self.model.hybrid.close()
            self.model.hybrid = None
        if self.ep_driver is not None:
            self.ep_driver.close()
            self.ep_driver = None
            torch.set_num_threads(self._threads_before)

    def _expert_device(self, config: EngineConfig) -> torch.device:
        # With a GPU and partial residency, all experts load to host memory and the plan copies some up.
        if self.device.type == "cuda" and config.experts.residency != "all":
            return torch.device("cpu")
        return self.device

    def _apply_dense(self, config: EngineConfig) -> None:
        """The dense matrices in ``runtime.dense_precision`` (int8 copies made once); ConfigError, with nothing
        changed, where this model cannot run them so."""
        try:
            self.model.set_dense_precision(config.runtime.dense_precision)
        except ValueError as e:
            raise ConfigError(f"runtime.dense_precision={config.runtime.dense_precision!r}: {e}") from None

    def _setup_experts(self) -> None:
        """Build the hybrid expert executor for non-plain configs (re-planned on every reconfigure)."""
        from engine import kernels

        self._apply_dense(self.config)
        kernels.set_int8_activations(self.config.experts.int8_activations)  # the int8 products' arithmetic
        old = self.model.hybrid
        if old is not None:
            old.close()
        self.model.hybrid = None
        self.model.top_k_override = self.config.routing.top_k_override
        self.model.min_gate_weight = self.config.routing.min_gate_weight
        settings = plan_settings(self.config, self.spec, precision_of(self.weight_dtype))
        if self.model.ep is not None:  # every expert resident on its rank: plain plans, routing knobs applied
            self.model.reset_plans(settings=settings)
            self.ep_driver.send_config(self.config.to_dict())
            return
        if is_plain(self.config):
            self.model.reset_plans(settings=settings)
            return
        from engine.moe.experts import HybridExperts

        moe = {i: lw for i, lw in enumerate(self.model.layers) if lw.w13 is not None}
        cost = None
        if self.config.execution.missing_expert == "auto" and self.config.experts.residency != "all":
            if self._given_cost is None:
                from engine.calibrate import expert_cost_model

                self.cost_model = expert_cost_model(self.spec, self.dtype, self.device)  # cached per machine
            cost = self.cost_model
        hybrid = HybridExperts(self.spec, self.config, {i: lw.w13 for i, lw in moe.items()},
                               {i: lw.w2 for i, lw in moe.items()}, self.device, self.dtype, cost, settings,
                               versions=self._version_cache())
        hybrid.plan(self.hotness)
        self.model.hybrid = hybrid

    def set_hotness(self, hotness) -> None:
        """Expert hotness [MoE layers, experts] (shares per layer) for static and dynamic residency."""
        self.hotness = hotness
        if self.model.hybrid is not None and self.config.experts.residency in HOTNESS_RESIDENCIES:
            self._setup_experts()
        if self.model.ep is not None:
            self.model.ep.place(hotness)  # every rank re-places from the same profile

    def warm_up_hotness(self, tokens: int | None = None, *, force: bool = False) -> None:
        """Count expert hotness by routing synthetic tokens (when no router trace is given).

        Only when the config places anything by hotness, unless ``force``: a tuner computes the profile
        once per study on the config it starts from, so that the first static or dynamic trial does not
        route the warm-up tokens at its own (maybe slow) speed; the profile survives reconfiguring."""
        import numpy as np

        n = self.config.experts.hotness_warmup_tokens if tokens is None else tokens
        if n <= 0 or not (force or uses_hotness(self.config)):
            return
        g = torch.Generator().manual_seed(self.config.runtime.seed + 17)
        ids = torch.randint(0, self.spec.vocab_size, (n,), generator=g).tolist()
        self.model.stats.reset()
        for start in range(0, n, 256):
            self.add(f"warmup-{start}", ids[start: start + 256], 1)
        while self.has_work:
            self.step()
        counts = np.stack([self.model.stats.counts[layer] for layer in self.spec.moe_layers])
        self.model.stats.reset()
        self.set_hotness(counts / np.maximum(counts.sum(axis=1, keepdims=True), 1))

    def _reset_runtime(self) -> None:
        s = self.config.scheduler
        cache_device = self.device
        if self.device.type == "cuda" and self.config.execution.decode_attention == "host":
            cache_device = torch.device("cpu")
        self.cache = KVCache(self.spec, s.max_batch_seqs, s.max_seq_len_tokens,
                             kv_dtype(self.config.runtime.kv_dtype, self.dtype), cache_device)
        self.seqs = SequenceTable(s, self.spec.vocab_size)
        self.last_token_owners: list[tuple[str, int, int]] = []
        self.generator = torch.Generator(device="cpu").manual_seed(self.config.runtime.seed)

    @property
    def running(self) -> list[Sequence]:
        return self.seqs.running

    @property
    def waiting(self):
        return self.seqs.waiting

    @property
    def free_slots(self) -> list[int]:
        return self.seqs.free_slots

    def _version_cache(self):
        """The quantized expert versions kept with this decoder's weights (engine.moe.experts.VersionCache)."""
        from engine.moe.experts import VersionCache

        cache = self.model.version_cache
        if cache is None:
            import psutil

            cache = VersionCache(int(SPARE_MEMORY_SHARE * psutil.virtual_memory().available))
            self.model.version_cache = cache
        return cache

    def _layout_key(self) -> tuple[Any, ...]:
        return (str(self.device), str(self.expert_device), self.dtype, self.weight_dtype)

    def _keep_spare(self) -> None:
        """Keep the current decoder for a later reconfigure back to its layout (a tuner alternates
        between a few), while all kept weights stay under :data:`SPARE_MEMORY_SHARE` of the memory
        available now and at most :data:`MAX_SPARE_MODELS` are kept (the oldest goes first)."""
        if self.model.ep is not None or self.device.type != "cpu":
            return  # ranks hold the experts; device memory is the scarce thing a tuner measures
        import psutil

        self._spare_models.pop(self._layout_key(), None)
        self._spare_models[self._layout_key()] = self.model
        while len(self._spare_models) > MAX_SPARE_MODELS:
            self._spare_models.pop(next(iter(self._spare_models)))
        budget = SPARE_MEMORY_SHARE * psutil.virtual_memory().available
        def kept(m: MoEDecoder) -> int:
            return m.weight_bytes() + (m.version_cache.bytes if m.version_cache is not None else 0)

        while self._spare_models and sum(kept(m) for m in self._spare_models.values()) > budget:
            self._spare_models.pop(next(iter(self._spare_models)))

    def loads_same_weights(self, config: EngineConfig) -> bool:
        """Whether ``config`` would load the weights this engine holds: the same device, compute dtype and
        weight dtype once resolved (``compute_dtype`` ``auto`` and ``float32`` are one on a CPU without native
        bf16 products, for instance), so that switching between such spellings reloads nothing."""
        if weights_key(config) == weights_key(self.config):
            return True
        rt = config.runtime
        try:
            device = pick_device(rt.device)
            dtype = pick_dtype(rt.compute_dtype, self.ckpt.dtype, device, self.spec.hidden_size,
                               self.spec.expert_intermediate, rt.cpu_kernels)
            weight_dtype = pick_weight_dtype(rt.cpu_kernels, dtype, self.ckpt.dtype, device)
        except ConfigError:
            return False  # the reload says why
        return (device, dtype, weight_dtype) == (self.device, self.dtype, self.weight_dtype)

    def reconfigure(self, config: EngineConfig) -> float:
        """Apply a new config without reloading weights when only runtime knobs change; returns seconds."""
        t = time.perf_counter()
        old = self.config
        config.validate()
        config.validate_for(self.spec, fast_tier_bytes(self.device))
        if (not self.loads_same_weights(config) or self._expert_device(config) != self.expert_device
                or config.parallel != old.parallel):
            hotness, cost = self.hotness, self._given_cost
            self.close()  # the hybrid executor's threads and the expert-parallel ranks go with the old weights
            self._keep_spare()
            # A different device or precision needs the weights again, unless a spare has them.
            self.__init__(self.model_path, config, cost, spare_models=self._spare_models)
            if hotness is not None:
                self.set_hotness(hotness)
            return time.perf_counter() - t
        self._apply_dense(config)  # before anything changes: a config it refuses leaves the engine as it was
        self.config = config
        if config.runtime.threads:
            torch.set_num_threads(config.runtime.threads)
        self._setup_experts()
        self._reset_runtime()
        return time.perf_counter() - t

    # ------------------------------------------------------------------ requests
    def add(self, key: str, prompt: list[int], max_new_tokens: int,
            sampling: SamplingParams | None = None) -> Sequence:
        """Queue a request; ``sampling`` overrides the config's sampling knobs for this request alone."""
        seq = self.seqs.add(key, prompt, max_new_tokens, sampling)
        if seq.sampling is not None and seq.sampling.seed is not None:
            seq.generator = torch.Generator(device="cpu").manual_seed(seq.sampling.seed)
        return seq

    def abort(self, key: str) -> Sequence | None:
        """Drop the waiting or running request ``key`` and free its KV cache slot; None if unknown
        (never added, or already finished)."""
        return self.seqs.abort(key)

    @property
    def has_work(self) -> bool:
        return self.seqs.has_work

    # ------------------------------------------------------------------ one step
    def step(self) -> StepOutcome:
        """Schedule and run one forward pass; sample one token for every sequence that completed a prompt
        or decoded."""
        t0 = time.perf_counter()
        if self.ep_driver is not None:
            self.ep_driver.check()  # a dead or failed rank: say so before the step touches any sequence
        layout = self.seqs.next_step()
        # Which request owns which rows of the step (router traces split by it).
        self.last_token_owners = layout.owners
        if not layout.segments:
            return StepOutcome(time.perf_counter() - t0, 0, 0, 0, [], [])
        batch = StepBatch(torch.tensor(layout.token_ids, device=self.device),
                          torch.tensor(layout.positions, device=self.device), layout.segments)
        logits = self.model.forward(batch, self.cache)  # [S', V]
        self.model.end_step(layout.n_tokens)
        next_ids = self._sample(logits, layout.sampled).tolist()
        produced, finished = self.seqs.finish_step(layout, next_ids, self.spec.eos_token_ids,
                                                   self.config.sampling.ignore_eos)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        ep = self.model.ep.stats.last_step() if self.model.ep is not None else None
        return StepOutcome(time.perf_counter() - t0, layout.batch_seqs, layout.prefill_tokens,
                           layout.decode_tokens, produced, finished, ep)

    def _sample(self, logits: torch.Tensor, order: list[Sequence]) -> torch.Tensor:
        """One token per row of ``logits`` [S', V]; row i belongs to ``order[i]``."""
        sp = self.config.sampling
        if all(seq.sampling is None for seq in order):
            return _sample_rows(logits, sp.temperature, sp.top_k, sp.top_p, self.generator)
        params = []
        for seq in order:
            own = seq.sampling or SamplingParams()
            params.append((sp.temperature if own.temperature is None else own.temperature,
                           sp.top_k if own.top_k is None else own.top_k,
                           sp.top_p if own.top_p is None else own.top_p))
        if all(p == params[0] for p in params) and all(seq.generator is None for seq in order):
            return _sample_rows(logits, *params[0], self.generator)  # one batch: same as the config's path
        out = greedy_rows(logits).cpu()  # greedy rows; the others are sampled one at a time below
        for i, (seq, p) in enumerate(zip(order, params, strict=True)):
            if p[0] != 0.0:
                out[i] = _sample_rows(logits[i: i + 1], *p, seq.generator or self.generator)[0].cpu()
        return out

    # ------------------------------------------------------------------ conveniences
    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Generate for a list of prompts (offline, continuous batching); returns the new token ids."""
        seqs = [self.add(str(i), p, max_new_tokens) for i, p in enumerate(prompts)]
        while self.has_work:
            self.step()
        return [s.output for s in seqs]


def greedy_rows(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest logit, the first where several tie (a NaN counts as the largest), as
    ``logits.argmax(dim=-1)`` gives it. On the CPU NumPy's argmax gives the same indices ~10x faster: over a
    32000-token vocabulary, 2 threads, 83 -> 10 us for one row and 1.35 -> 0.12 ms for 32 rows (medians of
    1000-3000 calls: PyTorch's CPU argmax takes 1.3-2.6 ns a value, NumPy's 0.1-0.3)."""
    if logits.device.type == "cpu" and logits.dim() == 2 and logits.dtype == torch.float32:
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def _sample_rows(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                 generator: torch.Generator) -> torch.Tensor:
    """Greedy (temperature 0) or temperature/top-k/top-p sampling of one token per row."""
    if temperature == 0.0:
        return greedy_rows(logits)
    logits = logits.cpu() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p  # always keeps the most likely token
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]
