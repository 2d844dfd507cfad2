"""Importers for public LLM serving traces: Azure, BurstGPT, Mooncake, Vidur and ShareGPT.

Each reads one file, validates every row it uses (a malformed row raises :class:`WorkloadError`
naming the file, the row and line, and the field), rebases arrivals so the first is at 0, and
records in the metadata where the data came from and what was dropped or clipped.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import math
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from workloads.errors import WorkloadError, json_lines, workload_error
from workloads.schema import Request, Workload, n_blocks

log = logging.getLogger(__name__)

FORMATS = ("azure", "burstgpt", "mooncake", "vidur", "sharegpt")
CHARS_PER_TOKEN = 4
"""ShareGPT length estimate without a tokenizer (a common rule of thumb for English text)."""
LICENSE_NOTE = "as published by the source; check its terms before redistributing"

ORIGINS = {
    "azure": "Azure LLM inference trace 2023/2024 (https://github.com/Azure/AzurePublicDataset)",
    "burstgpt": "BurstGPT trace (https://github.com/HPMLL/BurstGPT)",
    "mooncake": "Mooncake trace (https://github.com/kvcache-ai/Mooncake, FAST'25 traces)",
    "vidur": "Vidur processed trace (https://github.com/microsoft/vidur, data/processed_traces)",
    "sharegpt": "ShareGPT conversations (e.g. https://huggingface.co/datasets/anon8231489123/ShareGPT_Vicuna_unfiltered)",
}


@dataclass(frozen=True)
class ImportOptions:
    """Options shared by the importers."""

    limit: int | None = None
    """Keep the first N usable requests of the file (in file order)."""
    max_prompt_len: int | None = None
    """Clip longer prompts to this many tokens (keeping the head, so shared prefixes stay shared)."""
    max_output_len: int | None = None
    """Clip larger output lengths to this many tokens."""
    keep_failed: bool = False
    """BurstGPT: keep failed requests (zero response tokens) as one-token requests tagged ``failed``."""
    tokenizer_dir: str | None = None
    """ShareGPT: a directory with a ``tokenizer.json`` to count tokens exactly."""
    rate_per_s: float = 1.0
    """ShareGPT: Poisson arrival rate (the data has no timestamps)."""
    seed: int = 0
    """ShareGPT: seed of the Poisson arrivals."""


@dataclass
class _Row:
    arrival_s: float
    prompt_len: int
    output_len: int
    request_id: str
    prompt_ids: list[int] | None = None
    hash_ids: list[int] | None = None
    tag: str | None = None


def import_trace(fmt: str, src: str | Path, options: ImportOptions | None = None, *,
                 name: str | None = None) -> Workload:
    """Read a trace file of format ``fmt`` (one of ``FORMATS``) into a :class:`Workload`."""
    options = options or ImportOptions()
    if fmt not in FORMATS:
        raise WorkloadError(f"format: {fmt!r} is not one of {', '.join(FORMATS)}")
    path = Path(src)
    if not path.is_file():
        raise WorkloadError(f"{path}: no such file")
    if not options.rate_per_s > 0:
        raise WorkloadError(f"rate: {options.rate_per_s} is not > 0")
    if options.limit is not None and options.limit < 1:
        raise WorkloadError(f"limit: {options.limit} is less than 1")
    for key in ("max_prompt_len", "max_output_len"):
        value = getattr(options, key)
        if value is not None and value < 1:
            raise WorkloadError(f"{key}: {value} is less than 1")
    dropped: Counter[str] = Counter()
    notes: dict[str, Any] = {}
    reader: Callable[..., Iterator[_Row]] = _READERS[fmt]
    rows: list[_Row] = []
    for row in reader(path, options, dropped, notes):
        if row.prompt_len < 1:
            dropped["empty_prompt"] += 1
            continue
        if row.output_len < 1:
            dropped["zero_output"] += 1
            continue
        rows.append(row)
        if options.limit is not None and len(rows) >= options.limit:
            break
    if fmt == "sharegpt":
        rng = np.random.default_rng(options.seed)
        gaps = rng.exponential(1.0 / options.rate_per_s, max(len(rows) - 1, 0))
        for row, arrival_s in zip(rows, np.concatenate([[0.0], np.cumsum(gaps)]), strict=True):
            row.arrival_s = float(arrival_s)
    start_s = min((r.arrival_s for r in rows), default=0.0)
    clipped: Counter[str] = Counter()
    requests = []
    for row in rows:
        if options.max_prompt_len is not None and row.prompt_len > options.max_prompt_len:
            clipped["prompt"] += 1
            row.prompt_len = options.max_prompt_len
            if row.prompt_ids is not None:
                row.prompt_ids = row.prompt_ids[:row.prompt_len]
        if row.hash_ids is not None and len(row.hash_ids) > n_blocks(row.prompt_len):
            row.hash_ids = row.hash_ids[:n_blocks(row.prompt_len)]
        if options.max_output_len is not None and row.output_len > options.max_output_len:
            clipped["output"] += 1
            row.output_len = options.max_output_len
        requests.append(Request(row.request_id, round(row.arrival_s - start_s, 6), row.prompt_len, row.output_len,
                                prompt_ids=None if row.prompt_ids is None else tuple(row.prompt_ids),
                                hash_ids=None if row.hash_ids is None else tuple(row.hash_ids), tag=row.tag))
    for reason, count in sorted(dropped.items()):
        log.warning("%s: dropped %d rows (%s)", path, count, reason.replace("_", " "))
    metadata = {
        "source": str(path),
        "source_sha256": _sha256(path),
        "format": fmt,
        "origin": ORIGINS[fmt],
        "license": LICENSE_NOTE,
        "dropped": dict(sorted(dropped.items())),
        "clipped": dict(sorted(clipped.items())),
        "options": {k: v for k, v in vars(options).items() if v is not None},
        **notes,
    }
    if fmt == "sharegpt":
        metadata["seed"] = options.seed
    return Workload(name or path.stem, requests, metadata)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------- CSV parsing


class _CsvRows:
    """Rows of a CSV file as dicts of the named columns, with row/line numbers for errors."""

    def __init__(self, path: Path, columns: tuple[str, ...]) -> None:
        self.path = path
        self.columns = columns

    def __iter__(self) -> Iterator[tuple[int, int, dict[str, str]]]:
        with self.path.open(newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if header is None:
                raise workload_error(self.path, "empty file: expected a header row", line=1)
            names = [h.strip() for h in header]
            index = {}
            for column in self.columns:
                if column not in names:
                    raise workload_error(self.path, f"missing column (header has: {', '.join(names)})",
                                         line=1, field=column)
                index[column] = names.index(column)
            width = max(index.values()) + 1
            for row_no, cells in enumerate(reader, start=1):
                if not cells or all(not c.strip() for c in cells):
                    continue
                if len(cells) < width:
                    missing = next(c for c in self.columns if index[c] >= len(cells))
                    raise workload_error(self.path, f"row has {len(cells)} fields, expected {len(names)}",
                                         row=row_no, line=reader.line_num, field=missing)
                yield row_no, reader.line_num, {c: cells[i].strip() for c, i in index.items()}

    def error(self, row_no: int, line_no: int, field: str, problem: str) -> WorkloadError:
        return workload_error(self.path, problem, row=row_no, line=line_no, field=field)


def _parse_int(text: str) -> int | None:
    """An integer from ``text`` (``"12"`` or an integral ``"12.0"``), None when it is not one."""
    try:
        return int(text)
    except ValueError:
        try:
            value = float(text)
        except ValueError:
            return None
        return int(value) if math.isfinite(value) and value.is_integer() else None


def _count(rows: _CsvRows, row_no: int, line_no: int, cells: dict[str, str], field: str) -> int:
    value = _parse_int(cells[field])
    if value is None:
        raise rows.error(row_no, line_no, field, f"{cells[field]!r} is not an integer")
    if value < 0:
        raise rows.error(row_no, line_no, field, f"{value} is negative")
    return value


def _seconds(rows: _CsvRows, row_no: int, line_no: int, cells: dict[str, str], field: str) -> float:
    try:
        value = float(cells[field])
    except ValueError:
        raise rows.error(row_no, line_no, field, f"{cells[field]!r} is not a number of seconds") from None
    if not math.isfinite(value) or value < 0:
        raise rows.error(row_no, line_no, field, f"{cells[field]!r} is not a finite number >= 0")
    return value


def _datetime_s(rows: _CsvRows, row_no: int, line_no: int, cells: dict[str, str], field: str) -> float:
    """Seconds since the epoch of an ISO-like datetime string; naive times are taken as UTC."""
    text = cells[field]
    try:
        stamp = datetime.fromisoformat(text)
    except ValueError:
        raise rows.error(row_no, line_no, field, f"{text!r} is not a datetime (e.g. 2023-11-16 18:15:46.68)") from None
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=UTC)
    return stamp.timestamp()


# ------------------------------------------------------------------------------------ readers


def read_azure(path: Path, options: ImportOptions, dropped: Counter[str], notes: dict[str, Any]) -> Iterator[_Row]:
    """Azure LLM inference trace CSV (2023 and 2024): ``TIMESTAMP,ContextTokens,GeneratedTokens``."""
    rows = _CsvRows(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens"))
    for row_no, line_no, cells in rows:
        yield _Row(_datetime_s(rows, row_no, line_no, cells, "TIMESTAMP"),
                   _count(rows, row_no, line_no, cells, "ContextTokens"),
                   _count(rows, row_no, line_no, cells, "GeneratedTokens"), f"azure-{row_no}")


def read_burstgpt(path: Path, options: ImportOptions, dropped: Counter[str],
                  notes: dict[str, Any]) -> Iterator[_Row]:
    """BurstGPT CSV: ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type``.

    Rows with zero response tokens are failed requests: dropped (and counted) unless ``keep_failed``,
    which keeps them as one-token requests tagged ``<model>/<log type>/failed``.
    """
    rows = _CsvRows(path, ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type"))
    for row_no, line_no, cells in rows:
        arrival_s = _seconds(rows, row_no, line_no, cells, "Timestamp")
        prompt_len = _count(rows, row_no, line_no, cells, "Request tokens")
        output_len = _count(rows, row_no, line_no, cells, "Response tokens")
        tag = f"{cells['Model']}/{cells['Log Type']}"
        if output_len == 0:
            if not options.keep_failed:
                dropped["failed"] += 1
                continue
            output_len, tag = 1, f"{tag}/failed"
        yield _Row(arrival_s, prompt_len, output_len, f"burstgpt-{row_no}", tag=tag)


def read_vidur(path: Path, options: ImportOptions, dropped: Counter[str], notes: dict[str, Any]) -> Iterator[_Row]:
    """Vidur trace CSV: ``arrived_at,num_prefill_tokens,num_decode_tokens`` (seconds, tokens)."""
    rows = _CsvRows(path, ("arrived_at", "num_prefill_tokens", "num_decode_tokens"))
    for row_no, line_no, cells in rows:
        yield _Row(_seconds(rows, row_no, line_no, cells, "arrived_at"),
                   _count(rows, row_no, line_no, cells, "num_prefill_tokens"),
                   _count(rows, row_no, line_no, cells, "num_decode_tokens"), f"vidur-{row_no}")


def read_mooncake(path: Path, options: ImportOptions, dropped: Counter[str],
                  notes: dict[str, Any]) -> Iterator[_Row]:
    """Mooncake JSONL: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids`` (512-token blocks)."""
    mismatched = 0
    for line_no, obj in json_lines(path):
        if not isinstance(obj, dict):
            raise workload_error(path, "must be a JSON object", line=line_no)
        arrival_ms = _json_number(path, line_no, obj, "timestamp", integer=False)
        prompt_len = int(_json_number(path, line_no, obj, "input_length", integer=True))
        output_len = int(_json_number(path, line_no, obj, "output_length", integer=True))
        hash_ids = obj.get("hash_ids")
        if hash_ids is not None:
            if not isinstance(hash_ids, list) or not all(
                    isinstance(h, int) and not isinstance(h, bool) for h in hash_ids):
                raise workload_error(path, "must be a list of integers", line=line_no, field="hash_ids")
            if len(hash_ids) != n_blocks(prompt_len):
                mismatched += 1
            hash_ids = hash_ids[:n_blocks(prompt_len)]
        yield _Row(arrival_ms / 1000.0, prompt_len, output_len, f"mooncake-{line_no}", hash_ids=hash_ids)
    if mismatched:
        log.warning("%s: %d rows have a hash_ids count that differs from ceil(input_length / 512)",
                    path, mismatched)
        notes["hash_ids_count_mismatch"] = mismatched


def _json_number(path: Path, line_no: int, obj: dict[str, Any], key: str, *, integer: bool) -> float:
    """``obj[key]`` checked to be a finite number >= 0 (an integer when ``integer``)."""
    if key not in obj:
        raise workload_error(path, "missing", line=line_no, field=key)
    value = obj[key]
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if not ok or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        kind = "an integer" if integer else "a number"
        raise workload_error(path, f"{value!r} is not {kind} >= 0", line=line_no, field=key)
    return value


def read_sharegpt(path: Path, options: ImportOptions, dropped: Counter[str],
                  notes: dict[str, Any]) -> Iterator[_Row]:
    """ShareGPT JSON: a list of ``{"id", "conversations": [{"from": "human"|"gpt", "value": text}]}``.

    The prompt is the first human turn, the output length that of the first gpt reply after it.
    Tokens are counted with ``tokenizer_dir``/tokenizer.json when given (the prompt ids are kept),
    else estimated as ``len(text) / CHARS_PER_TOKEN``. Arrivals are assigned later (Poisson).
    """
    encode = _tokenizer(options.tokenizer_dir) if options.tokenizer_dir else None
    notes["lengths"] = (f"tokenized with {options.tokenizer_dir}/tokenizer.json" if encode else
                        f"estimated as characters / {CHARS_PER_TOKEN} (no tokenizer given)")
    notes["arrivals"] = f"Poisson at {options.rate_per_s} req/s, seed {options.seed} (ShareGPT has no timestamps)"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise workload_error(path, f"not valid JSON ({e.msg}, column {e.colno})", line=e.lineno) from None
    if not isinstance(data, list):
        raise workload_error(path, "must be a JSON list of conversations", line=1)
    seen_ids: set[str] = set()
    for entry_no, entry in enumerate(data, start=1):
        if not isinstance(entry, dict):
            raise workload_error(path, "must be a JSON object", entry=entry_no)
        turns = entry.get("conversations")
        if not isinstance(turns, list):
            raise workload_error(path, "missing or not a list", entry=entry_no, field="conversations")
        prompt = reply = None
        for turn_no, turn in enumerate(turns, start=1):
            if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
                raise workload_error(path, f"turn {turn_no} needs a string 'value'", entry=entry_no,
                                     field="conversations")
            speaker = turn.get("from")
            if prompt is None and speaker in ("human", "user"):
                prompt = turn["value"]
            elif prompt is not None and speaker in ("gpt", "assistant", "chatgpt"):
                reply = turn["value"]
                break
        if prompt is None or reply is None:
            dropped["no_reply"] += 1
            continue
        raw_id = entry.get("id")
        request_id = f"sharegpt-{raw_id}" if isinstance(raw_id, (str, int)) and not isinstance(raw_id, bool) \
            else f"sharegpt-{entry_no}"
        if request_id in seen_ids:
            request_id = f"{request_id}-{entry_no}"
        seen_ids.add(request_id)
        if encode is not None:
            prompt_ids = encode(prompt, True)
            yield _Row(0.0, len(prompt_ids), len(encode(reply, False)), request_id, prompt_ids=prompt_ids)
        else:
            yield _Row(0.0, round(len(prompt) / CHARS_PER_TOKEN), round(len(reply) / CHARS_PER_TOKEN), request_id)


def _tokenizer(directory: str) -> Callable[[str, bool], list[int]]:
    """``encode(text, add_special_tokens)`` from ``directory/tokenizer.json`` via the tokenizers package."""
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise WorkloadError(f"{path}: no such file (--tokenizer takes a directory holding tokenizer.json)")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise WorkloadError("--tokenizer needs the 'tokenizers' package, which is not installed") from None
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises a plain Exception for a malformed file
        raise WorkloadError(f"{path}: not a readable tokenizer ({e})") from None

    def encode(text: str, add_special_tokens: bool) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    return encode


_READERS: dict[str, Callable[..., Iterator[_Row]]] = {
    "azure": read_azure, "burstgpt": read_burstgpt, "mooncake": read_mooncake, "vidur": read_vidur,
    "sharegpt": read_sharegpt,
}
