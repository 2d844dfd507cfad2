"""The KV cache: on the CPU it holds every position from the start, commits memory only where positions are
written, and never moves; where it grows, it keeps what it holds. The rotary tables: the CPU's rows from a
table are the rows computed per step, bit for bit."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
import torch

from engine.config import EngineConfig
from engine.model.checkpoint import Checkpoint
from engine.model.decoder import KVCache, MoEDecoder, RoPE
from engine.model.maker import make_model
from engine.runtime import Engine


@pytest.fixture(scope="module")
def spec(make_ckpt):
    return Checkpoint(make_ckpt("qwen3_moe")).spec  # 2 layers, 2 KV heads, head size 16


def test_a_cpu_cache_holds_every_position_and_commits_only_what_is_written(spec):
    rss = psutil.Process().memory_info().rss
    # 64 slots x 65536 positions: 512 MiB a tensor, 2 GiB for the 2 layers' keys and values.
    cache = KVCache(spec, 64, 1 << 16, torch.float32, torch.device("cpu"))
    assert cache.reserved and cache.capacity == 1 << 16
    assert cache.nbytes() == 4 * 64 * 2 * (1 << 16) * 16 * 4
    for t in cache.k + cache.v:
        t[:, :, :10] = 1.0  # ten positions in every slot: 64 x 2 rows of a page each
    grown_mib = (psutil.Process().memory_info().rss - rss) / 2**20
    assert grown_mib < 64, f"writing 10 positions committed {grown_mib:.0f} MiB of a 2048 MiB cache"
    k = cache.k[1]
    assert k[:, :, :10].eq(1.0).all() and k[:, :, 10:4096].eq(0.0).all() and k[:, :, -1].eq(0.0).all()
    pointer = k.data_ptr()
    cache.ensure(1 << 16)
    assert cache.k[1].data_ptr() == pointer
    with pytest.raises(ValueError, match="max_seq_len_tokens=65536"):
        cache.ensure((1 << 16) + 1)


def test_a_growing_cache_keeps_its_positions_and_zeroes_the_new_ones(spec):
    cache = KVCache(spec, 3, 200, torch.bfloat16, torch.device("cpu"), initial_len=8, reserve=False)
    assert not cache.reserved and cache.capacity == 8
    g = torch.Generator().manual_seed(0)
    old = [torch.randn(cache.k[i].shape, generator=g).to(torch.bfloat16) for i in range(spec.n_layers)]
    for i, values in enumerate(old):
        cache.k[i].copy_(values)
        cache.v[i].copy_(-values)
    cache.ensure(9)
    assert cache.capacity == 64  # at least doubled, and never under 64 positions
    for i, values in enumerate(old):
        assert torch.equal(cache.k[i][:, :, :8], values) and torch.equal(cache.v[i][:, :, :8], -values)
        assert cache.k[i][:, :, 8:].eq(0).all() and cache.v[i][:, :, 8:].eq(0).all()
    cache.ensure(150)
    assert cache.capacity == 150 and torch.equal(cache.k[0][:, :, :8], old[0])  # 2 x 64 < 150 <= max_len


def test_a_refused_reservation_grows_instead(spec):
    # 2048 slots x 4 Mi positions is 1 PiB a tensor, more than a 47-bit address space: no mapping is made.
    cache = KVCache(spec, 2048, 1 << 22, torch.float32, torch.device("cpu"), initial_len=64)
    assert not cache.reserved and cache.capacity == 64
    assert [t.shape for t in cache.k] == [(2048, 2, 64, 16)] * spec.n_layers


def test_the_engine_decodes_past_its_first_pages_on_a_cache_that_never_moves(tmp_path):
    """Native kernels (a bf16 checkpoint) through the fused decode step: a 250-token prompt and 40 new
    tokens cross the 256 positions where a growing cache doubled; the reserved cache stays put and gives
    the tokens a growing one gives."""
    make_model(tmp_path, "qwen3_moe", "tiny", seed=3, dtype="bfloat16")
    eng = Engine(str(tmp_path), EngineConfig().replace(max_seq_len_tokens=512, max_batch_seqs=2))
    prompt = torch.randint(3, eng.spec.vocab_size, (250,), generator=torch.Generator().manual_seed(1)).tolist()
    assert eng.cache.reserved
    pointers = [t.data_ptr() for t in eng.cache.k + eng.cache.v]
    reserved = eng.generate([prompt], 40)[0]
    assert [t.data_ptr() for t in eng.cache.k + eng.cache.v] == pointers
    eng.cache = KVCache(eng.spec, 2, 512, eng.cache.dtype, eng.device, initial_len=64, reserve=False)
    grown = eng.generate([prompt], 40)[0]
    assert eng.cache.capacity >= 290  # grown twice: 64 -> 250 for the prompt, then doubled
    assert grown == reserved


@pytest.mark.parametrize("head_dim", [64, 80, 12])
def test_rope_rows_from_the_table_are_the_rows_computed_per_step(head_dim):
    rope = RoPE(head_dim, 1e6, torch.device("cpu"))
    steps = [torch.tensor([0]), torch.arange(3, 40), torch.tensor([300, 7, 4000]), torch.arange(4090, 4130),
             torch.tensor([RoPE.TABLE_POSITIONS - 1]), torch.tensor([5, RoPE.TABLE_POSITIONS + 9])]
    for dtype in (torch.float32, torch.bfloat16):
        for positions in steps:  # rising positions grow the table; past its cap they are computed
            got, ref = rope.cos_sin(positions, dtype), rope._compute(positions, dtype)
            assert got[0].dtype == dtype and torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
        assert rope._tables[dtype][0].shape[0] == RoPE.TABLE_POSITIONS
    assert rope.cos_sin(torch.empty(0, dtype=torch.long), torch.float32)[0].shape == (0, head_dim)


def _mapping_of(t: torch.Tensor) -> str:
    """The file of the mapping that holds ``t``'s first byte ('' for anonymous memory), from /proc/self/maps."""
    address = t.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= address < hi:
            return fields[5].strip() if len(fields) > 5 else ""
    raise AssertionError(f"{address:#x} is in no mapping")


@pytest.mark.parametrize("tied", [False, True])
def test_the_weights_a_step_reads_whole_are_copied_out_of_the_checkpoints_mapping(make_ckpt, tied):
    """bf16 weights load as stored (no conversion copies them): each matrix and vector a step reads whole is
    still copied into memory of the engine's own (huge pages, engine.model.decoder.owned); the untied
    embedding, read a row at a time, stays in the mapping, and a tied one is the lm head."""
    path = make_ckpt("qwen3_moe", "bfloat16", tie_word_embeddings=tied)
    dec = MoEDecoder(Checkpoint(path), torch.float32, torch.device("cpu"), weight_dtype=torch.bfloat16)
    files = {str(f.resolve()) for f in path.glob("*.safetensors")}
    assert str(Path(_mapping_of(Checkpoint(path).get("model.embed_tokens.weight")))) in files  # mapped as loaded
    reads = {"lm_head": dec.lm_head, "final_norm": dec.final_norm}
    for i, lw in enumerate(dec.layers):
        reads.update({f"{i}.{k}": t for k, t in vars(lw).items() if isinstance(t, torch.Tensor)})
    assert {"0.wo", "0.wqkv", "0.w13", "0.router"} <= set(reads)
    mapped = {name for name, t in reads.items() if _mapping_of(t) in files}
    assert not mapped, f"read from the checkpoint's mapping: {sorted(mapped)}"
    assert (_mapping_of(dec.embed) in files) == (not tied)
    assert (dec.lm_head is dec.embed) == tied
