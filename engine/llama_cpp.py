"""llama.cpp on the same checkpoint: GGUF files written from it, and a batched greedy runner.

Optional: writing GGUF files needs the ``gguf`` package, running them ``llama-cpp-python`` (both in the
``llama`` extra; neither is needed by the engine). :func:`write_gguf` converts a qwen3_moe checkpoint in
the Hugging Face layout to llama.cpp's ``qwen3moe`` GGUF, in one of:

* ``bf16``: every matrix bf16 (norms and the router in f32), as the checkpoint stores it;
* ``q8_0``: every matrix in Q8_0 (int8 with one f16 scale per 32 values) except the router (f32);
* ``q4_0``: the routed experts' matrices in Q4_0 (4-bit with one f16 scale per 32 values), the other
  matrices in Q8_0, the router in f32.

The checkpoints moetune makes have no tokenizer; the GGUF gets a placeholder SentencePiece vocabulary of
the model's size (``<unk>``, ``<s>``, ``</s>``, 256 byte tokens, then ``▁w<i>``). Prompts are token ids,
so the vocabulary's text never matters. :class:`LlamaCpp` prefills B prompts as B sequences in one
batch and decodes them together, greedy, with llama.cpp's own threads (``n_threads``).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.model.arch import CheckpointError
from engine.model.checkpoint import Checkpoint

log = logging.getLogger(__name__)

GGUF_KINDS = ("bf16", "q8_0", "q4_0")


def available() -> str | None:
    """None when llama-cpp-python and gguf import, else the reason (one line)."""
    try:
        import gguf  # noqa: F401
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return f"{e.name or 'llama_cpp'} is not installed (pip install llama-cpp-python gguf)"
    return None


def write_gguf(model_dir: str | Path, out: str | Path, kind: str) -> Path:
    """Write the qwen3_moe checkpoint at ``model_dir`` as a GGUF file of ``kind`` (see the module doc)."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    if kind not in GGUF_KINDS:
        raise ValueError(f"gguf kind={kind!r}: expected one of {', '.join(GGUF_KINDS)}")
    ckpt = Checkpoint(Path(model_dir))
    spec = ckpt.spec
    if spec.arch != "qwen3_moe" or any(not spec.is_moe_layer(i) for i in range(spec.n_layers)):
        raise CheckpointError(f"{model_dir}: GGUF export is written for qwen3_moe checkpoints whose layers are all "
                              f"MoE (got {spec.arch})")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(out), "qwen3moe")
    w.add_name(f"moetune {Path(model_dir).name}")
    w.add_file_type({"bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                     "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[kind])
    w.add_block_count(spec.n_layers)
    w.add_context_length(spec.max_position_embeddings)
    w.add_embedding_length(spec.hidden_size)
    w.add_feed_forward_length(spec.dense_intermediate or spec.expert_intermediate)
    w.add_head_count(spec.n_heads)
    w.add_head_count_kv(spec.n_kv_heads)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(spec.rms_eps)
    w.add_expert_count(spec.n_experts)
    w.add_expert_used_count(spec.top_k)
    w.add_expert_feed_forward_length(spec.expert_intermediate)
    n_vocab = spec.vocab_size
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581w{i}" for i in range(n_vocab - len(tokens))]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    types += [gguf.TokenType.NORMAL] * (n_vocab - len(types))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens[:n_vocab])
    w.add_token_scores([-float(i) for i in range(n_vocab)])
    w.add_token_types(types[:n_vocab])
    w.add_unk_token_id(0)
    w.add_bos_token_id(spec.bos_token_id if spec.bos_token_id is not None else 1)
    w.add_eos_token_id(spec.eos_token_ids[0] if spec.eos_token_ids else 2)
    w.add_add_bos_token(False)

    def put(name: str, t: torch.Tensor, qtype: Any) -> None:
        a = t.float().numpy() if qtype != Q.BF16 else None
        if qtype == Q.F32:
            w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
        elif qtype == Q.BF16:
            raw = t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint8)
            w.add_tensor(name, raw.reshape(*t.shape[:-1], t.shape[-1] * 2), raw_dtype=Q.BF16)
        else:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)

    dense_q = {"bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q8_0}[kind]
    expert_q = {"bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}[kind]
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    got = dict(ckpt.tensors([n for n in names if n != "lm_head.weight" or not spec.tie_word_embeddings]))
    put("token_embd.weight", got["model.embed_tokens.weight"], dense_q)
    put("output_norm.weight", got["model.norm.weight"], Q.F32)
    put("output.weight", got.get("lm_head.weight", got["model.embed_tokens.weight"]), dense_q)
    for i in range(spec.n_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        layer = dict(ckpt.tensors([p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
                                   a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight", a + "o_proj.weight",
                                   a + "q_norm.weight", a + "k_norm.weight", ckpt.router_name(i)]))
        b = f"blk.{i}."
        put(b + "attn_norm.weight", layer[p + "input_layernorm.weight"], Q.F32)
        put(b + "ffn_norm.weight", layer[p + "post_attention_layernorm.weight"], Q.F32)
        for src, dst in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
            put(b + dst + ".weight", layer[a + src + ".weight"], dense_q)
        put(b + "attn_q_norm.weight", layer[a + "q_norm.weight"], Q.F32)
        put(b + "attn_k_norm.weight", layer[a + "k_norm.weight"], Q.F32)
        put(b + "ffn_gate_inp.weight", layer[ckpt.router_name(i)], Q.F32)
        inter = spec.expert_intermediate
        w13 = torch.empty(spec.n_experts, 2 * inter, spec.hidden_size, dtype=ckpt.dtype)
        w2 = torch.empty(spec.n_experts, spec.hidden_size, inter, dtype=ckpt.dtype)
        ckpt.read_experts(i, w13, w2)  # either checkpoint layout (per expert or fused)
        put(b + "ffn_gate_exps.weight", w13[:, :inter], expert_q)  # [E, out, in]
        put(b + "ffn_up_exps.weight", w13[:, inter:], expert_q)
        put(b + "ffn_down_exps.weight", w2, expert_q)
        del w13, w2
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def gguf_bytes_per_token(path: str | Path, n_experts: int, top_k: int, experts_touched: float | None = None) -> dict:
    """Bytes a one-token step reads from a GGUF file: every tensor but the token embedding (one row),
    and of the expert tensors only ``experts_touched`` (default ``top_k``) of ``n_experts``."""
    import gguf

    r = gguf.GGUFReader(str(path))
    dense = experts = 0
    for t in r.tensors:
        n = int(t.n_bytes)
        if t.name == "token_embd.weight":
            continue
        if "_exps." in t.name:
            experts += n
        else:
            dense += n
    touched = top_k if experts_touched is None else experts_touched
    return {"dense_bytes": dense, "expert_bytes_per_expert_all_layers": experts / n_experts,
            "bytes_per_step": dense + experts * touched / n_experts}


_LOG_CALLBACK: Any = None


def _quiet(lc: Any) -> None:
    """Route llama.cpp's log lines to this module's logger at debug level (it prints hundreds per load)."""
    global _LOG_CALLBACK
    if _LOG_CALLBACK is None:
        @lc.llama_log_callback
        def callback(level, text, user_data):  # noqa: ARG001 - llama.cpp's signature
            log.debug("llama.cpp: %s", text.decode(errors="replace").rstrip())

        _LOG_CALLBACK = callback
        lc.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))


class LlamaCpp:
    """One GGUF model in llama.cpp, run through llama-cpp-python's low-level API: B prompts prefilled as B
    sequences of one batch, then decoded together, greedy (argmax of the logits). ``extra_buffer_types=False``
    keeps llama.cpp's weights in its plain CPU layout (see :func:`extra_buffer_types`)."""

    def __init__(self, gguf_path: str | Path, n_seqs: int, n_ctx_per_seq: int, threads: int,
                 extra_buffer_types: bool = True):
        import llama_cpp as lc

        self.lc = lc
        _quiet(lc)
        lc.llama_backend_init()
        mp = lc.llama_model_default_params()
        if not extra_buffer_types:
            if not hasattr(mp, "use_extra_bufts"):
                raise RuntimeError(f"llama-cpp-python {getattr(lc, '__version__', '?')} cannot turn off llama.cpp's "
                                   "extra buffer types")
            mp.use_extra_bufts = False
        self.model = lc.llama_model_load_from_file(str(gguf_path).encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path}")
        self.vocab = lc.llama_model_get_vocab(self.model)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        self.n_seqs = n_seqs
        self.max_batch = n_seqs * n_ctx_per_seq
        cp = lc.llama_context_default_params()
        cp.n_ctx = n_seqs * n_ctx_per_seq
        cp.n_batch = self.max_batch
        cp.n_ubatch = 512
        cp.n_seq_max = n_seqs
        cp.n_threads = threads
        cp.n_threads_batch = threads
        cp.kv_unified = True
        self.ctx = lc.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context for {gguf_path}")
        self.batch = lc.llama_batch_init(self.max_batch, 0, 1)
        self.path = Path(gguf_path)

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> None:
        """rows: (token, position, sequence, wants logits)."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(rows):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        b.n_tokens = len(rows)
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, i: int) -> int:
        ptr = self.lc.llama_get_logits_ith(self.ctx, i)
        return int(np.argmax(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                                    shape=(self.n_vocab,))))

    def prompt_logits(self, prompt: list[int]) -> torch.Tensor:
        """Teacher-forced next-token logits at every position of ``prompt`` (one sequence, a fresh cache):
        [len, V] fp32, as :func:`engine.quality.prompt_logits` gives the engine's."""
        if len(prompt) > self.max_batch:
            raise ValueError(f"a prompt of {len(prompt)} tokens for a context of {self.max_batch}")
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        self._decode([(tok, j, 0, True) for j, tok in enumerate(prompt)])
        rows = []
        for i in range(len(prompt)):
            ptr = ctypes.cast(self.lc.llama_get_logits_ith(self.ctx, i), ctypes.POINTER(ctypes.c_float))
            rows.append(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy())
        return torch.from_numpy(np.stack(rows))

    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[float], list[list[int]]]:
        """Prefill every prompt in one batch (timed), then decode them together; returns (prefill seconds,
        seconds per decode step, generated ids per prompt)."""
        if len(prompts) > self.n_seqs:
            raise ValueError(f"{len(prompts)} prompts for a context of {self.n_seqs} sequences")
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        rows, last = [], []
        for s, p in enumerate(prompts):
            rows += [(tok, j, s, j == len(p) - 1) for j, tok in enumerate(p)]
            last.append(len(rows) - 1)
        t = time.perf_counter()
        self._decode(rows)
        out = [[self._argmax(i)] for i in last]
        prefill_s = time.perf_counter() - t
        steps = []
        for _ in range(new_tokens - 1):
            t = time.perf_counter()
            self._decode([(o[-1], len(p) + len(o) - 1, s, True) for s, (p, o) in enumerate(zip(prompts, out, strict=True))])
            for s in range(len(prompts)):
                out[s].append(self._argmax(s))
            steps.append(time.perf_counter() - t)
        return prefill_s, steps, out

    def close(self) -> None:
        lc = self.lc
        if getattr(self, "batch", None) is not None:
            lc.llama_batch_free(self.batch)
            self.batch = None
        if getattr(self, "ctx", None):
            lc.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            lc.llama_model_free(self.model)
            self.model = None


# llama.cpp's CPU backend runs its threads through libgomp, which reads its wait settings once per process:
# in this process it would wait as the engine chose (about 100 us of spins), not as llama.cpp waits when
# users run it. Measured in the engine's process while that was OMP_WAIT_POLICY=PASSIVE (2026-12-04, 2-core
# EPYC, medium checkpoint, batch 1, 2 rounds): bf16 38.4, q8_0 49.4, q4_0 65.8 tok/s, against 46.1, 70.3
# and 93.1 with libgomp's default. So the comparison runs llama.cpp in a process of its own.
LIBGOMP_DEFAULT_SPIN_COUNT = "300000"  # libgomp's own default when neither variable is set: spin, then sleep


def own_environment() -> tuple[dict[str, str], str]:
    """The environment llama.cpp runs in, and how its OpenMP threads wait there: the user's settings where
    they set any (the engine runs with them too), else libgomp's default, as outside moetune."""
    from engine.env import apply_omp_wait_policy

    value, source = apply_omp_wait_policy()
    env = dict(os.environ)
    if not source.startswith("moetune default"):
        return env, f"{value} ({source})"
    env["GOMP_SPINCOUNT"] = LIBGOMP_DEFAULT_SPIN_COUNT  # the same as unset, and the child's engine import keeps it
    return env, f"libgomp default (GOMP_SPINCOUNT={LIBGOMP_DEFAULT_SPIN_COUNT})"


class LlamaCppCrashed(RuntimeError):
    """The llama.cpp child process died on a signal."""


class LlamaCppProcess:
    """:class:`LlamaCpp` in a child process with llama.cpp's own OpenMP settings (:func:`own_environment`):
    the same ``generate``, timed in the child; one JSON line each way per call. A child that dies on a
    signal raises :class:`LlamaCppCrashed`."""

    def __init__(self, gguf_path: str | Path, n_seqs: int, n_ctx_per_seq: int, threads: int,
                 extra_buffer_types: bool = True):
        env, self.openmp = own_environment()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine.llama_cpp", str(gguf_path), str(n_seqs), str(n_ctx_per_seq), str(threads),
             "1" if extra_buffer_types else "0"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        try:
            self._reply()
        except BaseException:
            self.close()
            raise

    def _reply(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            status = self.proc.wait()
            if status < 0:
                raise LlamaCppCrashed(f"the llama.cpp process died on signal {-status} ({_signal_name(-status)})")
            raise RuntimeError(f"the llama.cpp process exited with status {status}")
        msg = json.loads(line)
        if "error" in msg:
            raise RuntimeError(msg["error"])
        return msg

    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[float], list[list[int]]]:
        with contextlib.suppress(BrokenPipeError):  # a child that is gone: _reply says how it ended
            self.proc.stdin.write(json.dumps({"prompts": prompts, "new_tokens": new_tokens}) + "\n")
            self.proc.stdin.flush()
        msg = self._reply()
        return msg["prefill_s"], msg["steps"], msg["out"]

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.close()  # the child's end of input: it frees the model and exits
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown signal"


_EXTRA_BUFFER_TYPES: dict[tuple[str, int, int], tuple[bool, str]] = {}


def extra_buffer_types(gguf_path: str | Path, n_seqs: int, threads: int) -> tuple[bool, str]:
    """Whether llama.cpp runs ``gguf_path`` here with its extra buffer types, and what results record.

    Its extra buffer types hold weights in layouts for the CPU's own paths: on x86, AMX tiles (on CPUs with
    AMX) and repacked Q4_0/Q8_0 blocks. On an AMX CPU (Xeon, AVX-512 with AMX_INT8, 2026-12-04) the AMX one
    killed llama.cpp 0.3.36 (llama-cpp-python) with SIGSEGV on its first Q8_0 product, inside the process
    that loaded it; llama.cpp issue 20824 reports the same crash in ``ggml_backend_amx_mul_mat``. So a
    child process first runs one batch of ``n_seqs`` 16-token prompts and 3 new tokens with them; where it
    dies on a signal, llama.cpp runs without them (its weights as stored, its plain AVX-512 / AVX2
    products), and the label says so. Once per process per file, batch size and thread count."""
    key = (str(gguf_path), n_seqs, threads)
    if key not in _EXTRA_BUFFER_TYPES:
        probe = None
        try:
            probe = LlamaCppProcess(gguf_path, n_seqs, 24, threads)  # a crash while loading counts too
            probe.generate([[3 + (i + j) % 64 for j in range(16)] for i in range(n_seqs)], 3)
            _EXTRA_BUFFER_TYPES[key] = (True, "on")
        except LlamaCppCrashed as e:
            log.warning("llama.cpp: %s with its extra buffer types on %s; running it without them", e, gguf_path)
            _EXTRA_BUFFER_TYPES[key] = (False, f"off: with them {e} at batch {n_seqs}")
        finally:
            if probe is not None:
                probe.close()
    return _EXTRA_BUFFER_TYPES[key]


def _child(argv: list[str]) -> int:
    """The process :class:`LlamaCppProcess` starts: requests on stdin, replies on the original stdout (what
    llama.cpp itself prints goes to stderr)."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def reply(msg: dict[str, Any]) -> None:
        out.write(json.dumps(msg) + "\n")
        out.flush()

    try:
        runner = LlamaCpp(argv[0], int(argv[1]), int(argv[2]), int(argv[3]), argv[4:] != ["0"])
    except Exception as e:  # noqa: BLE001 - reported to the parent, which names the system and goes on
        reply({"error": f"{type(e).__name__}: {e}"})
        return 1
    reply({"ready": True})
    try:
        for line in sys.stdin:
            req = json.loads(line)
            try:
                prefill_s, steps, ids = runner.generate(req["prompts"], int(req["new_tokens"]))
                reply({"prefill_s": prefill_s, "steps": steps, "out": ids})
            except Exception as e:  # noqa: BLE001 - the parent raises it
                reply({"error": f"{type(e).__name__}: {e}"})
    finally:
        runner.close()
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
