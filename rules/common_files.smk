"""The user's files: what each configured file must be, checked before any
job (validate_paths), and what identifies a file's version (stamps and
digests, params of the rules that read it, so that a replaced file reruns them).
"""

import hashlib
import json

from mlemlib.errors import InputError
from mlemlib.formats import file_kind

#: What a configured file must be, by role: its kinds (mlemlib.formats.file_kind)
#: and how a message names them.
FILE_ROLES = {
    "matrix": (
        ("csr4", "mtx", "npz", "h5"),
        "a system matrix: .csr4, .mtx, .mtx.gz, .npz or .h5",
    ),
    "measurement": (("lmsino",), "a measurement: .LMsino or .sino"),
}


#: How files of some kinds start (compared in lower case), and the kind's name.
MAGIC = {
    "mtx": ((b"%%matrixmarket", b"\x1f\x8b"), "Matrix Market"),  # or gzipped
    "npz": ((b"pk\x03\x04",), "SciPy .npz (zip)"),
    "h5": ((b"\x89hdf\r\n\x1a\n",), "HDF5"),
}


def _file_fault(path, role):
    """Why `path` is not a readable file of `role` (FILE_ROLES); None if it is one.

    Cheap enough for every dry run: the file's type, its first bytes and, for
    a .csr4, its header against its size (mlemlib.formats.csr4.read_header);
    convert_matrix and the reconstructions validate the whole file.
    """
    kinds, expected = FILE_ROLES[role]
    if not os.path.exists(path):
        return "no such file"
    if not os.path.isfile(path):
        return "not a file (a directory?)"
    try:
        kind = file_kind(path)
    except InputError:
        kind = None
    if kind not in kinds:
        return f"unsupported file type, expected {expected}"
    try:
        with open(path, "rb") as fh:
            head = fh.read(16)
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if not head:
        return "empty file"
    if kind == "csr4":
        from mlemlib.formats.csr4 import read_header

        try:
            read_header(path)
        except InputError as exc:
            return exc.fault
    elif kind == "lmsino" and os.path.getsize(path) % 4:
        return "size is not a multiple of 4 bytes (int32 counts)"
    elif kind in MAGIC and not head.lower().startswith(MAGIC[kind][0]):
        return f"not a {MAGIC[kind][1]} file (it starts with {head[:8]!r})"
    return None


#: Where validate_paths records the files whose contents it read and found
#: valid, by path, size and modification time, so that a file is read whole
#: once per version, not at every dry run.
CHECKED_FILES = ".snakemake/mlemlib/checked-files.json"


def _read_checked(path, check, *args):
    """check(path, *args) (a JSON value; raises InputError on a fault), once per
    version of path and value of args."""
    stat = os.stat(path)
    named = check.__name__ + (repr(args) if args else "")
    key = f"{named} {os.path.abspath(path)} {stat.st_size} {stat.st_mtime_ns}"
    try:
        with open(CHECKED_FILES, encoding="utf-8") as fh:
            checked = json.load(fh)
    except (OSError, ValueError):
        checked = {}
    if key in checked:
        return checked[key]
    value = checked[key] = check(path, *args)
    try:
        os.makedirs(os.path.dirname(CHECKED_FILES), exist_ok=True)
        with open(f"{CHECKED_FILES}.{os.getpid()}", "w", encoding="utf-8") as fh:
            json.dump(checked, fh)
        os.replace(f"{CHECKED_FILES}.{os.getpid()}", CHECKED_FILES)
    except OSError:
        pass  # a read-only working directory: check again next time
    return value


def matrix_rows(path):
    """Rows (LORs) of a user's matrix file, read and validated by mlemlib.formats
    (mlemlib.cluster.matrix_size: a .csr4's or .h5's header; a .mtx or .npz
    whole, with every index and value checked)."""
    from mlemlib.cluster import matrix_size

    return matrix_size(path).rows


def matrix_rows_negative_ok(path):
    """matrix_rows for a matrix converted with clip_negative: its negative values pass."""
    from mlemlib.cluster import matrix_size

    return matrix_size(path, allow_negative=True).rows


def measurement_ok(path):
    """True when mlemlib.formats.lmsino reads the measurement (counts >= 0); raises InputError else."""
    from mlemlib.formats.lmsino import read_lmsino

    read_lmsino(path)
    return True


def validate_paths():
    """Stop the workflow unless every configured file is a valid file of its kind.

    Checked on every run, dry runs included, so that a wrong path stops the
    workflow with one line naming the config key and the path, even where
    the results of an earlier path are on disk (Snakemake does not look at
    the inputs of outputs it considers up to date). Then the contents, as
    mlemlib.formats reads them (matrix_rows, measurement_ok; once per file
    version): a .mtx index out of range, an .npz that holds no sparse
    matrix, a negative count stop the dry run, not a job. A measurement must
    have one count per row of its matrix.
    """
    deep = not (workflow.remote_exec or workflow.subprocess_exec)
    rows_of = {}  # a user's matrix's rows where read
    for name, entry in config["matrices"].items():
        rows = None
        if entry["path"] is not None:
            path = entry["path"]
            fault = _file_fault(path, "matrix")
            if not fault and deep:
                try:
                    check = matrix_rows
                    if entry["clip_negative"]:
                        check = matrix_rows_negative_ok
                    rows = _read_checked(path, check)
                except InputError as exc:
                    fault = exc.fault
            if fault:
                stop(f"config matrices.{name}.path: {path}: {fault}")
            rows_of[name] = rows
        for data, value in entry["measurements"].items():
            files = measurement_files(value)
            path = files["counts"]
            for role in FACTOR_ROLES:
                fault = files[role] and _factor_fault(files[role], rows)
                if files[role] and not fault and deep:
                    fault = _factor_values_fault(files[role], rows, role)
                if fault:
                    stop(
                        f"config matrices.{name}.measurements.{data}.{role}: "
                        f"{files[role]}: {fault}"
                    )
            fault = _file_fault(path, "measurement")
            if not fault and rows is not None and os.path.getsize(path) != 4 * rows:
                fault = (
                    f"{os.path.getsize(path) // 4} counts, but the matrix "
                    f"{entry['path']} has {rows} rows (LORs)"
                )
            if not fault and deep:
                try:
                    _read_checked(path, measurement_ok)
                except InputError as exc:
                    fault = exc.fault
            if fault:
                stop(f"config matrices.{name}.measurements.{data}: {path}: {fault}")
    subset_file = config["mlem"]["subset_file"]
    fault = subset_file and _factor_fault(subset_file, None, "int32 subset label")
    if fault:
        stop(f"config mlem.subset_file: {subset_file}: {fault}")
    if subset_file and deep:
        check_subset_file(subset_file, rows_of)


def check_subset_file(path, rows_of):
    """Stop, in one line, on a subset file whose labels the runs would refuse
    (subset_labels_ok: one per LOR of every matrix, each in 0 .. S-1, no
    subset empty)."""
    from mlemlib.scanner import get_preset

    subsets = int(config["mlem"]["subsets"])
    for name, entry in config["matrices"].items():
        rows = rows_of.get(name)
        if entry["preset"]:
            rows = int(get_preset(entry["preset"]).shape[0])
        if rows is None:
            continue
        try:
            _read_checked(path, subset_labels_ok, rows, subsets)
        except InputError as exc:
            stop(f"config mlem.subset_file (matrix {name}): {path}: {exc.fault}")


def subset_labels_ok(path, rows, subsets):
    """True when mlemlib.subsets.read_subset_file reads `path` as the labels of
    `rows` LORs in `subsets` subsets; raises InputError else."""
    from mlemlib.subsets import read_subset_file

    read_subset_file(path, rows, subsets)
    return True


#: The measurement's factor files (mlemlib.corrections): multiplicative m, additive b.
FACTOR_ROLES = ("multiplicative", "additive")


def measurement_files(value):
    """A user's measurement entry (a path, or {counts, multiplicative, additive})
    as a dict of the three (None: not given)."""
    if isinstance(value, str):
        return {"counts": value, "multiplicative": None, "additive": None}
    return {"counts": value["counts"], **{r: value.get(r) for r in FACTOR_ROLES}}


def _factor_fault(spec, rows, what="float32 value"):
    """Why `spec` (a raw file of one `what` per LOR, or FILE.h5:/dataset) is not
    usable; None if it may be (the run reads and checks every value)."""
    from mlemlib.corrections import split_h5

    path, dataset = split_h5(spec)
    if not os.path.isfile(path):
        return "no such file"
    if dataset is not None or path.lower().endswith((".h5", ".hdf5")):
        return None
    size = os.path.getsize(path)
    if size % 4:
        return f"size {size} is not a multiple of 4 bytes (one {what} per LOR)"
    if rows is not None and size != 4 * rows:
        return f"{size // 4} values, but the matrix has {rows} rows (LORs)"
    return None


def _factor_values_fault(spec, rows, kind):
    """Why the values of a factor file are not usable, read as the runs read
    them (factor_values_ok); None if they are. Once per file version."""
    from mlemlib.corrections import split_h5

    try:
        _read_checked(split_h5(spec)[0], factor_values_ok, spec, rows, kind)
    except InputError as exc:
        return exc.fault
    return None


def factor_values_ok(path, spec, rows, kind):
    """True when mlemlib.corrections reads the factors `spec` (the file `path`,
    or a dataset in it) as the runs do: one per LOR (`rows`; None: not known
    yet), finite, non-negative, not every multiplicative factor 0; raises
    InputError else."""
    from mlemlib.corrections import KINDS, check_factors, read_float32_file

    values = read_float32_file(spec, KINDS[kind], "LOR")
    check_factors(values, values.size if rows is None else rows, kind, spec)
    return True


def _file_stamp(path):
    """What identifies the contents of a user's file: its path, size and mtime."""
    stat = os.stat(path)
    return {"path": path, "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def file_digest(path):
    """blake2b-128 of a file's bytes (hex), read in 16 MiB blocks."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()
