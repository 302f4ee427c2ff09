"""Shared pytest set-up: the ``gpu`` marker skips without a CUDA GPU."""

from __future__ import annotations

import pytest

from mlemlib.backends import cuda_available


def pytest_collection_modifyitems(config, items):
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (CuPy with a device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng():
    """A fresh, seeded random generator per test."""
    import numpy as np

    return np.random.default_rng(20261122)
