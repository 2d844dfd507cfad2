"""Requests, workloads and the one on-disk workload format (documented in ``workloads/FORMAT.md``).

A workload on disk is a directory::

    W/workload.json        format name and version, name, metadata, request count
    W/requests.jsonl       one request per line (request_id, arrival_s, prompt_len, max_new_tokens, ...)
    W/router.safetensors   optional router trace (see ``workloads.router``)

A bare ``.jsonl`` file of requests is accepted as the minimal format. ``builtin:<name>`` names a
workload shipped in ``workloads/builtin/``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

import numpy as np

from workloads.errors import WorkloadError, json_lines, workload_error

if TYPE_CHECKING:
    from workloads.router import RouterTrace

log = logging.getLogger(__name__)

FORMAT_NAME = "moetune-workload"
FORMAT_VERSION = 1
WORKLOAD_FILE = "workload.json"
REQUESTS_FILE = "requests.jsonl"
ROUTER_FILE = "router.safetensors"
BUILTIN_PREFIX = "builtin:"
BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"
BLOCK_TOKENS = 512
"""Tokens per prefix block named by a ``hash_ids`` entry (Mooncake's block size)."""

REQUEST_FIELDS = ("request_id", "arrival_s", "prompt_len", "max_new_tokens", "prompt_ids", "hash_ids", "tag")


class _FieldError(WorkloadError):
    """A request field failed validation; the loader adds the file and line to it."""

    def __init__(self, request_id: object, field: str, problem: str) -> None:
        super().__init__(f"request {request_id!r}: field {field!r}: {problem}", field=field)
        self.problem = problem


def n_blocks(prompt_len: int) -> int:
    """Number of ``BLOCK_TOKENS`` blocks (the last may be partial) that cover ``prompt_len`` tokens."""
    return -(-prompt_len // BLOCK_TOKENS)


def _stable_u64(text: str) -> int:
    """A process-independent 64-bit hash (Python's ``hash`` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


@dataclass(frozen=True)
class Request:
    """One request of a workload.

    ``prompt_ids`` holds real token ids when known; otherwise only ``prompt_len`` is known and
    :meth:`prompt_token_ids` synthesises ids. ``hash_ids`` (Mooncake) name the prompt's
    ``BLOCK_TOKENS``-token blocks: requests that share a prefix of hash ids share those prompt tokens.
    """

    request_id: str
    arrival_s: float
    """Seconds from the start of the workload."""
    prompt_len: int
    max_new_tokens: int
    prompt_ids: tuple[int, ...] | None = None
    hash_ids: tuple[int, ...] | None = None
    tag: str | None = None

    def __post_init__(self) -> None:
        rid = self.request_id
        if not isinstance(rid, str) or not rid:
            raise _FieldError(rid, "request_id", "must be a non-empty string")
        if not _is_number(self.arrival_s):
            raise _FieldError(rid, "arrival_s", f"{self.arrival_s!r} is not a number")
        arrival_s = float(self.arrival_s)
        if not math.isfinite(arrival_s) or arrival_s < 0:
            raise _FieldError(rid, "arrival_s", f"{self.arrival_s!r} is not a finite number >= 0")
        object.__setattr__(self, "arrival_s", arrival_s)
        for name in ("prompt_len", "max_new_tokens"):
            value = getattr(self, name)
            if not _is_int(value):
                raise _FieldError(rid, name, f"{value!r} is not an integer")
            if value < 1:
                raise _FieldError(rid, name, f"{value} is less than 1")
            object.__setattr__(self, name, int(value))
        for name in ("prompt_ids", "hash_ids"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
                raise _FieldError(rid, name, "must be a list of integers")
            if not all(_is_int(v) for v in value):
                raise _FieldError(rid, name, "must be a list of integers")
            value = tuple(int(v) for v in value)
            if name == "prompt_ids" and value and min(value) < 0:
                raise _FieldError(rid, name, f"token id {min(value)} is negative")
            object.__setattr__(self, name, value)
        if self.prompt_ids is not None and len(self.prompt_ids) != self.prompt_len:
            raise _FieldError(rid, "prompt_ids",
                              f"has {len(self.prompt_ids)} ids but prompt_len is {self.prompt_len}")
        if self.hash_ids is not None and len(self.hash_ids) > n_blocks(self.prompt_len):
            raise _FieldError(rid, "hash_ids", f"has {len(self.hash_ids)} blocks but a prompt of "
                              f"{self.prompt_len} tokens has only {n_blocks(self.prompt_len)}")
        if self.tag is not None and not isinstance(self.tag, str):
            raise _FieldError(rid, "tag", f"{self.tag!r} is not a string")

    def prompt_token_ids(self, vocab_size: int, seed: int = 0) -> list[int]:
        """The prompt's token ids: the stored ids, or deterministic synthetic ids in ``[0, vocab_size)``.

        Synthetic ids depend only on ``(seed, request_id)``, except that each block named by a hash
        id depends only on ``(seed, hash id)``, so requests sharing a prefix of hash ids share those
        prompt tokens (and a prefix cache sees the reuse the trace implies).
        """
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if self.prompt_ids is not None:
            largest = max(self.prompt_ids)
            if largest >= vocab_size:
                raise _FieldError(self.request_id, "prompt_ids",
                                  f"token id {largest} is outside the model's vocabulary of {vocab_size}")
            return list(self.prompt_ids)
        if not self.hash_ids:
            rng = np.random.default_rng([seed, 0, _stable_u64(self.request_id)])
            return rng.integers(0, vocab_size, self.prompt_len).tolist()
        ids = np.empty(n_blocks(self.prompt_len) * BLOCK_TOKENS, dtype=np.int64)
        for block in range(n_blocks(self.prompt_len)):
            if block < len(self.hash_ids):
                key = [seed, 1, self.hash_ids[block] % 2**64]
            else:  # a block the trace did not name: private to this request
                key = [seed, 2, _stable_u64(self.request_id), block]
            # Always draw a whole block so a partial last block is a prefix of the full one.
            ids[block * BLOCK_TOKENS:(block + 1) * BLOCK_TOKENS] = np.random.default_rng(key).integers(
                0, vocab_size, BLOCK_TOKENS)
        return ids[:self.prompt_len].tolist()

    def to_json(self) -> dict[str, Any]:
        """The request as one ``requests.jsonl`` object (optional fields only when set)."""
        out: dict[str, Any] = {"request_id": self.request_id, "arrival_s": self.arrival_s,
                               "prompt_len": self.prompt_len, "max_new_tokens": self.max_new_tokens}
        if self.prompt_ids is not None:
            out["prompt_ids"] = list(self.prompt_ids)
        if self.hash_ids is not None:
            out["hash_ids"] = list(self.hash_ids)
        if self.tag is not None:
            out["tag"] = self.tag
        return out


class Workload:
    """Requests sorted by arrival, metadata about where they came from, and an optional router trace."""

    def __init__(self, name: str, requests: Iterable[Request], metadata: Mapping[str, Any] | None = None,
                 router_trace: RouterTrace | None = None) -> None:
        self.name = name
        # sorted() is stable: requests arriving together keep their given order.
        self.requests: tuple[Request, ...] = tuple(sorted(requests, key=lambda r: r.arrival_s))
        self.metadata: dict[str, Any] = dict(metadata or {})
        self._by_id: dict[str, Request] = {}
        for request in self.requests:
            if request.request_id in self._by_id:
                raise WorkloadError(f"workload {name!r}: field 'request_id': {request.request_id!r} "
                                    "appears more than once", field="request_id")
            self._by_id[request.request_id] = request
        self.router_trace = None
        if router_trace is not None:
            unknown = [rid for rid in router_trace.request_ids if rid not in self._by_id]
            if unknown:
                raise WorkloadError(f"workload {name!r}: router trace field 'request_ids': "
                                    f"{len(unknown)} ids are not requests of the workload "
                                    f"(first {unknown[0]!r})", field="request_ids")
            in_arrival_order = [r.request_id for r in self.requests if r.request_id in router_trace]
            self.router_trace = router_trace.subset(in_arrival_order)

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)

    def __repr__(self) -> str:
        trace = ", router trace" if self.router_trace is not None else ""
        return f"Workload({self.name!r}, {len(self)} requests over {self.duration_s:.1f} s{trace})"

    def request(self, request_id: str) -> Request:
        """The request with this id (``KeyError`` if none)."""
        return self._by_id[request_id]

    @property
    def n_requests(self) -> int:
        return len(self.requests)

    @property
    def arrivals_s(self) -> np.ndarray:
        """Arrival times in seconds, ascending."""
        return np.array([r.arrival_s for r in self.requests], dtype=np.float64)

    @property
    def prompt_lens(self) -> np.ndarray:
        return np.array([r.prompt_len for r in self.requests], dtype=np.int64)

    @property
    def output_lens(self) -> np.ndarray:
        """``max_new_tokens`` of each request."""
        return np.array([r.max_new_tokens for r in self.requests], dtype=np.int64)

    @property
    def duration_s(self) -> float:
        """Seconds from the first arrival to the last (0 for fewer than two requests)."""
        if len(self.requests) < 2:
            return 0.0
        return self.requests[-1].arrival_s - self.requests[0].arrival_s

    @property
    def rate_per_s(self) -> float | None:
        """Mean arrival rate, 1 / mean inter-arrival gap; None when every request arrives at once."""
        if self.duration_s <= 0:
            return None
        return (len(self.requests) - 1) / self.duration_s

    @property
    def burstiness_cv(self) -> float | None:
        """Coefficient of variation of inter-arrival gaps (1 for Poisson, 0 for constant, >1 bursty)."""
        gaps = np.diff(self.arrivals_s)
        if gaps.size < 2 or gaps.mean() <= 0:
            return None
        return float(gaps.std() / gaps.mean())

    @property
    def total_prompt_tokens(self) -> int:
        return int(self.prompt_lens.sum())

    @property
    def total_output_tokens(self) -> int:
        return int(self.output_lens.sum())

    def with_requests(self, requests: Iterable[Request], *, name: str | None = None,
                      metadata: Mapping[str, Any] | None = None) -> Workload:
        """A copy with other requests; the router trace keeps the requests (by id) that remain.

        The caller must only keep a trace entry whose request still matches it (see ``transform``).
        """
        requests = list(requests)
        trace = self.router_trace
        if trace is not None:
            keep = {r.request_id for r in requests}
            trace = trace.subset([rid for rid in trace.request_ids if rid in keep])
        return Workload(name or self.name, requests, self.metadata if metadata is None else metadata, trace)

    def with_router_trace(self, router_trace: RouterTrace | None, *,
                          metadata: Mapping[str, Any] | None = None) -> Workload:
        """A copy with this router trace attached (or none)."""
        return Workload(self.name, self.requests, self.metadata if metadata is None else metadata,
                        router_trace)


# ---------------------------------------------------------------------------------------- loading


def builtin_names() -> list[str]:
    """Names of the built-in workloads, addressable as ``builtin:<name>``."""
    if not BUILTIN_DIR.is_dir():
        return []
    return sorted(p.name for p in BUILTIN_DIR.iterdir() if (p / WORKLOAD_FILE).is_file())


def resolve_spec(spec: str | os.PathLike[str]) -> Path:
    """The path a workload spec names (``builtin:<name>`` or a path), checked to exist."""
    text = os.fspath(spec)
    if text.startswith(BUILTIN_PREFIX):
        name = text[len(BUILTIN_PREFIX):]
        if name not in builtin_names():
            raise WorkloadError(f"{text}: no such built-in workload (built-ins: {', '.join(builtin_names())})")
        return BUILTIN_DIR / name
    path = Path(text)
    if path.is_file() and path.name == WORKLOAD_FILE:
        return path.parent
    if path.is_dir() or (path.is_file() and path.suffix == ".jsonl"):
        return path
    raise WorkloadError(f"{text}: no such workload (expected a directory with {WORKLOAD_FILE}, "
                        f"a .jsonl file of requests, or builtin:NAME)")


def load_workload(spec: str | os.PathLike[str]) -> Workload:
    """Load a workload from a directory, a bare ``.jsonl`` file of requests, or ``builtin:<name>``.

    Everything is validated; a malformed file raises :class:`WorkloadError` naming the file, the
    line and the field.
    """
    path = resolve_spec(spec)
    if path.is_file():
        requests = _read_requests(path, require_id=False)
        return Workload(path.stem, requests,
                        {"source": str(path), "origin": "bare requests file (minimal format)"})
    return _load_dir(path)


def _line_of(text: str, key: str) -> int | None:
    """The first line of a JSON document that mentions ``"key"`` (for error messages)."""
    needle = json.dumps(key)
    for number, line in enumerate(text.splitlines(), start=1):
        if needle in line:
            return number
    return None


def _load_dir(path: Path) -> Workload:
    header_path = path / WORKLOAD_FILE
    if not header_path.is_file():
        raise workload_error(header_path, "missing: a workload directory needs workload.json")
    text = header_path.read_text(encoding="utf-8")
    try:
        header = json.loads(text)
    except json.JSONDecodeError as e:
        raise workload_error(header_path, f"not valid JSON ({e.msg}, column {e.colno})", line=e.lineno) from e
    if not isinstance(header, dict):
        raise workload_error(header_path, "must be a JSON object", line=1)

    def bad(key: str, problem: str) -> WorkloadError:
        return workload_error(header_path, problem, line=_line_of(text, key), field=key)

    if header.get("format") != FORMAT_NAME:
        raise bad("format", f"{header.get('format')!r} is not {FORMAT_NAME!r}")
    version = header.get("format_version")
    if not _is_int(version):
        raise bad("format_version", f"{version!r} is not an integer")
    if version < 1 or version > FORMAT_VERSION:
        raise bad("format_version", f"version {version} is not supported (this moetune reads "
                  f"{FORMAT_NAME} version {FORMAT_VERSION})")
    name = header.get("name", path.name)
    if not isinstance(name, str) or not name:
        raise bad("name", f"{name!r} is not a non-empty string")
    metadata = header.get("metadata", {})
    if not isinstance(metadata, dict):
        raise bad("metadata", "must be a JSON object")
    n_requests = header.get("n_requests")
    if not _is_int(n_requests) or n_requests < 0:
        raise bad("n_requests", f"{n_requests!r} is not an integer >= 0")
    router_file = header.get("router_trace")
    if router_file is not None and (not isinstance(router_file, str) or router_file != ROUTER_FILE):
        raise bad("router_trace", f"{router_file!r} must be null or {ROUTER_FILE!r}")
    unknown = sorted(set(header) - {"format", "format_version", "name", "metadata", "n_requests", "router_trace"})
    if unknown:
        raise bad(unknown[0], "unknown field")

    requests_path = path / REQUESTS_FILE
    if not requests_path.is_file():
        raise workload_error(requests_path, "missing")
    requests = _read_requests(requests_path, require_id=True)
    if len(requests) != n_requests:
        raise bad("n_requests", f"says {n_requests} but {REQUESTS_FILE} has {len(requests)} requests")
    trace = None
    if router_file is not None:
        from workloads.router import RouterTrace

        trace = RouterTrace.load(path / router_file)
    try:
        return Workload(name, requests, metadata, trace)
    except WorkloadError as e:
        raise WorkloadError(f"{path}: {e}", file=str(path), field=e.field) from None


def _read_requests(path: Path, *, require_id: bool) -> list[Request]:
    requests: list[Request] = []
    seen: dict[str, int] = {}
    for line_no, obj in json_lines(path):
        request = _request_from_json(obj, path, line_no, require_id=require_id, default_id=str(len(requests)))
        if request.request_id in seen:
            raise workload_error(path, f"{request.request_id!r} repeats the id on line "
                                 f"{seen[request.request_id]}", line=line_no, field="request_id")
        seen[request.request_id] = line_no
        requests.append(request)
    return requests


def _request_from_json(obj: object, path: Path, line_no: int, *, require_id: bool, default_id: str) -> Request:
    """Validate one JSON request object; errors name the file, line and field."""
    if not isinstance(obj, dict):
        raise workload_error(path, "must be a JSON object", line=line_no)
    unknown = sorted(set(obj) - set(REQUEST_FIELDS))
    if unknown:
        raise workload_error(path, f"unknown field (known: {', '.join(REQUEST_FIELDS)})", line=line_no,
                             field=unknown[0])
    required = ["arrival_s", "max_new_tokens"] + (["request_id"] if require_id else [])
    if "prompt_ids" not in obj:
        required.append("prompt_len")
    for key in required:
        if key not in obj:
            raise workload_error(path, "missing", line=line_no, field=key)
    kwargs = dict(obj)
    kwargs.setdefault("request_id", default_id)
    if "prompt_len" not in kwargs and isinstance(kwargs["prompt_ids"], list):
        kwargs["prompt_len"] = len(kwargs["prompt_ids"])
    for key in ("prompt_ids", "hash_ids"):
        if kwargs.get(key) is not None and not isinstance(kwargs[key], list):
            raise workload_error(path, "must be a list of integers", line=line_no, field=key)
    try:
        return Request(**kwargs)
    except _FieldError as e:
        raise workload_error(path, e.problem, line=line_no, field=e.field) from None


# ----------------------------------------------------------------------------------------- saving


def save_workload(workload: Workload, path: str | os.PathLike[str]) -> Path:
    """Write ``workload`` to ``path``: a workload directory, or a bare ``.jsonl`` when the path ends so.

    A bare file keeps only the requests (no metadata, no router trace). An existing directory is
    overwritten only when it already holds a workload.
    """
    path = Path(path)
    if path.suffix == ".jsonl":
        if workload.router_trace is not None:
            raise WorkloadError(f"{path}: a bare .jsonl file cannot hold a router trace; write a directory")
        log.info("writing %s without metadata (bare requests file)", path)
        _write_atomic(path, _requests_text(workload))
        return path
    if path.exists() and not path.is_dir():
        raise WorkloadError(f"{path}: exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not (path / WORKLOAD_FILE).is_file():
        raise WorkloadError(f"{path}: refusing to write into a non-empty directory that is not a workload")
    path.mkdir(parents=True, exist_ok=True)
    _write_atomic(path / REQUESTS_FILE, _requests_text(workload))
    router_path = path / ROUTER_FILE
    if workload.router_trace is not None:
        workload.router_trace.save(router_path)
    elif router_path.exists():
        router_path.unlink()
    header = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "name": workload.name,
        "n_requests": len(workload),
        "router_trace": ROUTER_FILE if workload.router_trace is not None else None,
        "metadata": workload.metadata,
    }
    _write_atomic(path / WORKLOAD_FILE, json.dumps(header, indent=2, sort_keys=False) + "\n")
    return path


def _requests_text(workload: Workload) -> str:
    return "".join(json.dumps(r.to_json(), separators=(",", ":")) + "\n" for r in workload.requests)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
