"""MAP reconstruction (config mlem.prior, mlem.algorithm, mlem.relaxation,
mlem.preconditioner, mlem.preconditioner_offset, mlem.averaging,
mlem.subset_halving):
its settings checked before any job, the part of {model} that names them in
the run and reference paths, the converged MAP image of a simulated
measurement and the metrics its runs record against it, and the voxel grid of
a user's matrix (matrices.<name>.grid) that a prior needs.
"""

import dataclasses
import hashlib

from mlemlib.grid import check_grid

# ----------------------------------------------------------------- settings


def get_map_settings():
    """mlemlib.map.MapSettings of config mlem; None without a prior (is_map)."""
    from mlemlib.map import MapSettings

    if not is_map():
        return None
    mlem = config["mlem"]
    prior = mlem["prior"]
    return MapSettings(
        prior=prior["type"],
        beta=prior["beta"],
        gamma=prior["gamma"],
        epsilon=prior["epsilon"],
        kappa=prior["kappa"],
        algorithm=mlem["algorithm"],
        relaxation=tuple(mlem["relaxation"]),
        preconditioner=mlem["preconditioner"],
        preconditioner_offset=mlem["preconditioner_offset"],
        averaging=mlem["averaging"],
        subset_halving=tuple(mlem["subset_halving"]),
    )


def check_map_settings():
    """Stop, in one line naming the mlem key, on MAP settings that
    mlemlib.map.MapSettings.check refuses (a missing beta first), a subset
    schedule that mlem.subsets cannot follow."""
    from mlemlib.map import check_halving

    if not is_map():
        return
    if config["mlem"]["prior"]["beta"] is None:
        stop("config mlem.prior.beta: a prior needs beta (a number >= 0), found none")
    try:
        settings = get_map_settings().check()
        check_halving(settings.subset_halving, config["mlem"]["subsets"])
    except ConfigError as exc:
        stop(f"config mlem.{exc}")


def get_map_params(settings=None):
    """The MAP settings (config mlem's, or `settings`) as a params entry ({}
    without a prior, so that the params of MLEM/OSEM runs stay as they were):
    the scripts build MapSettings(**map) from it."""
    if not is_map():
        return {}
    return {"map": dataclasses.asdict(settings or get_map_settings())}


def get_map_input(wildcards=None):
    """Named input kappa (the prior's weights file) where configured."""
    from mlemlib.corrections import split_h5

    kappa = config["mlem"]["prior"]["kappa"]
    return {"kappa": split_h5(kappa)[0]} if is_map() and kappa else {}


def get_map_model(settings):
    """The part of {model} that names MAP `settings`: the algorithm, the prior
    and 8 hex digits of every setting (beta, gamma, epsilon, the relaxation,
    the kappa file and its contents), e.g. bsrem_rdp_p1a2b3c4d."""
    from mlemlib.corrections import split_h5

    text = settings.identity()
    if settings.kappa:
        path, dataset = split_h5(settings.kappa)
        text += f";{_read_checked(path, file_digest)}:{dataset or ''}"
    digest = hashlib.blake2b(text.encode(), digest_size=4).hexdigest()
    return f"{settings.algorithm}_{settings.prior}_p{digest}"


# ------------------------------------------------------- the converged image


def is_map_metrics(wildcards):
    """True when the MAP runs of {data} record metrics against the converged
    MAP image: MAP on a simulated measurement (its truth holds the regions)."""
    return is_map() and is_simulated(wildcards)


def get_converged_settings():
    """The MAP settings of the converged image: the configured prior with BSREM,
    its hessian preconditioner and fixed relaxation
    (mlemlib.map_metrics.converged_settings)."""
    from mlemlib.map_metrics import converged_settings

    return converged_settings(get_map_settings())


def get_converged_wildcards(matrix, data):
    """The wildcards of the converged image of {matrix} x {data}: its passes
    (config mlem.map_converged_passes, as {iterations}) and the model of its
    BSREM (get_converged_settings: settings that differ only in the algorithm,
    the relaxation, the preconditioner or its offset share it)."""
    return {
        "iterations": config["mlem"]["map_converged_passes"],
        "model": get_model(matrix, data, map_settings=get_converged_settings()),
    }


def get_converged_input(wildcards):
    """Named input converged of a MAP run of a simulated measurement (is_map_metrics)."""
    if not is_map_metrics(wildcards):
        return {}
    matrix, data = wildcards.matrix, wildcards.data
    return {
        "converged": get_path(
            "converged_image",
            matrix=matrix,
            data=data,
            **get_converged_wildcards(matrix, data),
        )
    }


def get_converged_params(wildcards):
    """Passes of compute_converged_map (as its path names them), its model
    (subsets, factors) and its MAP settings (BSREM, the configured prior)."""
    return {
        "passes": int(wildcards.iterations),
        **get_model_params(wildcards),
        **get_map_params(get_converged_settings()),
    }


def get_metrics_params(wildcards):
    """How often a MAP run of a simulated measurement measures its image
    (config mlem.map_metrics_every); {} for every other run."""
    if not is_map_metrics(wildcards):
        return {}
    return {"map_metrics_every": config["mlem"]["map_metrics_every"]}


# --------------------------------------------------------- the voxel grid


def get_matrix_geometry(wildcards):
    """Grid and voxel size convert_matrix records (matrices.<name>.grid,
    voxel_size; None where not given)."""
    entry = config["matrices"][wildcards.matrix]
    return {"grid": entry["grid"], "voxel_size": entry["voxel_size"]}


def matrix_grid(path):
    """The column count of a user's matrix file and the grid it records (None:
    none; a .mtx or .npz never has one), read once per file version."""
    from mlemlib.cluster import matrix_size
    from mlemlib.formats import geometry_value, open_matrix

    if file_kind(path) in ("mtx", "npz"):
        return {"cols": matrix_size(path, allow_negative=True).cols, "grid": None}
    with open_matrix(path, allow_negative=True) as src:
        grid = geometry_value(src, "grid")
        return {
            "cols": int(src.shape[1]),
            "grid": None if grid is None else [int(v) for v in grid],
        }


def check_map_files():
    """Stop, in one line, on a grid that does not fit its matrix, a voxel
    size without a grid, a grid given for a preset, a prior on a matrix
    without a grid, a missing kappa file (after validate_paths: the files
    are readable)."""
    from mlemlib.corrections import split_h5

    deep = not (workflow.remote_exec or workflow.subprocess_exec)
    for name, entry in config["matrices"].items():
        grid = entry["grid"]
        if entry["voxel_size"] is not None and grid is None:
            stop(
                f"config matrices.{name}.voxel_size: given without a grid; "
                f"set matrices.{name}.grid: [NX, NY, NZ] as well"
            )
        if grid is not None and entry["preset"]:
            stop(
                f"config matrices.{name}.grid: the preset {entry['preset']} has its own "
                "grid; grid is for your own matrix file (path) that records none"
            )
        if entry["preset"] or not deep or (grid is None and not is_map()):
            continue
        found = _read_checked(entry["path"], matrix_grid)
        if grid is not None:
            try:
                check_grid(grid, found["cols"], key=f"matrices.{name}.grid")
            except ConfigError as exc:
                stop(f"config {exc}")
            if found["grid"] is not None and found["grid"] != list(grid):
                stop(
                    f"config matrices.{name}.grid: {entry['path']} records grid "
                    f"{'x'.join(map(str, found['grid']))}, the config gives "
                    f"{'x'.join(map(str, grid))}"
                )
        elif found["grid"] is None:
            stop(
                f"config mlem.prior.type: {config['mlem']['prior']['type']} needs the voxel "
                f"grid of matrix {name}, and {entry['path']} records none; set "
                f"matrices.{name}.grid: [NX, NY, NZ]"
            )
    kappa = config["mlem"]["prior"]["kappa"]
    if is_map() and kappa and not os.path.isfile(split_h5(kappa)[0]):
        stop(f"config mlem.prior.kappa: {kappa}: no such file")
    if is_map() and kappa and deep:
        check_kappa_file(kappa)


def check_kappa_file(kappa):
    """Stop, in one line, on a kappa file that does not hold one finite,
    non-negative value per voxel of every matrix the prior acts on (read as
    the runs read it, kappa_ok; once per file version and voxel count)."""
    from mlemlib.corrections import split_h5
    from mlemlib.errors import InputError
    from mlemlib.scanner import get_preset

    for name, entry in config["matrices"].items():
        if entry["preset"]:
            voxels = int(get_preset(entry["preset"]).shape[1])
        else:
            voxels = int(_read_checked(entry["path"], matrix_grid)["cols"])
        try:
            _read_checked(split_h5(kappa)[0], kappa_ok, kappa, voxels)
        except InputError as exc:
            stop(f"config mlem.prior.kappa (matrix {name}): {exc}")


def kappa_ok(path, kappa, voxels):
    """True when mlemlib.prior.read_kappa reads `kappa` (the file `path`, or a
    dataset in it) as the weights of `voxels` voxels; raises InputError else."""
    from mlemlib.prior import read_kappa

    read_kappa(kappa, voxels)
    return True
