"""Output quality of a configuration against a full-precision reference of the same model.

Knobs that change the maths (bit-widths, routing pruning) are measured, never assumed: both runs
read the same prompts, teacher-forced, and every position's next-token distribution is compared:
top-1 agreement (share of positions whose most likely token is the reference's) and the mean
KL(reference || candidate). With a text file and a model tokenizer, perplexity too.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.model.decoder import KVCache, Segment, StepBatch
from engine.runtime import Engine


def reference_config(config: EngineConfig) -> EngineConfig:
    """The full-precision reference: fp32 products and KV cache, every matrix (experts and dense) as loaded,
    every expert resident, the model's own routing."""
    fresh = EngineConfig()
    return EngineConfig.from_dict({
        **config.to_dict(), "experts": fresh.to_dict()["experts"], "execution": fresh.to_dict()["execution"],
        "routing": fresh.to_dict()["routing"],
        "runtime": {**config.to_dict()["runtime"], "compute_dtype": "float32", "kv_dtype": "float32",
                    "dense_precision": "as_loaded"}},
        source="reference")


@torch.inference_mode()
def prompt_logits(engine: Engine, prompt: list[int]) -> torch.Tensor:
    """Teacher-forced next-token logits at every position of ``prompt``: [len, V] fp32 on the CPU."""
    cache = KVCache(engine.spec, 1, len(prompt) + 1, engine.cache.dtype, engine.cache.device)
    dev = engine.device
    batch = StepBatch(torch.tensor(prompt, device=dev), torch.arange(len(prompt), device=dev),
                      [Segment(0, 0, len(prompt), 0, True)], all_logits=True)
    return engine.model.forward(batch, cache).float().cpu()


def compare_logits(ref: list[torch.Tensor], cand: list[torch.Tensor]) -> dict[str, float]:
    agree = total = 0
    kl_sum = 0.0
    for r, c in zip(ref, cand, strict=True):
        agree += int((r.argmax(-1) == c.argmax(-1)).sum())
        total += r.shape[0]
        lp, lq = torch.log_softmax(r.double(), -1), torch.log_softmax(c.double(), -1)
        kl_sum += float((lp.exp() * (lp - lq)).sum())
    return {"top1_agreement": agree / total, "mean_kl": kl_sum / total, "positions": total}


def synthetic_prompts(vocab_size: int, n: int = 8, length: int = 64, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (length,), generator=g).tolist() for _ in range(n)]


def tokenize_text(model_dir: Path, text_file: Path) -> list[int]:
    """Token ids of a text file with the model's tokenizer.json (the ``tokenizers`` package)."""
    tok_path = model_dir / "tokenizer.json"
    if not tok_path.exists():
        raise ValueError(f"{model_dir}: no tokenizer.json, so perplexity on {text_file} cannot be computed")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError("perplexity on a text file needs the `tokenizers` package (pip install tokenizers)") from None
    return Tokenizer.from_file(str(tok_path)).encode(text_file.read_text()).ids


def perplexity(engine: Engine, ids: list[int], window: int = 512) -> float:
    nll, n = 0.0, 0
    for start in range(0, max(1, len(ids) - 1), window):
        chunk = ids[start: start + window + 1]
        if len(chunk) < 2:
            break
        logits = prompt_logits(engine, chunk[:-1])
        target = torch.tensor(chunk[1:])
        nll += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
        n += len(target)
    return math.exp(nll / max(n, 1))


def evaluate_llama(engine: Engine, kind: str, prompts: list[list[int]] | None = None) -> dict[str, Any]:
    """Quality of llama.cpp running ``engine``'s checkpoint as a GGUF of ``kind`` (bf16, q8_0, q4_0; written
    into the cache directory on first use), against the engine's full-precision reference on the same
    prompts: the measure :func:`evaluate` gives the engine's own configs, so the two compare directly.
    ValueError where llama-cpp-python is not installed; CheckpointError where the family has no GGUF writer."""
    from engine import llama_cpp
    from engine.compare_hf import gguf_file
    from engine.model.checkpoint import Checkpoint

    why = llama_cpp.available()
    if why is not None:
        raise ValueError(f"llama.cpp {kind}: {why}")
    if kind not in llama_cpp.GGUF_KINDS:
        raise ValueError(f"llama.cpp {kind!r}: not one of {', '.join(llama_cpp.GGUF_KINDS)}")
    prompts = prompts or synthetic_prompts(engine.spec.vocab_size, seed=engine.config.runtime.seed)
    path = gguf_file(Path(engine.model_path), Checkpoint(engine.model_path).fingerprint(), kind)
    cand_cfg = engine.config
    engine.reconfigure(reference_config(cand_cfg))
    ref = [prompt_logits(engine, p) for p in prompts]
    engine.reconfigure(cand_cfg)
    extra, label = llama_cpp.extra_buffer_types(path, 1, torch.get_num_threads())
    runner = llama_cpp.LlamaCpp(path, 1, max(len(p) for p in prompts) + 1, torch.get_num_threads(), extra)
    try:
        cand = [runner.prompt_logits(p) for p in prompts]
    finally:
        runner.close()
    out = compare_logits(ref, cand)
    out["prompts"] = len(prompts)
    out["gguf"] = str(path)
    out["extra_buffer_types"] = label
    return out


def evaluate(engine: Engine, prompts: list[list[int]] | None = None, text_file: str | None = None
             ) -> dict[str, Any]:
    """Quality of ``engine``'s current config against its full-precision reference.

    The engine is reconfigured to the reference and back (weights reload only when the compute dtype
    differs), so one model is in memory at a time.
    """
    cand_cfg = engine.config
    prompts = prompts or synthetic_prompts(engine.spec.vocab_size, seed=cand_cfg.runtime.seed)
    ids = tokenize_text(engine.model_path, Path(text_file)) if text_file else None
    engine.reconfigure(reference_config(cand_cfg))
    ref = [prompt_logits(engine, p) for p in prompts]
    ref_ppl = perplexity(engine, ids) if ids else None
    engine.reconfigure(cand_cfg)
    if engine.model.hybrid is not None:
        engine.warm_up_hotness()
    cand = [prompt_logits(engine, p) for p in prompts]
    out = compare_logits(ref, cand)
    out["prompts"] = len(prompts)
    if ids:
        out["perplexity"] = perplexity(engine, ids)
        out["reference_perplexity"] = ref_ppl
    return out
