"""The peer exchange of one process's GPUs (mlemlib.backends._peer; needs two CUDA GPUs with peer access).

The yardstick is the sum in NumPy (uint64, modulo 2^64 as the GPUs add) and NCCL's exchange: OSEM and MLEM with
the deterministic kernels give the same bits with either, and the bits of one GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_osem import S
from test_osem_gpu import _gpus, _image, grouped  # noqa: F401 - the fixture

from mlemlib.backends import make_backend
from mlemlib.errors import ConfigError

pytestmark = pytest.mark.gpu


needs_two = pytest.mark.skipif(_gpus() < 2, reason="needs two GPUs")


def _vectors(n, seed):
    """Per GPU a uint64 vector whose sums wrap around 2^64 in places."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 2**64, size=n, dtype=np.uint64, endpoint=False) for _ in range(2)]


@needs_two
@pytest.mark.parametrize("n", [1, 3, 784_001])
def test_allreduce_sums_in_place_on_every_gpu_eagerly_and_replayed(n):
    import cupy as cp

    from mlemlib.backends._peer import PeerExchange

    ex = PeerExchange([0, 1])
    streams, bufs = [], []
    for d in (0, 1):
        with cp.cuda.Device(d):
            streams.append(cp.cuda.Stream(non_blocking=True))
            bufs.append(cp.zeros(n, dtype=cp.uint64))
    for round_, graph in enumerate((False, True, True)):
        host = _vectors(n, round_)
        want = host[0] + host[1]  # modulo 2^64
        for d in (0, 1):
            with cp.cuda.Device(d):
                bufs[d].set(host[d], stream=streams[d])
                streams[d].synchronize()
        if graph:
            if round_ == 1:
                graphs = []
                for d in (0, 1):
                    with cp.cuda.Device(d):
                        streams[d].begin_capture()
                ex.allreduce(bufs, streams)
                for d in (0, 1):
                    with cp.cuda.Device(d):
                        graphs.append(streams[d].end_capture())
            for d in (0, 1):
                with cp.cuda.Device(d):
                    graphs[d].launch(streams[d])
        else:
            ex.allreduce(bufs, streams)
        for d in (0, 1):
            with cp.cuda.Device(d):
                streams[d].synchronize()
                assert np.array_equal(bufs[d].get(), want), (n, graph, d)
        ex.check()


@needs_two
def test_vectors_first_summed_inside_a_capture_are_refused_in_one_line():
    import cupy as cp

    from mlemlib.backends._peer import PeerExchange
    from mlemlib.errors import DeviceError

    ex = PeerExchange([0, 1])
    streams, bufs = [], []
    for d in (0, 1):
        with cp.cuda.Device(d):
            streams.append(cp.cuda.Stream(non_blocking=True))
            bufs.append(cp.zeros(8, dtype=cp.uint64))
    with cp.cuda.Device(0):
        streams[0].begin_capture()
        try:
            with pytest.raises(DeviceError, match="summed once before a CUDA graph captures them"):
                ex.allreduce(bufs, streams)
        finally:
            streams[0].end_capture()


@needs_two
@pytest.mark.parametrize("bp", ["onepass_fixed", "onepass_chunked"])
@pytest.mark.parametrize("subsets", [True, False])
def test_peer_and_nccl_exchanges_give_one_gpus_bits(grouped, bp, subsets):  # noqa: F811
    p = grouped
    norm = p["norms"] if subsets else p["s"]
    kw = {"subsets": p["bounds"]} if subsets else {"graph": True}
    images = {}
    for gpus, exchange in ((1, "auto"), (2, "auto"), (2, "nccl"), (2, "peer")):
        be = make_backend("cuda", p["a"], p["g"], norm, None, bp=bp, gpus=gpus, background=p["bg"], exchange=exchange,
                          **kw)
        d = be.describe()
        assert d["exchange"] == ("none" if gpus == 1 else "peer" if exchange == "auto" else exchange)
        assert d.get("subsets", 1) == (S if subsets else 1)
        images[gpus, exchange] = _image(be)
    first = images[1, "auto"]
    for key, img in images.items():
        assert np.array_equal(img, first), key


@needs_two
def test_peer_exchange_for_float_sums_is_refused_in_one_line(grouped):  # noqa: F811
    p = grouped
    with pytest.raises(ConfigError, match="exchange.*summed in float"):
        make_backend("cuda", p["a"], p["g"], p["norms"], None, bp="onepass", gpus=2, subsets=p["bounds"],
                     exchange="peer")
