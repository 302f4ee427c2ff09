"""GPU leases (mlemlib.dist.lease, ``mlem lease``): no GPU needed.

Devices are simulated with ``MLEM_NUM_GPUS`` / ``CUDA_VISIBLE_DEVICES``; the
locks are real ``flock`` locks taken by real, concurrent processes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import pytest

from mlemlib.dist import lease as L
from mlemlib.errors import ConfigError

HOLD_SCRIPT = """
import sys, time
from mlemlib.dist.lease import acquire
lease = acquire(int(sys.argv[1]), timeout=10)
print(lease.visible_devices, flush=True)
time.sleep(60)
"""


@pytest.fixture
def gpus(tmp_path, monkeypatch):
    """Four simulated GPUs and a private lock directory."""
    monkeypatch.setenv("MLEM_NUM_GPUS", "4")
    monkeypatch.setenv("MLEM_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    return tmp_path / "locks"


def _child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra)
    return env


# --- parsing and counting ------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [
        ("0,2", ["0", "2"]),
        (" 3 , 1 ", ["3", "1"]),
        ("", []),
        ("-1", []),
        ("1,-1,2", ["1"]),  # CUDA stops at the first invalid entry
        ("1,,2", ["1"]),
        ("GPU-8f6c,2", ["GPU-8f6c", "2"]),
        ("01", ["1"]),
    ],
)
def test_parse_visible_devices(value, expected):
    assert L.parse_visible_devices(value) == expected


def test_parse_visible_devices_rejects_duplicates():
    with pytest.raises(ConfigError, match="listed twice"):
        L.parse_visible_devices("1,0,1")


def test_device_count_override_and_bad_value():
    assert L.device_count({"MLEM_NUM_GPUS": "3"}) == 3
    assert L.device_count({"MLEM_NUM_GPUS": "0"}) == 0
    for bad in ("two", "-1", "1.5"):
        with pytest.raises(ConfigError, match="MLEM_NUM_GPUS"):
            L.device_count({"MLEM_NUM_GPUS": bad})


# --- in-process behaviour --------------------------------------------------------


def test_lease_sets_and_restores_environment(gpus):
    os.environ["CUDA_DEVICE_ORDER"] = "FASTEST_FIRST"
    with L.lease_gpus(2) as lease:
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1" == lease.visible_devices
        assert os.environ["CUDA_DEVICE_ORDER"] == "FASTEST_FIRST"  # the user's choice is kept
        assert all(L.is_locked(L.lock_path(gpus, d)) for d in lease.devices)
        # Inside the lease, only the leased devices are candidates, and they are taken.
        with pytest.raises(L.LeaseTimeout, match="among 2"):
            L.acquire(1, timeout=0)
        # Another job (no CUDA_VISIBLE_DEVICES) gets the next free device.
        with L.acquire(1, env={"MLEM_NUM_GPUS": "4", "MLEM_LOCK_DIR": str(gpus)}) as second:
            assert second.visible_devices == "2"
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    assert not any(r["held"] for r in L.status(gpus))


def test_pci_bus_order_set_only_for_plain_indices(gpus):
    with L.lease_gpus(1):
        assert os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert "CUDA_DEVICE_ORDER" not in os.environ


def test_over_asking_is_a_clear_config_error(gpus):
    with pytest.raises(ConfigError, match=r"asked for 5 GPUs but only 4 are visible .*MLEM_NUM_GPUS=4"):
        L.acquire(5)
    with pytest.raises(ConfigError, match="expected an integer >= 1"):
        L.acquire(0)
    with pytest.raises(ConfigError, match="only 0 are visible"):
        L.acquire(1, env={"MLEM_NUM_GPUS": "0", "MLEM_LOCK_DIR": str(gpus)})


def test_cuda_visible_devices_subset_is_respected(gpus, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    with L.acquire(1) as a:
        assert a.visible_devices == "3"
        with L.acquire(1) as b:
            assert b.visible_devices == "1"
            with pytest.raises(L.LeaseTimeout, match="among 2"):
                L.acquire(1, timeout=0)  # devices 0 and 2 exist but are not ours
    with L.lease_gpus(2):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "3,1"
        assert "CUDA_DEVICE_ORDER" not in os.environ  # the allocation's numbering is kept
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3,1"
    with pytest.raises(ConfigError, match=r"only 2 are visible .*CUDA_VISIBLE_DEVICES='3,1'"):
        L.acquire(3)


def test_timeout_names_the_holder(gpus):
    with L.acquire(3):
        t0 = time.monotonic()
        with pytest.raises(L.LeaseTimeout) as err:
            L.acquire(2, timeout=0.3, poll=0.05)
        assert time.monotonic() - t0 >= 0.3
        msg = str(err.value)
        assert f"pid {os.getpid()}" in msg and "no 2 free GPU(s) among 4" in msg
    with L.acquire(2) as lease:  # all free again
        assert lease.visible_devices == "0,1"


def test_all_or_nothing_holds_nothing_while_waiting(gpus):
    held = L.acquire(3)  # only device 3 is free
    try:
        with pytest.raises(L.LeaseTimeout):
            L.acquire(2, timeout=0)
        assert not L.is_locked(L.lock_path(gpus, L.Device("3", "3")))  # not kept while failing
    finally:
        held.release()


def test_uuid_keys_join_different_numberings(gpus, monkeypatch):
    """Index 1 and its UUID are one device: one lock, whatever the job's numbering."""
    monkeypatch.delenv("MLEM_NUM_GPUS")
    monkeypatch.setattr(L, "_nvml_uuids", lambda: ["GPU-aaaa", "GPU-bbbb"])
    with L.acquire(2) as lease:
        assert [d.key for d in lease.devices] == ["GPU-aaaa", "GPU-bbbb"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with L.acquire(1) as by_index:
        assert by_index.devices[0].key == "GPU-bbbb"
        with pytest.raises(L.LeaseTimeout):
            L.acquire(1, timeout=0, env={"CUDA_VISIBLE_DEVICES": "GPU-bbbb", "MLEM_LOCK_DIR": str(gpus)})
        with L.acquire(1, env={"CUDA_VISIBLE_DEVICES": "GPU-aaaa", "MLEM_LOCK_DIR": str(gpus)}) as other:
            assert other.visible_devices == "GPU-aaaa"


def test_unusable_lock_dir_is_a_config_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="cannot create the GPU lock directory"):
        L.acquire(1, directory=blocker / "locks", env={"MLEM_NUM_GPUS": "1"})


# --- concurrent processes ----------------------------------------------------------


def _take_and_meet(count, barrier, queue):
    lease = L.acquire(count, timeout=20, poll=0.05)
    queue.put(lease.visible_devices)
    barrier.wait(timeout=20)  # both hold their lease at the same moment
    lease.release()


def test_concurrent_processes_get_disjoint_devices(gpus):
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_take_and_meet, args=(2, barrier, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    sets = [set(queue.get(timeout=5).split(",")) for _ in procs]
    assert all(len(s) == 2 for s in sets)
    assert sets[0].isdisjoint(sets[1]) and sets[0] | sets[1] == {"0", "1", "2", "3"}


def _take_log_release(count, hold, queue):
    lease = L.acquire(count, timeout=60, poll=0.02)
    t0 = time.time()
    time.sleep(hold)
    t1 = time.time()
    lease.release()
    queue.put((lease.visible_devices, t0, t1))


def test_overlapping_holders_never_share_a_device(gpus):
    """Five jobs of 2 GPUs on 4 GPUs: any two that held at the same time had disjoint sets."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_take_log_release, args=(2, 0.4, queue)) for _ in range(5)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * 5
    recs = [queue.get(timeout=5) for _ in procs]
    overlaps = 0
    for i, (di, a0, a1) in enumerate(recs):
        for dj, b0, b1 in recs[i + 1 :]:
            if a0 < b1 and b0 < a1:
                overlaps += 1
                assert set(di.split(",")).isdisjoint(dj.split(","))
    assert overlaps >= 1  # the test did exercise concurrency


def test_sigkilled_holder_frees_its_devices(gpus):
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD_SCRIPT, "3"], stdout=subprocess.PIPE, text=True, env=_child_env()
    )
    try:
        assert child.stdout.readline().strip() == "0,1,2"
        with pytest.raises(L.LeaseTimeout, match=f"pid {child.pid}"):
            L.acquire(2, timeout=0)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        assert child.returncode == -signal.SIGKILL
        with L.acquire(4, timeout=5) as lease:  # no stale lock left behind
            assert lease.visible_devices == "0,1,2,3"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_waiting_job_starts_when_devices_free_up(gpus):
    holder = L.acquire(3)
    t0 = time.monotonic()

    def release_later():
        time.sleep(0.5)
        holder.release()

    import threading

    threading.Thread(target=release_later).start()
    with L.acquire(2, timeout=10, poll=0.05) as lease:
        waited = time.monotonic() - t0
        assert lease.visible_devices == "0,1"
    assert 0.4 < waited < 5


# --- the command line -----------------------------------------------------------


def test_cli_runs_command_holding_the_lease(gpus):
    """The exec'd command sees its devices and still holds their locks (inherited)."""
    probe = (
        "import os; from mlemlib.dist.lease import acquire, LeaseTimeout\n"
        "print(os.environ['CUDA_VISIBLE_DEVICES'])\n"
        "try:\n"
        "    acquire(1, timeout=0)\n"  # my own device, seen as held by another open file
        "    print('free')\n"
        "except LeaseTimeout:\n"
        "    print('held')\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "mlemlib", "lease", "-g", "2", "--", sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        env=_child_env(),
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0,1", "held"]
    assert not any(r["held"] for r in L.status(gpus))  # released when the command ended


def test_cli_errors(gpus):
    def mlem(*args):
        return subprocess.run(
            [sys.executable, "-m", "mlemlib", "lease", *args], capture_output=True, text=True, env=_child_env()
        )

    r = mlem("-g", "9", "--", "true")
    assert r.returncode == 2 and "asked for 9 GPUs but only 4" in r.stderr
    r = mlem("-g", "1")
    assert r.returncode == 2 and "nothing to run" in r.stderr
    r = mlem("-g", "1", "--", "no-such-command-xyz")
    assert r.returncode == 2 and "no-such-command-xyz: command not found" in r.stderr
    with L.acquire(4):
        r = mlem("-g", "1", "-t", "0", "--", "true")
        assert r.returncode == 1 and "no 1 free GPU(s)" in r.stderr
        r = mlem("--status")
        assert r.returncode == 0 and r.stdout.count("held") == 4


def test_reconstruct_lease_refuses_before_any_work(gpus, tmp_path):
    """``mlem reconstruct --lease`` takes its GPUs first: over-asking fails at once, naming the count."""
    fake = tmp_path / "x.h5"
    fake.write_text("not read")
    r = subprocess.run(
        [sys.executable, "-m", "mlemlib", "reconstruct", "-m", str(fake), "-s", str(fake), "-n", "1",
         "--gpus", "5", "--lease", "-o", str(tmp_path / "img.h5")],
        capture_output=True, text=True, env=_child_env(), timeout=120,
    )
    assert r.returncode == 2 and "asked for 5 GPUs but only 4" in r.stderr
    assert not (tmp_path / "img.h5").exists()


def test_nvml_uuids_from_a_fake_nvml_and_none_when_nvml_fails(monkeypatch):
    import types

    calls = []

    def init():
        calls.append("init")

    nvml = types.SimpleNamespace(
        nvmlInit=init,
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUUID=lambda h: f"GPU-{h}".encode(),
    )
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert L._nvml_uuids() == ["GPU-0", "GPU-1"]
    assert calls == ["init", "shutdown"]

    def broken():
        raise RuntimeError("driver not loaded")

    nvml.nvmlInit = broken
    assert L._nvml_uuids() is None
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    assert L._nvml_uuids() is None
