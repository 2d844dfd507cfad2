"""Shared test set-up: a private cache for built-in models, one thread for PyTorch, and the rule for
components the machine may lack.

One thread keeps timings stable on a shared 2-core machine (an oversubscribed OpenMP pool stalls
small ops by orders of magnitude); no test asserts speed.

No hidden skip: a test that needs a system component (a C++ compiler, PostgreSQL, Chromium) skips
only where the machine lacks it entirely, says what to install, and fails instead under
``MOETUNE_TEST_STRICT=1``, which ``.ci/run`` sets because CI installs all of them. A component that is
present but broken is a failure everywhere. Python packages of the ``test`` extra are imported
plainly: the README's install brings them, so their absence is an error, not a skip. Only CUDA-only
tests skip on a machine without an NVIDIA GPU.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from db.testing import PostgresUnavailable, start_postgres

STRICT = os.environ.get("MOETUNE_TEST_STRICT") == "1"


def require(component: str, present: bool, install: str, why: str = "") -> None:
    """Skip (or, under ``MOETUNE_TEST_STRICT=1``, fail) the calling test when ``component`` is absent."""
    if present:
        return
    message = f"{component} is not on this machine{' (' + why + ')' if why else ''}; install it: {install}"
    if STRICT:
        pytest.fail(f"{message} [MOETUNE_TEST_STRICT=1: CI installs it, so its absence is a failure]",
                    pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def require_component():
    """:func:`require` as a fixture, for test modules (conftest modules cannot be imported by name)."""
    return require


@pytest.fixture(scope="session", autouse=True)
def _moetune_cache(tmp_path_factory):
    os.environ.setdefault("MOETUNE_CACHE", str(tmp_path_factory.mktemp("moetune-cache")))
    torch.set_num_threads(1)
    yield


@pytest.fixture(scope="session")
def pg_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The superuser URL of one private PostgreSQL server for the whole test session; each test creates
    its own database. Without PostgreSQL's binaries the tests that need it follow :func:`require`; with
    them, a server that does not start is an error."""
    try:
        url, stop = start_postgres(tmp_path_factory.mktemp("pg"))
    except PostgresUnavailable as e:
        require("PostgreSQL", False, "apt-get install postgresql", str(e))
    try:
        yield url
    finally:
        stop()
