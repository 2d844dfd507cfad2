"""Shared fixtures of the engine tests: tiny checkpoints, the transformers oracle, a step-by-step driver.

Checkpoints are made once per session (keyed by their arguments) under pytest's temporary directory,
so every module asking for the same model reuses the files. transformers is imported only by the
``hf`` fixture: tests that do not ask for it run without transformers installed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.model.checkpoint import Checkpoint
from engine.model.decoder import KVCache, MoEDecoder, Segment, StepBatch
from engine.model.maker import make_model


def moe_overrides(arch: str, experts: int | None, top_k: int | None, width: int | None) -> dict[str, Any]:
    """config.json overrides for expert count, top-k and expert width, in each family's own field names."""
    out: dict[str, Any] = {}
    if experts is not None:
        out["num_local_experts" if arch == "mixtral" else "num_experts"] = experts
    if top_k is not None:
        out["num_experts_per_tok"] = top_k
    if width is not None:
        out["intermediate_size" if arch in ("mixtral", "olmoe") else "moe_intermediate_size"] = width
    return out


@pytest.fixture(scope="session")
def make_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``make_ckpt(arch, dtype="float32", seed=0, *, experts=, top_k=, width=, router_skew=, shard_bytes=,
    **config_overrides)`` -> directory of a tiny checkpoint.

    ``experts``/``top_k``/``width`` are mapped to the family's field names. Made once per distinct
    argument set for the whole session: treat the files as read-only (tests that damage a checkpoint
    copy it first).
    """
    made: dict[str, Path] = {}

    def make(arch: str, dtype: str = "float32", seed: int = 0, *, experts: int | None = None,
             top_k: int | None = None, width: int | None = None, router_skew: float | None = None,
             shard_bytes: int | None = None, **overrides: Any) -> Path:
        overrides = {**moe_overrides(arch, experts, top_k, width), **overrides}
        key = repr((arch, dtype, seed, router_skew, shard_bytes, sorted(overrides.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"{arch}-{dtype}")
            kwargs: dict[str, Any] = {"seed": seed, "dtype": dtype, "config_overrides": overrides}
            if router_skew is not None:
                kwargs["router_skew"] = router_skew
            if shard_bytes is not None:
                kwargs["shard_bytes"] = shard_bytes
            make_model(out, arch, "tiny", **kwargs)
            made[key] = out
        return made[key]

    return make


class Oracle:
    """transformers as the reference: models cached per (checkpoint, dtype), logits and greedy tokens.

    Eager attention and eager experts: the plainest reference implementation, and the only one that
    takes every shape (transformers' grouped_mm experts path on CPU rejects expert widths whose rows
    are not a multiple of 16 bytes, e.g. width 37 in fp32). EOS is cleared from the generation config
    so that ``generate`` always runs ``max_new_tokens`` steps, as the engine's greedy loops here do.
    """

    def __init__(self, transformers: Any):
        self.transformers = transformers
        self._models: dict[tuple[str, torch.dtype], Any] = {}

    def model(self, path: Path, dtype: torch.dtype = torch.float32) -> Any:
        key = (str(path), dtype)
        if key not in self._models:
            model, info = self.transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, attn_implementation="eager", experts_implementation="eager",
                output_loading_info=True)
            model.eval()
            model.generation_config.eos_token_id = None
            model.moetune_loading_info = info
            self._models[key] = model
        return self._models[key]

    @staticmethod
    def logits(model: Any, token_ids: Sequence[int]) -> torch.Tensor:
        """fp32 logits [L, V] of one sequence in one pass: no padding, no cache."""
        with torch.inference_mode():
            return model(torch.tensor([list(token_ids)])).logits[0].float()

    @staticmethod
    def greedy(model: Any, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        """Greedy continuation of one prompt (no padding): the new tokens only."""
        with torch.inference_mode():
            out = model.generate(torch.tensor([list(prompt)]), do_sample=False, max_new_tokens=max_new_tokens,
                                 min_new_tokens=0, pad_token_id=0)
        return out[0, len(prompt):].tolist()

    def row_errors(self, driver: EngineDriver, model: Any) -> tuple[list[float], float]:
        """max |engine - reference| of every logits row the driver recorded, and the logit scale (the
        largest |reference logit| seen). The reference runs each sequence's full token list at once."""
        errors, scale = [], 0.0
        for seq, rows in driver.logits.items():
            ref = self.logits(model, driver.history[seq])
            for pos, row in rows.items():
                errors.append((row - ref[pos]).abs().max().item())
                scale = max(scale, ref[pos].abs().max().item())
        return errors, scale


@pytest.fixture(scope="session")
def hf() -> Oracle:
    import transformers  # the test extra brings it

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return Oracle(transformers)


@dataclass(repr=False)
class EngineDriver:
    """Drives MoEDecoder.forward step by step and keeps each sequence's tokens, so tests can ask the oracle.

    A sequence is ``admit``-ted into a KV cache slot and ``release``-d from it; a released slot can take
    a new sequence (its stale cache entries must not leak). ``history[seq]`` is the sequence's full
    token list; ``logits[seq]`` maps a position in it to the engine's logits there (the prediction of
    the next token).
    """

    decoder: MoEDecoder
    cache: KVCache
    slot_of: dict[str, int] = field(default_factory=dict)
    history: dict[str, list[int]] = field(default_factory=dict)
    logits: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.decoder.spec.vocab_size

    def random_prompt(self, n_tokens: int, seed: int) -> list[int]:
        """Token ids in [3, vocab) (no pad/bos/eos), reproducible per seed."""
        g = torch.Generator().manual_seed(seed)
        return torch.randint(3, self.vocab_size, (n_tokens,), generator=g).tolist()

    def admit(self, seq: str, slot: int) -> None:
        assert slot not in self.slot_of.values(), f"slot {slot} is taken"
        self.slot_of[seq] = slot
        self.history[seq] = []
        self.logits[seq] = {}

    def release(self, seq: str) -> None:
        del self.slot_of[seq]

    def step(self, chunks: Sequence[tuple[str, Sequence[int]] | tuple[str, Sequence[int], bool]]) -> None:
        """One forward step over ``(seq, tokens[, wants_logits=True])`` chunks, flattened in that order."""
        ids: list[int] = []
        positions: list[int] = []
        segments: list[Segment] = []
        wanted: list[str] = []
        for seq, tokens, *rest in chunks:
            wants = rest[0] if rest else True
            past = len(self.history[seq])
            segments.append(Segment(self.slot_of[seq], len(ids), len(tokens), past, wants))
            ids += tokens
            positions += range(past, past + len(tokens))
            if wants:
                wanted.append(seq)
        out = self.decoder.forward(StepBatch(torch.tensor(ids), torch.tensor(positions), segments), self.cache)
        assert out.shape == (len(wanted), self.vocab_size)
        assert out.dtype == torch.float32
        for seq, tokens, *_ in chunks:
            self.history[seq].extend(tokens)
        for seq, row in zip(wanted, out, strict=True):
            self.logits[seq][len(self.history[seq]) - 1] = row

    def next_token(self, seq: str) -> int:
        """Greedy choice after the last token of ``seq`` (its logits must have been asked for)."""
        last = len(self.history[seq]) - 1
        assert last in self.logits[seq], f"no logits for the last token of {seq}"
        return int(self.logits[seq][last].argmax())

    def decode(self, seqs: Sequence[str]) -> None:
        """One step in which every sequence of ``seqs`` decodes its greedy next token, in that order."""
        self.step([(s, [self.next_token(s)]) for s in seqs])

    def generated(self, seq: str, prompt_len: int) -> list[int]:
        return self.history[seq][prompt_len:]


@pytest.fixture
def open_engine() -> Callable[..., EngineDriver]:
    """``open_engine(path, dtype=torch.float32, n_slots=4, max_len_tokens=256, initial_len_tokens=256,
    reserve=True, weight_dtype=None)``: ``reserve=False`` makes the cache grow from ``initial_len_tokens``
    positions; a ``weight_dtype`` other than ``dtype`` keeps the weights in it (the native kernels' case)."""

    def open_(path: Path, dtype: torch.dtype = torch.float32, n_slots: int = 4, max_len_tokens: int = 256,
              initial_len_tokens: int = 256, reserve: bool = True,
              weight_dtype: torch.dtype | None = None) -> EngineDriver:
        ckpt = Checkpoint(path)
        decoder = MoEDecoder(ckpt, dtype, torch.device("cpu"), weight_dtype=weight_dtype)
        cache = KVCache(ckpt.spec, n_slots, max_len_tokens, dtype, torch.device("cpu"),
                        initial_len=initial_len_tokens, reserve=reserve)
        return EngineDriver(decoder, cache)

    return open_


@pytest.fixture
def native_kernels(require_component):
    """moetune's kernels built: a broken build fails the test; a machine with no compiler at all follows
    ``require_component`` (a failure under ``MOETUNE_TEST_STRICT=1``)."""
    from engine import kernels

    st = kernels.status()
    if st["state"] == "broken":
        pytest.fail(f"the native kernels do not build with {st['compiler']}: {st['error']}", pytrace=False)
    require_component("a C++ compiler", st["state"] != "missing", "apt-get install g++", str(st["error"]))
