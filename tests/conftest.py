"""Shared pytest set-up: the ``gpu`` marker skips without a CUDA GPU; a SLURM installed but not running
answers at once; a runner of the workflow."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mlemlib.backends import cuda_available


#: A slurm.conf that SLURM's commands refuse at once (it names no cluster).
SLURM_ABSENT_CONF = Path(__file__).resolve().parent / "slurm_absent.conf"


def pytest_configure(config):
    """Where SLURM is installed but its controller does not answer (a machine where tools/slurm/start.sh once
    ran, now stopped), make its commands fail at once instead of after their ~9 s connection timeout.

    Snakemake's SLURM executor plugin runs ``scontrol show config`` when it is imported, which every
    ``snakemake`` command does: with the controller down each workflow test's command waited 9 s for it,
    idle. Here, once per session (xdist's workers inherit the environment), ``SLURM_CONF`` then points at
    :data:`SLURM_ABSENT_CONF` and ``MLEM_TEST_SLURM_DOWN`` says why, which tests/test_slurm.py reports as
    its reason to skip; with the controller up nothing changes."""
    if hasattr(config, "workerinput") or "MLEM_TEST_SLURM_DOWN" in os.environ:
        return  # an xdist worker (its controller decided) or a session inside one that did
    if shutil.which("scontrol") is None or shutil.which("sinfo") is None:
        return  # no SLURM: the plugin looks no further
    try:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        down = f"scontrol ping: {exc}"
    else:
        if "UP" in ping.stdout:
            return
        down = (ping.stdout.strip() or ping.stderr.strip() or "scontrol ping: no answer").splitlines()[0]
    os.environ["MLEM_TEST_SLURM_DOWN"] = down
    os.environ["SLURM_CONF"] = str(SLURM_ABSENT_CONF)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Skip the ``gpu`` tests without a CUDA GPU.

    Under ``pytest -n N --dist loadgroup`` (``make test``): keep the tests of a module that share a
    module- or class-scoped fixture (a finished workflow run, a generated matrix) on one worker, so
    the fixture is made once, not once per worker. The other tests are spread one by one, and so are
    those of a session-scoped fixture: such a fixture shares its work between workers itself (a
    directory under ``tmp_path_factory.getbasetemp().parent`` and a lock file, as in test_compose.py).
    Runs before xdist's own hook, which reads the ``xdist_group`` marks; without xdist the marks change
    nothing."""
    loadgroup = bool(getattr(config.option, "loadgroup", False))  # set on xdist's workers
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        shared = any(
            defs[-1].scope in ("module", "package", "class") and defs[-1].baseid  # baseid "": a plugin's
            for defs in info.name2fixturedefs.values()
            if defs
        )
        if shared:
            group = Path(item.nodeid.split("::", 1)[0]).stem
            item.add_marker(pytest.mark.xdist_group(group))
            if loadgroup and "_nodeid" not in vars(item) and hasattr(item, "_id"):
                # pytest >= 9.2 keeps the node id in ``_id``: xdist 3.8 still sets ``_nodeid`` (no longer
                # read), so its ``@group`` suffix, which the scheduler groups by, is set here.
                from _pytest.nodeid import NodeId

                item._id = NodeId.parse(f"{item.nodeid}@{group}")
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (CuPy with a device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per usable core, at most 8 (each worker imports the whole suite once)."""
    return max(1, min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1, 8))


@pytest.fixture
def rng():
    """A fresh, seeded random generator per test."""
    import numpy as np

    return np.random.default_rng(20261122)


REPO = Path(__file__).resolve().parents[1]


#: The device workflow's tools (stdlib scripts, not a package).
DEVICE_TOOLS = Path(__file__).resolve().parents[1] / "tools" / "device_workflow"


def load_device_tool(name: str):
    """``tools/device_workflow/<name>.py`` imported as module ``name`` (registered in ``sys.modules``:
    dataclasses look their module up)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, DEVICE_TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run_workflow(workdir: Path, config: dict, *args: str, name: str = "config") -> subprocess.CompletedProcess:
    """The workflow on ``config`` (written to ``workdir/name.yaml``); asserts success, returns the process."""
    import yaml

    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    cmd = [
        sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--directory", str(workdir),
        "--configfile", str(path), *args,
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc
