"""Shared test set-up: a private cache for built-in models, and one thread for PyTorch.

One thread keeps timings stable on a shared 2-core machine (an oversubscribed OpenMP pool stalls
small ops by orders of magnitude); no test asserts speed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from db.testing import PostgresUnavailable, start_postgres


@pytest.fixture(scope="session", autouse=True)
def _moetune_cache(tmp_path_factory):
    os.environ.setdefault("MOETUNE_CACHE", str(tmp_path_factory.mktemp("moetune-cache")))
    torch.set_num_threads(1)
    yield


@pytest.fixture(scope="session")
def pg_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The superuser URL of one private PostgreSQL server for the whole test session (skips the
    tests that need it where no PostgreSQL binaries exist); each test creates its own database."""
    try:
        url, stop = start_postgres(tmp_path_factory.mktemp("pg"))
    except PostgresUnavailable as e:
        pytest.skip(str(e))
    try:
        yield url
    finally:
        stop()
