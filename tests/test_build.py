"""The compile path of the CUDA kernels (mlemlib.backends._build) without a GPU: a fake CuPy whose
RawModule records its compilations, so the background compilation (prefetch) is checked for what it
compiles, how often, on which threads, and what a failed compilation raises."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from mlemlib import registry
from mlemlib.backends import _build
from mlemlib.backends import _cuda_kernels as ck
from mlemlib.backends import _cuda_plan as plan


class FakeCupy:
    """CuPy's Device (a context manager with a compute capability) and a RawModule that counts its
    compilations, takes ``delay`` seconds each, and fails for options containing ``-DFAIL``."""

    def __init__(self, delay: float = 0.0, arch: dict[int, str] | None = None) -> None:
        self.delay = delay
        self.arch = arch or {}
        self.compiled: list[tuple[tuple[str, ...], int, str]] = []
        self.lock = threading.Lock()
        self.current = threading.local()
        fake = self

        class Device:
            def __init__(self, device_id: int = 0) -> None:
                self.id = device_id
                self.compute_capability = fake.arch.get(device_id, "90")

            def __enter__(self):
                self.before = getattr(fake.current, "id", 0)
                fake.current.id = self.id
                return self

            def __exit__(self, *exc):
                fake.current.id = self.before

        class RawModule:
            def __init__(self, code: str, options: tuple[str, ...]) -> None:
                self.options = options

            def compile(self) -> None:
                time.sleep(fake.delay)
                if any("-DFAIL" in o for o in self.options):
                    raise RuntimeError("NVRTC_ERROR_COMPILATION (fake)")
                with fake.lock:
                    fake.compiled.append((self.options, getattr(fake.current, "id", 0),
                                          threading.current_thread().name))

        self.cuda = SimpleNamespace(Device=Device)
        self.RawModule = RawModule

    def count(self, build: _build.Build, device_id: int | None = None) -> int:
        opts = ("--std=c++17", *build.options)
        return sum(1 for o, d, _ in self.compiled if o == opts and (device_id is None or d == device_id))


@pytest.fixture
def fake(monkeypatch):
    cp = FakeCupy(delay=0.05)
    monkeypatch.setattr(_build, "cupy", lambda: cp)
    monkeypatch.setattr(_build, "kernel_source", lambda name: f"// {name}")
    _build._compile.cache_clear()
    monkeypatch.setattr(_build, "_pending", {})
    yield cp
    _build._compile.cache_clear()


def _wait(builds, device_id=0):
    with _build._pending_lock:
        futures = [_build._pending[(b, "90")] for b in builds]
    for f in futures:
        f.exception(timeout=10)


def test_prefetched_builds_compile_once_in_background_threads_and_module_takes_them(fake):
    builds = [_build.Build("spmv", (f"-DX={i}",)) for i in range(6)]
    _build.prefetch(builds + builds[:2], 0)  # repeats are compiled once
    _wait(builds)
    assert [fake.count(b) for b in builds] == [1] * 6
    assert all(name.startswith("mlem-compile-") for _, _, name in fake.compiled)
    mods = [_build.module(b, 0) for b in builds]
    assert [fake.count(b) for b in builds] == [1] * 6  # taken, not compiled again
    assert mods[0] is _build.module(builds[0], 0)
    _build.prefetch(builds, 0)  # asked again: nothing new
    assert len(fake.compiled) == 6


def test_module_waits_for_a_build_still_compiling_instead_of_compiling_it_again(fake):
    fake.delay = 0.3
    b = _build.Build("spmv", ("-DSLOW",))
    _build.prefetch([b], 0)
    t0 = time.perf_counter()
    _build.module(b, 0)
    assert fake.count(b) == 1
    assert time.perf_counter() - t0 > 0.1  # it waited for the background compilation


def test_another_gpu_of_the_architecture_waits_then_compiles_its_own_module(fake):
    """A module is per device: GPU 1 waits for GPU 0's background compilation (which fills CuPy's kernel
    cache for the architecture), then loads its own."""
    b = _build.Build("compressed")
    _build.prefetch([b], 0)
    _build.module(b, 1)
    assert fake.count(b, 0) == 1 and fake.count(b, 1) == 1


def test_a_failed_background_compilation_raises_where_the_build_is_asked_for(fake):
    bad = _build.Build("spmv", ("-DFAIL",))
    good = _build.Build("spmv", ("-DOK",))
    _build.prefetch([bad, good], 0)
    _wait([bad, good])
    with pytest.raises(RuntimeError, match="NVRTC_ERROR_COMPILATION"):
        _build.module(bad, 0)
    _build.module(good, 0)
    assert fake.count(good) == 1


def test_kernel_builds_name_each_kernels_source():
    cuda = [k for k in registry.KERNELS if k.backend == "cuda"]
    shapes = list(dict.fromkeys(sh.build for sh in plan.SHAPE_CANDIDATES))
    csr_vector = registry.get("cuda", "forward", "csr_vector")
    assert ck.kernel_builds([csr_vector]) == list(dict.fromkeys([ck.SPMV, *shapes]))
    assert len(shapes) > 1 and ck.SPMV in shapes  # the default shape is the plain build
    assert ck.kernel_builds([csr_vector], tune=False) == [ck.SPMV]
    assert ck.kernel_builds([registry.get_bp("cuda", "onepass_chunked")]) == [ck.SPMV, _build.COMPRESSED]
    assert ck.kernel_builds([registry.get_bp("cuda", "scatter_vec")]) == [ck.SPMV, ck.SPMV_VECTOR_ATOMICS]
    assert ck.kernel_builds([registry.get("cuda", "forward", "cusparse")]) == [ck.SPMV]
    # every cuda kernel's build is one of the three sources' builds
    every = set(ck.kernel_builds(cuda))
    assert every == {ck.SPMV, ck.SPMV_VECTOR_ATOMICS, _build.COMPRESSED, *shapes}


def test_kernels_of_a_choice():
    onepass = registry.get_bp("cuda", "onepass_fixed")
    assert registry.kernels_of("cuda", "onepass_fixed", "onepass_fixed") == [onepass]
    assert registry.kernels_of("cuda", "csr_vector", "scatter") == [
        registry.get("cuda", "forward", "csr_vector"), registry.get_bp("cuda", "scatter")]
