"""The one error type of the workloads package, with a helper that builds its one-line message."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class WorkloadError(ValueError):
    """A workload, trace file or request is malformed or unusable.

    The message is one line naming the file, the line or row (where there is one) and the field,
    e.g. ``trace.csv: row 7 (line 8): field 'ContextTokens': 'abc' is not an integer``.
    """

    def __init__(self, message: str, *, file: str | None = None, line: int | None = None,
                 field: str | None = None) -> None:
        super().__init__(message)
        self.file = file
        self.line = line
        self.field = field


def workload_error(file: str | Path | None, problem: str, *, line: int | None = None,
                   row: int | None = None, entry: int | None = None,
                   field: str | None = None) -> WorkloadError:
    """Build a :class:`WorkloadError` whose message reads ``FILE: row R (line L): field 'F': PROBLEM``.

    ``row`` counts data rows of a CSV from 1 (the header is not a row); ``line`` is the physical
    line in the file, from 1; ``entry`` counts the items of a JSON list from 1.
    """
    parts = []
    if file is not None:
        parts.append(str(file))
    if row is not None:
        parts.append(f"row {row}" + (f" (line {line})" if line is not None else ""))
    elif line is not None:
        parts.append(f"line {line}")
    if entry is not None:
        parts.append(f"entry {entry}")
    if field is not None:
        parts.append(f"field {field!r}")
    parts.append(" ".join(problem.split()))  # keep the message on one line
    return WorkloadError(": ".join(parts), file=None if file is None else str(file), line=line,
                         field=field)


def json_lines(path: Path) -> Iterator[tuple[int, Any]]:
    """``(line number, parsed value)`` for each non-blank line of a JSON-lines file; bad JSON is a
    one-line :class:`WorkloadError` naming the file and the line."""
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as e:
                raise workload_error(path, f"not valid JSON ({e.msg}, column {e.colno})", line=line_no) from None
