"""Shared test set-up: a private cache for built-in models, and one thread for PyTorch.

One thread keeps timings stable on a shared 2-core machine (an oversubscribed OpenMP pool stalls
small ops by orders of magnitude); no test asserts speed.
"""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _moetune_cache(tmp_path_factory):
    os.environ.setdefault("MOETUNE_CACHE", str(tmp_path_factory.mktemp("moetune-cache")))
    torch.set_num_threads(1)
    yield
