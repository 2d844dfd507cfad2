"""The ranks of one expert-parallel engine: launch, process group, rank 0's commands, the watchdogs.

Rank 0 is the process that builds the :class:`~engine.runtime.Engine` (a command, the tuner, a test):
:class:`Driver` spawns ranks 1..N-1 with ``torch.multiprocessing`` (spawn), rendezvous on a
``torch.distributed`` TCP store on loopback, and joins the default process group with them (gloo on
the CPU, NCCL with gloo for CPU tensors on CUDA, one GPU per rank). Rank 0 alone schedules and
samples; each forward pass starts with a broadcast of the step (token ids, positions, segments, which
KV cache), so every rank runs the same attention on the same tokens and the MoE layers' collectives
line up. The other ranks run :func:`follow`: a loop over commands (step, config, placement, stop).

Commands travel on a second gloo group with a long timeout (a rank may wait for the next request for a
long time); the collectives inside a step use the default group, whose timeout is
``parallel.ep_timeout_s``. A rank that dies closes its sockets, so the others' next collective fails
at once: rank 0 names the dead rank in one line (:class:`EPError`) and stops the rest; a worker whose
rank 0 is gone (its parent process changed, or a collective failed) prints one line and exits. A rank
that hangs is caught by the timeout.
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from engine.parallel import EPError

log = logging.getLogger(__name__)

CMD_STEP, CMD_CONFIG, CMD_PLACE, CMD_STOP = 1, 2, 3, 4
HEADER_LEN = 8
COMMAND_TIMEOUT = datetime.timedelta(days=7)
"""How long a rank waits for rank 0's next command (the watchdogs catch a dead rank 0 sooner)."""
PARENT_POLL_S = 0.5
JOINED_KEY = "moetune/ep/joined"
"""Store counter every rank bumps before the rendezvous (rank 0 watches the processes until it is full)."""

@dataclass(frozen=True)
class RankSetup:
    """What every rank needs to build its part of the model (plain JSON types)."""

    model: str
    config: dict[str, Any]
    dtype: str
    weight_dtype: str
    device_type: str
    n_ranks: int
    threads: int
    port: int = 0
    parent_pid: int = 0

    def device(self, rank: int) -> torch.device:
        return torch.device(f"cuda:{rank}") if self.device_type == "cuda" else torch.device("cpu")


def backend_for(device_type: str) -> str:
    """gloo on the CPU; on CUDA NCCL for device tensors and gloo for the CPU tensors of commands."""
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def comm_ctas(share: float, sms: int) -> int | None:
    """NCCL's CTA cap under an SM partition: the SMs ``execution.expert_sm_share`` leaves to everything but
    expert compute (None at a share of 1: NCCL picks its own)."""
    if share >= 1.0:
        return None
    from engine.moe.experts import expert_sms

    return max(1, sms - expert_sms(share, sms))


def group_options(setup: RankSetup, rank: int) -> Any:
    """``pg_options`` of the default group: on CUDA with ``execution.expert_sm_share`` < 1, NCCL's
    communicators capped at :func:`comm_ctas` CTAs, so the combine's all-reduce runs on the SMs expert
    compute leaves (its green context holds the others: ``engine.parallel.ep``); None otherwise."""
    share = float(setup.config.get("execution", {}).get("expert_sm_share", 1.0))
    if setup.device_type != "cuda" or share >= 1.0 or not dist.is_nccl_available():
        return None
    sms = torch.cuda.get_device_properties(setup.device(rank)).multi_processor_count
    options = dist.ProcessGroupNCCL.Options()
    options.config.max_ctas = comm_ctas(share, sms)
    return options


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _exit_text(code: int | None) -> str:
    if code is None:
        return "is alive"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


class Driver:
    """Rank 0's side: the spawned ranks, the process group, commands and the watchdog."""

    def __init__(self, setup: RankSetup, timeout_s: float):
        import torch.multiprocessing as mp

        if dist.is_initialized():
            raise EPError("parallel.ep_size > 1: this process already has a torch.distributed process group "
                          "(another expert-parallel engine is open; close it first)")
        self.n_ranks = setup.n_ranks
        self.timeout_s = timeout_s
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore("127.0.0.1", 0, setup.n_ranks, True, timeout=timeout, wait_for_workers=False)
        setup = RankSetup(**{**asdict(setup), "port": self.store.port, "parent_pid": os.getpid()})
        self.context = mp.start_processes(_worker_entry, args=(json.dumps(asdict(setup)),),
                                          nprocs=setup.n_ranks - 1, join=False, start_method="spawn")
        self.closed = False
        self.broken: str | None = None
        self._wait_for_ranks(timeout_s)
        try:
            dist.init_process_group(backend_for(setup.device_type), store=self.store, rank=0,
                                    world_size=setup.n_ranks, timeout=timeout, pg_options=group_options(setup, 0))
            self.commands = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
        except Exception as e:
            self._fail(e, "starting the process group")
        atexit.register(self.close)  # a command that ends without closing its engine still stops the ranks
        log.info("expert parallelism: %d ranks on %s (pids %s)", setup.n_ranks, backend_for(setup.device_type),
                 self.pids)

    def _wait_for_ranks(self, timeout_s: float) -> None:
        """Wait until every spawned rank has reached the store, watching them: a rank that dies while it
        starts (imports, loading) is named at once instead of holding the rendezvous for the timeout."""
        deadline = time.monotonic() + timeout_s
        while self.store.add(JOINED_KEY, 0) < self.n_ranks - 1:
            dead = self.dead()
            if dead:
                self._fail(None, "starting the ranks", dead)
            if time.monotonic() > deadline:
                self._fail(None, "starting the ranks", [f"ranks did not start within parallel.ep_timeout_s="
                                                        f"{timeout_s:g}"])
            time.sleep(0.05)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.context.processes]

    # ------------------------------------------------------------------ watchdog
    def dead(self) -> list[str]:
        """One description per rank that has exited."""
        out = []
        for i, p in enumerate(self.context.processes):
            if p.exitcode is not None:
                out.append(f"rank {i + 1} (pid {p.pid}) {_exit_text(p.exitcode)}")
        return out

    def check(self) -> None:
        """Raise :class:`EPError` if a rank has died (before a step, so a dead rank is named at once)."""
        if self.broken:
            raise EPError(self.broken)
        dead = self.dead()
        if dead:
            self._fail(None, "before a step", dead)

    def _fail(self, e: BaseException | None, during: str, dead: list[str] | None = None) -> None:
        """Name what failed in one line, stop the other ranks, raise :class:`EPError`."""
        if dead is None:
            deadline = time.monotonic() + 2.0  # a rank that died makes the collective fail before it is reaped
            while not (dead := self.dead()) and time.monotonic() < deadline:
                time.sleep(0.05)
        if dead:
            msg = f"expert parallelism: {'; '.join(dead)} ({during}); the other ranks were stopped"
        else:
            msg = (f"expert parallelism: a collective failed {during} "
                   f"(parallel.ep_timeout_s={self.timeout_s:g}): {_first_line(e) if e else 'unknown'}")
        self.broken = msg
        self._stop_workers(graceful=False)
        raise EPError(msg) from None

    def collective(self, during: str):
        """Context manager: a collective's failure becomes one :class:`EPError` line naming the rank."""
        return _Guard(self, during)

    # ------------------------------------------------------------------ commands
    def send(self, cmd: int, fields: list[int], payload: torch.Tensor | None = None) -> None:
        """Broadcast a command header (and its payload) to every rank."""
        self.check()
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        header[0] = cmd
        header[1: 1 + len(fields)] = torch.tensor(fields, dtype=torch.int64)
        with self.collective("sending a command"):
            dist.broadcast(header, 0, group=self.commands)
            if payload is not None:
                dist.broadcast(payload.contiguous(), 0, group=self.commands)

    def send_step(self, token_ids: torch.Tensor, positions: torch.Tensor, segments: list, cache) -> None:
        """The step every rank runs: tokens, positions, segments and rank 0's KV cache (serial, slots,
        longest length, dtype)."""
        from engine.precision import dtype_name

        seg = torch.tensor([[s.slot, s.start, s.n_tokens, s.past_len] for s in segments],
                           dtype=torch.int64).reshape(-1)
        payload = torch.cat([token_ids.detach().to("cpu", torch.int64), positions.detach().to("cpu", torch.int64),
                             seg])
        dtype_code = list(_KV_DTYPES).index(dtype_name(cache.dtype))
        self.send(CMD_STEP, [int(token_ids.shape[0]), len(segments), cache.serial, cache.n_slots, cache.max_len,
                             dtype_code], payload)

    def send_config(self, config_dict: dict[str, Any]) -> None:
        blob = torch.frombuffer(bytearray(json.dumps(config_dict).encode()), dtype=torch.uint8)
        self.send(CMD_CONFIG, [int(blob.numel())], blob)

    def send_place(self, hotness) -> None:
        if hotness is None:
            self.send(CMD_PLACE, [0, 0])
            return
        import numpy as np

        h = torch.from_numpy(np.ascontiguousarray(hotness, dtype=np.float64))
        self.send(CMD_PLACE, [int(h.shape[0]), int(h.shape[1])], h.reshape(-1))

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Stop the other ranks (a stop command, then signals for any that linger) and leave the group."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        if not self.broken and not self.dead():
            try:
                header = torch.zeros(HEADER_LEN, dtype=torch.int64)
                header[0] = CMD_STOP
                dist.broadcast(header, 0, group=self.commands)
            except Exception as e:  # a rank died meanwhile: the signals below stop the rest
                log.warning("expert parallelism: stop command failed: %s", _first_line(e))
        self._stop_workers(graceful=not self.broken)
        if dist.is_initialized():
            dist.destroy_process_group()

    def _stop_workers(self, graceful: bool) -> None:
        deadline = time.monotonic() + (10.0 if graceful else 0.0)
        for p in self.context.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.context.processes:
            if p.is_alive():
                p.terminate()
        for p in self.context.processes:
            p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join()


class _Guard:
    def __init__(self, driver: Driver, during: str):
        self.driver, self.during = driver, during

    def __enter__(self) -> None:
        return None

    def __exit__(self, tp, e, tb) -> bool:
        if e is None or isinstance(e, EPError):
            return False
        if isinstance(e, (RuntimeError, dist.DistError)):
            self.driver._fail(e, self.during)
        return False


_KV_DTYPES = ("float32", "bfloat16", "float16")


# ---------------------------------------------------------------------------------------------- ranks 1..N-1

def _parent_watchdog(parent_pid: int, rank: int) -> None:
    """Exit when rank 0 (the parent process) is gone, whatever this rank is blocked in."""
    while True:
        if os.getppid() != parent_pid:
            print(f"engine: rank {rank}: rank 0 (pid {parent_pid}) is gone; exiting", file=sys.stderr, flush=True)
            os._exit(1)
        time.sleep(PARENT_POLL_S)


def _worker_entry(index: int, setup_json: str) -> None:
    """Entry point of rank ``index + 1`` (torch.multiprocessing passes the index)."""
    setup = RankSetup(**json.loads(setup_json))
    rank = index + 1
    threading.Thread(target=_parent_watchdog, args=(setup.parent_pid, rank), daemon=True,
                     name="moetune-ep-watchdog").start()
    running = [True]

    def on_sigint(signum, frame) -> None:
        # torch.multiprocessing asks for SIGINT when the parent dies (it may come more than once, and after
        # the failed collective): it interrupts the work, never the exit below.
        if running[0]:
            running[0] = False
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    try:
        follow(setup, rank)
    except BaseException as e:  # one line, not a traceback: rank 0 reports the failure to the user
        running[0] = False
        # A collective with a dead rank 0 fails: say that rank 0 is gone rather than what the socket saw.
        deadline = time.monotonic() + 1.0
        while os.getppid() == setup.parent_pid and time.monotonic() < deadline:
            time.sleep(0.05)
        if os.getppid() != setup.parent_pid:
            print(f"engine: rank {rank}: rank 0 (pid {setup.parent_pid}) is gone; exiting", file=sys.stderr,
                  flush=True)
        elif not isinstance(e, KeyboardInterrupt):
            print(f"engine: rank {rank}: {_first_line(e)}; exiting", file=sys.stderr, flush=True)
        os._exit(130 if isinstance(e, KeyboardInterrupt) else 1)
    os._exit(0)  # skip interpreter teardown (its threads and the process group are gone already)


def follow(setup: RankSetup, rank: int) -> None:
    """Rank ``rank``'s life: join the group, build its part of the model, run rank 0's commands."""
    from engine import kernels
    from engine.config import EngineConfig
    from engine.model.checkpoint import Checkpoint
    from engine.model.decoder import KVCache, MoEDecoder, Segment, StepBatch
    from engine.parallel.ep import EPExperts
    from engine.precision import torch_dtype

    torch.set_num_threads(setup.threads)
    timeout = datetime.timedelta(seconds=float(setup.config["parallel"]["ep_timeout_s"]))
    store = dist.TCPStore("127.0.0.1", setup.port, setup.n_ranks, False, timeout=timeout)
    store.add(JOINED_KEY, 1)
    dist.init_process_group(backend_for(setup.device_type), store=store, rank=rank, world_size=setup.n_ranks,
                            timeout=timeout, pg_options=group_options(setup, rank))
    commands = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
    device = setup.device(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    config = EngineConfig.from_dict(setup.config, source="rank setup")
    kernels.set_int8_activations(config.experts.int8_activations)  # as rank 0's engine (Engine._setup_experts)
    ckpt = Checkpoint(setup.model)
    dtype, weight_dtype = torch_dtype(setup.dtype), torch_dtype(setup.weight_dtype)
    model = MoEDecoder(ckpt, dtype, device, weight_dtype=weight_dtype, load_experts=False)
    model.ep = EPExperts(ckpt, config, rank, setup.n_ranks, dtype, weight_dtype, device)
    model.top_k_override, model.min_gate_weight = config.routing.top_k_override, config.routing.min_gate_weight
    caches: dict[int, KVCache] = {}
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    while True:
        dist.broadcast(header, 0, group=commands)
        cmd, fields = int(header[0]), header[1:].tolist()
        if cmd == CMD_STOP:
            break
        if cmd == CMD_STEP:
            n_tok, n_seg, serial, n_slots, max_len, dtype_code = fields[:6]
            payload = torch.empty(2 * n_tok + 4 * n_seg, dtype=torch.int64)
            dist.broadcast(payload, 0, group=commands)
            ids, pos = payload[:n_tok], payload[n_tok: 2 * n_tok]
            segs = [Segment(*row, wants_logits=False) for row in payload[2 * n_tok:].view(n_seg, 4).tolist()]
            if serial not in caches:
                while len(caches) >= 4:  # rank 0 keeps few caches at once (the engine's, an evaluation's)
                    caches.pop(next(iter(caches)))
                caches[serial] = KVCache(ckpt.spec, n_slots, max_len, torch_dtype(_KV_DTYPES[dtype_code]), device,
                                         initial_len=64)
            model.forward(StepBatch(ids.to(device), pos.to(device), segs), caches[serial])
        elif cmd == CMD_CONFIG:
            blob = torch.empty(fields[0], dtype=torch.uint8)
            dist.broadcast(blob, 0, group=commands)
            config = EngineConfig.from_dict(json.loads(bytes(blob.numpy()).decode()), source="rank 0")
            kernels.set_int8_activations(config.experts.int8_activations)
            model.top_k_override = config.routing.top_k_override
            model.min_gate_weight = config.routing.min_gate_weight
        elif cmd == CMD_PLACE:
            layers, experts = fields[:2]
            hotness = None
            if layers:
                flat = torch.empty(layers * experts, dtype=torch.float64)
                dist.broadcast(flat, 0, group=commands)
                hotness = flat.view(layers, experts).numpy()
            model.ep.place(hotness)
        else:
            raise EPError(f"unknown command {cmd} from rank 0")
    dist.destroy_process_group()
