"""The workflow's MAP runs (config mlem.prior, mlem.algorithm, mlem.relaxation) and its one verdict.

Dry runs: a MAP config plans the converged MAP image once per measurement and
names the settings in the run and reference paths (two settings, two
directories; the algorithms share the converged image); bad MAP settings, and a
prior on a matrix without a voxel grid, stop the dry run in one line. A real
run of the ``small`` preset on the CPU writes the MAP columns of runs.csv.
Then the dry run's verdict on a sample of (matrix, run) pairs is
:func:`mlemlib.compose.verdict`'s, word for word.
"""

from __future__ import annotations

import copy
import csv
import re

import numpy as np
import pytest
from test_workflow import TINY, changed, dry_run, one_line, planned_jobs, snakemake, user_files

from mlemlib import compose

#: A MAP prior of the tests (the relative difference prior).
RDP = {"type": "rdp", "beta": 0.1, "epsilon": 0.01}


def map_config(prior: dict | None = None, **mlem) -> dict:
    """TINY with a prior (RDP unless given) and other mlem keys; no partition table (not needed)."""
    config = changed(mlem={"prior": dict(prior or RDP), **mlem}, partition={"parts": []})
    return config


def planned_outputs(workdir, config: dict) -> dict[str, list[str]]:
    """rule -> the outputs a dry run of ``config`` would write (from Snakemake's job listing)."""
    return outputs_of(snakemake(workdir, "--dry-run", config=config))


def outputs_of(proc) -> dict[str, list[str]]:
    """rule -> the outputs of the jobs a finished dry run (without ``--quiet``) lists."""
    assert proc.returncode == 0, proc.stdout + proc.stderr
    outputs: dict[str, list[str]] = {}
    rule = None
    for line in (proc.stdout + proc.stderr).splitlines():
        found = re.match(r"\s*(?:local)?rule (\w+):", line)
        if found:
            rule = found.group(1)
        elif line.strip().startswith("output:") and rule:
            outputs.setdefault(rule, []).extend(p.strip() for p in line.split(":", 1)[1].split(","))
    return outputs


def run_dir(path: str) -> str:
    """The run's (or reference's, converged image's) directory name under results/{matrix}/runs/{data}/."""
    return path.split("/runs/nema-seed1/", 1)[1].split("/", 1)[0]


# --------------------------------------------------------------- the dry run


def test_a_map_dry_run_plans_the_converged_image_once_and_names_the_settings(tmp_path):
    config = map_config(map_converged_passes=7)
    proc = snakemake(tmp_path, "--dry-run", config=config)  # its job stats and its jobs
    assert planned_jobs(proc)["compute_converged_map"] == 1
    out = outputs_of(proc)
    runs = {run_dir(p) for p in out["run_mlem"]}
    (reference,) = {run_dir(p) for p in out["reference_mlem"]}
    (converged,) = {run_dir(p) for p in out["compute_converged_map"]}
    model = re.fullmatch(r"reference-it2-(mlem_bsrem_rdp_p[0-9a-f]{8})", reference).group(1)
    # every run and its reference name the same MAP settings; the converged image (7 passes of BSREM with
    # the hessian preconditioner and its own relaxation) names its own
    assert runs == {f"cpu-auto-auto-{'it2-rep1-ck0'}-{model}", f"cpu-auto-notrans-it2-rep1-ck0-{model}"}
    assert re.fullmatch(r"converged-it7-mlem_bsrem_rdp_p[0-9a-f]{8}", converged)
    assert converged != f"converged-it7-{model}"
    # OSL with another relaxation: other runs and reference, the same converged image (the maximiser of the
    # same objective)
    osl = planned_outputs(tmp_path, map_config(map_converged_passes=7, algorithm="osl", relaxation=[1.0, 20.0]))
    (osl_reference,) = {run_dir(p) for p in osl["reference_mlem"]}
    assert osl_reference.startswith("reference-it2-mlem_osl_rdp_p") and osl_reference != reference
    assert {run_dir(p) for p in osl["compute_converged_map"]} == {converged}
    offset = planned_outputs(tmp_path, map_config(map_converged_passes=7, preconditioner="hessian",
                                                 preconditioner_offset=0.2, averaging="pass"))
    assert {run_dir(p) for p in offset["compute_converged_map"]} == {converged}


def test_two_betas_give_two_run_directories_and_no_prior_keeps_todays_paths(tmp_path):
    def dirs(config):
        out = planned_outputs(tmp_path, config)
        return {run_dir(p) for rule in ("run_mlem", "reference_mlem") for p in out[rule]}

    first, second = dirs(map_config()), dirs(map_config({**RDP, "beta": 0.2}))
    assert len(first) == len(second) == 3 and not first & second
    relaxed = dirs(map_config(relaxation=[0.5, 10]))
    assert not relaxed & first and not relaxed & second
    offset = dirs(map_config(preconditioner_offset=0.3))
    assert len(offset) == 3 and not offset & (first | second | relaxed)
    mean = dirs(map_config(averaging="pass"))
    assert len(mean) == 3 and not mean & (first | second | relaxed | offset)
    two = dirs(map_config(subsets=2))
    halved = dirs(map_config(subsets=2, subset_halving=[5]))
    assert len(halved) == 3 and not halved & (first | second | relaxed | offset | mean | two)
    # prior none (the default): the paths of MLEM, no model part, no converged image
    plain = planned_outputs(tmp_path, TINY)
    assert {run_dir(p) for p in plain["reference_mlem"]} == {"reference-it2"}
    assert "compute_converged_map" not in plain


@pytest.mark.parametrize(
    ("prior", "mlem", "line"),
    [
        ({**RDP, "bta": 1}, {}, "config mlem.prior: Additional properties are not allowed ('bta' was unexpected); "
                                "config/schema.yaml lists the keys and their allowed values"),
        ({"type": "rdp", "beta": 0.1}, {}, "config mlem.prior.epsilon: the relative difference prior needs "
                                           "epsilon > 0, got None (about 1e-3 of the image's mean value in the "
                                           "object)"),
        ({"type": "quadratic"}, {}, "config mlem.prior.beta: a prior needs beta (a number >= 0), found none"),
        ({"type": "quadratic", "beta": -1}, {}, "config mlem.prior.beta: must be >= 0, got -1"),
        (RDP, {"relaxation": [1, 0]}, "config mlem.relaxation: lambda_0 and eta must be > 0, got (1, 0)"),
        (RDP, {"algorithm": "osl", "averaging": "pass"},
         "config mlem.averaging: 'pass' is BSREM's; osl gives its last sub-iterate"),
        (RDP, {"subset_halving": [5, 5]}, "config mlem.subset_halving: passes after which the subsets halve: "
                                          "increasing integers >= 1, got (5, 5)"),
        (RDP, {"subset_halving": [5]}, "config mlem.subset_halving: 1 halvings of 1 subsets: S must be divisible "
                                       "by 2"),
    ],
)
def test_bad_map_settings_stop_the_dry_run_in_one_line(tmp_path, prior, mlem, line):
    assert one_line(snakemake(tmp_path, "--dry-run", config=map_config(prior, **mlem))) == line


def test_a_prior_needs_the_grid_of_a_users_matrix(tmp_path):
    config = user_files(tmp_path)  # a 40 x 12 .mtx: no grid
    config["mlem"] = {**config["mlem"], "prior": dict(RDP)}
    assert one_line(snakemake(tmp_path, "--dry-run", config=config)) == (
        "config mlem.prior.type: rdp needs the voxel grid of matrix mine, and data/mine.mtx records none; set "
        "matrices.mine.grid: [NX, NY, NZ]")
    config["matrices"]["mine"]["grid"] = [2, 2, 2]
    assert one_line(snakemake(tmp_path, "--dry-run", config=config)) == (
        "config matrices.mine.grid: 2x2x2 = 8 voxels, but the matrix has n = 12 columns")
    config["matrices"]["mine"]["grid"] = [2, 2, 3]
    jobs = dry_run(tmp_path, config)
    assert jobs["convert_matrix"] == 1 and jobs["run_mlem"] == 1
    assert "compute_converged_map" not in jobs  # a user's measurement: no truth, no regions, no metrics
    # kappa is read as the runs read it, before any job: one value per voxel, finite, non-negative
    kappa = tmp_path / "data" / "kappa.f32"
    np.ones(11, np.float32).tofile(kappa)
    config["mlem"]["prior"]["kappa"] = "data/kappa.f32"
    assert one_line(snakemake(tmp_path, "--dry-run", config=config)) == (
        "config mlem.prior.kappa (matrix mine): data/kappa.f32: 11 kappa values, expected one per voxel (12, the "
        "matrix's columns)")
    np.array([1.0] * 11 + [-0.5], np.float32).tofile(kappa)
    assert one_line(snakemake(tmp_path, "--dry-run", config=config)) == (
        "config mlem.prior.kappa (matrix mine): data/kappa.f32: negative kappa -0.5 at voxel 11")
    np.ones(12, np.float32).tofile(kappa)
    assert dry_run(tmp_path, config)["run_mlem"] == 1
    config["mlem"]["prior"]["kappa"] = None
    config["matrices"]["mine"]["grid"] = None
    config["matrices"]["mine"]["voxel_size"] = [2.0, 2.0, 2.0]
    assert one_line(snakemake(tmp_path, "--dry-run", config=config)) == (
        "config matrices.mine.voxel_size: given without a grid; set matrices.mine.grid: [NX, NY, NZ] as well")
    preset = map_config()
    preset["matrices"]["small"]["grid"] = [2, 2, 3]
    assert one_line(snakemake(tmp_path, "--dry-run", config=preset)) == (
        "config matrices.small.grid: the preset small has its own grid; grid is for your own matrix file (path) "
        "that records none")


@pytest.mark.parametrize("fold", [False, True])
def test_the_convert_stage_records_the_given_grid(tmp_path, fold):
    import numpy as np
    import scipy.sparse as sp

    from mlemlib.fold import convert_stage
    from mlemlib.formats import geometry_value, open_matrix

    a = sp.random(20, 12, density=0.4, random_state=2, format="csr", dtype=np.float32)
    sp.save_npz(tmp_path / "a.npz", sp.vstack([a, a]).tocsr())  # every row twice: folding halves them
    convert_stage(tmp_path / "a.npz", tmp_path / "m.h5", fold=fold, grid=(2, 3, 2), voxel_size=(1.0, 1.0, 2.5))
    with open_matrix(tmp_path / "m.h5") as src:
        assert src.shape == ((20 if fold else 40), 12)
        assert tuple(geometry_value(src, "grid")) == (2, 3, 2)
        assert tuple(geometry_value(src, "voxel_size")) == (1.0, 1.0, 2.5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npz", "m.h5"]  # no temporary left


def test_a_users_matrix_with_a_grid_runs_map(tmp_path):
    from mlemlib.formats import geometry_value, open_matrix

    config = user_files(tmp_path)
    config["matrices"]["mine"]["grid"] = [2, 2, 3]
    config["mlem"] = {**config["mlem"], "prior": {"type": "quadratic", "beta": 0.5}, "algorithm": "osl"}
    proc = snakemake(tmp_path, "--cores", "2", config=config)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open_matrix(next((tmp_path / "results/mine").glob("*.h5"))) as src:
        assert tuple(geometry_value(src, "grid")) == (2, 2, 3)
    with open(tmp_path / f"results/summary/{config.get('name', 'default')}/runs.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert rows and {(r["map_algorithm"], r["prior"]) for r in rows} == {("osl", "quadratic")}
    assert all(r["time_to_threshold_s"] == "" for r in rows)  # no phantom: no metrics


# ------------------------------------------------------------- a real run


@pytest.fixture(scope="module")
def map_run(tmp_path_factory):
    """The small preset on the CPU with the relative difference prior: 3 passes of 2 subsets, the converged image
    3 passes (the run with the converged image's preconditioner and relaxation, so that it ends at that image)."""
    workdir = tmp_path_factory.mktemp("map")
    config = map_config(iterations=3, map_converged_passes=3, preconditioner="hessian", relaxation=[1.0, 40.0],
                        subsets=2)
    config["runs"] = [{"backend": "cpu", "fp": "auto", "bp": "auto"}]
    config["transpose"] = {"method": "scipy", "compare": []}
    proc = snakemake(workdir, "--cores", "2", config=config, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(workdir / "results/summary/default/runs.csv", newline="") as fh:
        return workdir, config, list(csv.DictReader(fh))


def test_a_map_run_writes_the_map_columns(map_run):
    _, _, rows = map_run
    run = [r for r in rows if r["reference_mode"] == "False"]
    ref = [r for r in rows if r["reference_mode"] == "True"]
    assert len(run) == len(ref) == 1
    for r in run + ref:
        assert (r["map_algorithm"], r["prior"], float(r["beta"])) == ("bsrem", "rdp", 0.1)
        assert float(r["phi"]) != 0
    # BSREM's run of as many passes as the converged image (BSREM in float64) ends at it: the threshold
    # is reached, at the last pass at the latest
    assert int(run[0]["passes_to_threshold"]) <= 3 and float(run[0]["time_to_threshold_s"]) > 0
    # the run (float32) is measured against its float64 reference of the same algorithm, and Phi agrees
    assert float(run[0]["rel_l2_reference"]) < 1e-4
    assert abs(float(run[0]["phi"]) - float(ref[0]["phi"])) <= 1e-6 * abs(float(ref[0]["phi"]))


def test_a_finished_map_run_is_up_to_date_and_another_beta_reruns_the_map_jobs_only(map_run):
    workdir, config, _ = map_run
    assert dry_run(workdir, config) == {}
    other = copy.deepcopy(config)
    other["mlem"]["prior"]["beta"] = 0.2
    assert dry_run(workdir, other) == {"compute_converged_map": 1, "reference_mlem": 1, "run_mlem": 1,
                                       "summarize": 1}


def test_another_subset_schedule_or_pass_mean_reruns_the_runs_but_not_the_converged_image(map_run):
    """The algorithm's schedule (subsets halving after pass 2, the relaxation) or the pass mean changes the runs and
    their float64 references, not the problem: the converged image (and everything before the runs) is not made
    again."""
    workdir, config, _ = map_run
    for key, value in (("subset_halving", [2]), ("averaging", "pass"), ("relaxation", [1.0, 20.0])):
        other = copy.deepcopy(config)
        other["mlem"][key] = value
        assert dry_run(workdir, other) == {"reference_mlem": 1, "run_mlem": 1, "summarize": 1}, key


# ---------------------------------------------------------- one verdict


def _pair(fmt: str, subsets: int, background: bool, run: dict) -> tuple[dict, compose.Combination]:
    """A config of one matrix in `fmt` and one run, and the Combination compose judges for it."""
    config = changed(matrices={"small": {"preset": "small", "format": fmt}}, runs=[run], use_gpu=True,
                     mlem={"subsets": subsets}, partition={"parts": []},
                     simulation={"randoms_fraction": 0.2} if background else {})
    full = {"gpus": 1, "layout": "local", "graph": "auto", "fp": "auto", "bp": "auto", **run}
    c = compose.Combination(format=fmt, fold=False, reorder="rows+voxels", subsets=subsets, factors=background,
                            backend=full["backend"], fp=full["fp"], bp=full["bp"], gpus=full["gpus"],
                            layout=full["layout"], graph=full["graph"])
    return config, c


PAIRS = [
    ("csr", 1, False, {"backend": "cpu"}),
    ("compressed", 4, False, {"backend": "cuda", "bp": "onepass"}),
    ("csr", 1, False, {"backend": "cuda", "fp": "csr_vector", "bp": "csr_vector", "gpus": 2, "layout": "thesis"}),
    ("csr", 1, True, {"backend": "cpu", "bp": "onepass_chunked"}),
    ("compressed", 4, False, {"backend": "cuda", "bp": "delta_vector"}),
    ("csr", 4, False, {"backend": "cuda", "fp": "csr_vector", "bp": "csr_vector", "gpus": 2, "layout": "thesis"}),
    ("compressed-u16", 1, False, {"backend": "cpu", "fp": "csr_vector"}),
]


@pytest.mark.parametrize(("fmt", "subsets", "background", "run"), PAIRS)
def test_the_dry_runs_verdict_is_composes(tmp_path, fmt, subsets, background, run):
    config, c = _pair(fmt, subsets, background, run)
    verdict = compose.verdict(c)
    proc = snakemake(tmp_path, "--dry-run", "--quiet", "rules", "--resources", "gpu=2", config=config)
    if verdict is None:
        assert planned_jobs(proc)["run_mlem"] == 1
    else:
        assert one_line(proc) == "config " + verdict.replace("run.", "runs[0].", 1)


def test_the_sample_has_refusals_and_acceptances_across_formats_subsets_and_backends():
    verdicts = [compose.verdict(_pair(*p)[1]) for p in PAIRS]
    assert sum(v is None for v in verdicts) == 3 and sum(v is not None for v in verdicts) == 4
    refused = [p for p, v in zip(PAIRS, verdicts) if v is not None]
    assert {p[0] for p in refused} >= {"csr", "compressed"} and {p[3]["backend"] for p in refused} == {"cpu", "cuda"}


def test_a_subset_schedule_with_a_gpu_run_passes_the_dry_run(tmp_path):
    """The subsets halve on every backend: a cuda run beside the cpu ones is planned like them."""
    config = map_config(subsets=2, subset_halving=[5])
    config["runs"] = [*config["runs"], {"backend": "cuda", "fp": "auto", "bp": "auto"}]
    proc = snakemake(tmp_path, "--dry-run", config=config)
    assert proc.returncode == 0, proc.stderr
    assert "run_mlem" in proc.stdout
