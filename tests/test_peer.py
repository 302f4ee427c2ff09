"""Which exchange sums the back projection over the GPUs, and each GPU's slice of it (host only; the exchange
itself is tested on GPUs in test_peer_gpu.py)."""

from __future__ import annotations

import itertools

import pytest

from mlemlib.backends._peer import choose_exchange, slices
from mlemlib.errors import ConfigError


def _never() -> bool:
    raise AssertionError("peer access asked where the answer cannot matter")


@pytest.mark.parametrize("requested", ["auto", "nccl", "peer"])
def test_one_gpu_in_all_exchanges_nothing(requested):
    assert choose_exchange(requested, world=1, local=1, fixed_point=True, peer_access=_never) == "none"


def test_auto_takes_peer_access_for_the_fixed_point_of_one_process():
    assert choose_exchange("auto", world=2, local=2, fixed_point=True, peer_access=lambda: True) == "peer"
    assert choose_exchange("peer", world=4, local=4, fixed_point=True, peer_access=lambda: True) == "peer"


@pytest.mark.parametrize("world,local,fixed,access,why", [
    (2, 1, True, _never, "drives 1 of the run's 2 GPUs"),    # one process per GPU (mpi)
    (2, 2, False, _never, "summed in float"),                # float sums: NCCL's
    (2, 2, True, lambda: False, "peer access"),              # no peer access between a pair
])
def test_where_peer_does_not_apply_auto_takes_nccl_and_peer_is_refused(world, local, fixed, access, why):
    assert choose_exchange("auto", world=world, local=local, fixed_point=fixed, peer_access=access) == "nccl"
    with pytest.raises(ConfigError, match=f"exchange.*peer: .*{why}"):
        choose_exchange("peer", world=world, local=local, fixed_point=fixed, peer_access=access)


def test_nccl_is_never_asked_about_peer_access_and_unknown_names_are_refused():
    assert choose_exchange("nccl", world=2, local=2, fixed_point=True, peer_access=_never) == "nccl"
    with pytest.raises(ConfigError, match="unknown exchange 'nvlink'"):
        choose_exchange("nvlink", world=2, local=2, fixed_point=True, peer_access=_never)


@pytest.mark.parametrize("n,parts", [(784000, 2), (784000, 3), (10, 4), (3, 4), (0, 2), (2**33 + 5, 8)])
def test_slices_cover_the_voxels_once_in_gpu_order(n, parts):
    s = slices(n, parts)
    assert len(s) == parts and s[0][0] == 0 and s[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(s))
    sizes = [v1 - v0 for v0, v1 in s]
    assert min(sizes) >= 0 and max(sizes) - min(sizes) <= 1
