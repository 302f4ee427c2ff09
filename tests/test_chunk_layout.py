"""The chunked layout as a file (mlemlib.chunked.write_layout / open_layout, mlem chunk) and its loading on GPUs."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import scipy.sparse as sp

from mlemlib import chunked
from mlemlib.errors import MatrixFormatError
from mlemlib.matrix import CSRMatrix

FORMATS = ("csr", "compressed", "compressed-f16", "compressed-u16")


def _band(m=900, n=4000, seed=0, top=250) -> CSRMatrix:
    """Rows of 0..top non-zeros from a moving band (neighbouring rows share voxels), some empty."""
    rng = np.random.default_rng(seed)
    rows, cols = [], []
    for i in range(m):
        k = int(rng.integers(0, top + 1)) if i % 5 else int(rng.choice([0, 1, 128, 129]))
        width = max(2 * top, 400)
        c0 = int(i * (n - width) / m)
        rows += [i] * k
        cols += list(c0 + rng.choice(width, size=k, replace=False))
    a = sp.csr_matrix((rng.uniform(0.1, 1.0, len(rows)), (rows, cols)), shape=(m, n)).astype(np.float32)
    a.sort_indices()
    return CSRMatrix.from_scipy(a)


def _source(tmp_path, fmt: str, seed: int = 3):
    """A matrix container of ``fmt`` and the CSR matrix it decodes to."""
    from mlemlib.compressed import CompressedMatrix
    from mlemlib.formats.compressed_h5 import write_compressed_h5
    from mlemlib.formats.h5 import write_matrix_h5

    a = _band(seed=seed)
    path = tmp_path / f"{fmt}.h5"
    if fmt == "csr":
        write_matrix_h5(path, a)
        return path, a
    cm = CompressedMatrix.from_csr(a, fmt)
    write_compressed_h5(path, cm)
    return path, cm.to_csr()


def _expected(decoded: CSRMatrix, fmt: str, window: int, bounds, given_scale=None) -> dict:
    """The layout's arrays as build_plan, half_rows and interleave give them block by block (the source's
    blocks ``bounds``: a compressed container's are of about so many slots)."""
    from mlemlib.compressed import values16
    from mlemlib.matrix import slice_rows

    out = {k: [] for k in ("indptr", "local", "data", "scale", "chunk_rows", "counts", "voxels", "nnz")}
    k = 0
    for r0, r1 in bounds:
        block = slice_rows(decoded, r0, r1)
        p = chunked.build_plan(block, window=window)
        values = block.data
        if values16(fmt):
            rs, values = chunked.half_rows(block, fmt, scale=None if given_scale is None else given_scale[r0:r1])
            out["scale"].append(rs)
        pip, ploc, pdat = chunked.interleave(block.indptr, p.local, values)
        out["indptr"].append(pip[1:] + k)
        out["local"].append(ploc)
        out["data"].append(pdat)
        out["chunk_rows"].append(p.chunk_rows[1:] + r0)
        out["counts"].append(np.diff(p.vptr))
        out["voxels"].append(p.voxels)
        bip = np.asarray(block.indptr, dtype=np.int64)
        out["nnz"].append(np.diff(bip[p.chunk_rows]))
        k += len(ploc)
    cat = {key: np.concatenate(v) if v else np.empty(0) for key, v in out.items()}
    cat["indptr"] = np.concatenate([[0], cat["indptr"]])
    cat["chunk_rows"] = np.concatenate([[0], cat["chunk_rows"]])
    cat["vptr"] = np.concatenate([[0], np.cumsum(cat.pop("counts"))])
    cat["nnzptr"] = np.concatenate([[0], np.cumsum(cat.pop("nnz"))])
    return cat


@pytest.mark.parametrize("fmt", FORMATS)
def test_layout_file_round_trips_the_block_by_block_plan(tmp_path, fmt):
    from mlemlib.formats import open_matrix

    path, decoded = _source(tmp_path, fmt)
    with open_matrix(path) as src:
        given = np.asarray(src.read_scale(0, decoded.shape[0])) if fmt == "compressed-u16" else None
        lay = chunked.write_layout(src, tmp_path / "chunks.h5", window=512, max_nnz=9_000)
        bounds = src.chunk_bounds(9_000)
    want = _expected(decoded, fmt, 512, bounds, given)
    with lay, h5py.File(tmp_path / "chunks.h5") as f:
        assert lay.shape == decoded.shape and lay.nnz == decoded.nnz and lay.window == 512 and lay.format == fmt
        assert lay.chunks > 2 * len(bounds) > 20 and lay.half == (fmt in ("compressed-f16", "compressed-u16"))
        names = ["indptr", "local", "data", "chunk_rows", "vptr", "voxels", "nnzptr"] + (["scale"] if lay.half else [])
        for name in names:
            got = lay.read(name)
            assert got.dtype == want[name].dtype or name == "data", name
            np.testing.assert_array_equal(got, want[name], err_msg=name)
        assert f["data"].dtype == {"csr": np.float32, "compressed": np.float32, "compressed-f16": np.float16,
                                   "compressed-u16": np.uint16}[fmt]
        assert f.attrs["format"] == "mlem-chunks" and f.attrs["source_format"] == fmt
        # the stored elements give the matrix back: values (times the row scales) and columns
        ip = np.asarray(decoded.indptr, dtype=np.int64)
        pos = chunked.stored_positions(ip)
        vals = lay.read("data")[pos].astype(np.float32)
        if lay.half:
            vals = vals * np.repeat(lay.read("scale"), np.diff(ip))
        np.testing.assert_array_equal(vals, decoded.data)
        per_nnz = np.repeat(np.arange(lay.chunks), np.diff(ip[lay.chunk_rows]))
        cols = lay.read("voxels")[lay.vptr[per_nnz] + lay.read("local")[pos].astype(np.int64)]
        np.testing.assert_array_equal(cols, decoded.indices)
        assert lay.reuse == pytest.approx(decoded.nnz / len(lay.read("voxels")))


def test_layout_of_a_matrix_in_memory_and_the_cli(tmp_path, capsys):
    from mlemlib.cli import main
    from mlemlib.formats.h5 import write_matrix_h5

    a = _band(seed=8)
    with chunked.write_layout(a, tmp_path / "mem.h5", window=512, max_nnz=20_000) as mem:
        assert mem.chunks > 1
        mem.check_source(a)
    write_matrix_h5(tmp_path / "a.h5", a)
    assert main(["chunk", str(tmp_path / "a.h5"), "--out", str(tmp_path / "cli.h5"), "--window", "512",
                 "--chunk-nnz", "20000"]) == 0
    line = capsys.readouterr().out
    assert "cli.h5" in line and "chunks of <= 512 voxels" in line and "csr" in line
    with chunked.open_layout(tmp_path / "cli.h5") as cli, chunked.open_layout(tmp_path / "mem.h5") as mem:
        for name in ("indptr", "local", "data", "chunk_rows", "vptr", "voxels", "nnzptr"):
            np.testing.assert_array_equal(cli.read(name), mem.read(name))


def test_a_stale_corrupt_or_truncated_layout_is_refused_in_one_line_naming_the_file(tmp_path):
    from mlemlib.cli import main
    from mlemlib.formats import open_matrix
    from mlemlib.formats.h5 import write_matrix_h5

    a = _band(seed=4)
    write_matrix_h5(tmp_path / "a.h5", a)
    lay = tmp_path / "chunks.h5"
    chunked.write_layout(tmp_path / "a.h5", lay, window=1024, max_nnz=9_000).close()
    with open_matrix(tmp_path / "a.h5") as src:
        chunked.open_layout(lay, source=src).close()  # made from it: accepted

    def refused(path, source=None, match="make it again with mlem chunk"):
        with pytest.raises(MatrixFormatError, match=match) as err:
            if source is None:
                chunked.open_layout(path).close()
            else:
                with open_matrix(source) as src:
                    chunked.open_layout(path, source=src).close()
        text = str(err.value)
        assert text.startswith(str(path)) and "\n" not in text
        return text

    # stale: another matrix of the same shape and non-zeros (one value changed), and another shape
    b = CSRMatrix(a.indptr.copy(), a.indices.copy(), a.data.copy(), a.shape)
    b.data[5] *= 2
    write_matrix_h5(tmp_path / "b.h5", b)
    assert "stale" in refused(lay, tmp_path / "b.h5", match="chunks of another matrix")
    write_matrix_h5(tmp_path / "c.h5", _band(m=800, seed=4))
    refused(lay, tmp_path / "c.h5", match="not of this 800 x 4000 one")
    # a CSR layout is not a compressed matrix's (same decoded values, same checksum)
    from mlemlib.compressed import CompressedMatrix
    from mlemlib.formats.compressed_h5 import write_compressed_h5

    write_compressed_h5(tmp_path / "z.h5", CompressedMatrix.from_csr(a, "compressed"))
    refused(lay, tmp_path / "z.h5", match="another matrix")
    # truncated
    raw = lay.read_bytes()
    (tmp_path / "cut.h5").write_bytes(raw[: len(raw) // 2])
    refused(tmp_path / "cut.h5")
    # not a layout (a matrix container) and an empty file
    refused(tmp_path / "a.h5", match="format 'mlem-csr'")
    (tmp_path / "empty.h5").write_bytes(b"")
    refused(tmp_path / "empty.h5", match="not a readable HDF5 file")
    # corrupt: the chunk arrays' bytes damaged, an attribute gone, a dataset cut short
    bad = tmp_path / "bad.h5"
    bad.write_bytes(raw)
    with h5py.File(bad, "r") as f:
        offset = f["vptr"].id.get_chunk_info(0).byte_offset
    flipped = bytearray(raw)
    flipped[offset + 9 : offset + 16] = bytes(b ^ 0x5A for b in flipped[offset + 9 : offset + 16])
    bad.write_bytes(bytes(flipped))
    refused(bad, match="inconsistent|out of range|has .* entries")
    bad.write_bytes(raw)
    with h5py.File(bad, "a") as f:
        del f.attrs["window"]
    refused(bad, match="attribute 'window' missing")
    short = tmp_path / "short.h5"
    short.write_bytes(raw)
    with h5py.File(short, "a") as f:
        f["voxels"].resize((f["voxels"].shape[0] - 1,))
    refused(short, match="'voxels' has")
    # the command line: exit status 2 and the one line
    assert main(["chunk", str(tmp_path / "cut.h5"), "--out", str(tmp_path / "x.h5")]) == 2


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 7, 500])
def test_chunk_ranges_are_nnz_balanced_and_cover_every_chunk_once(tmp_path, parts):
    a = _band(m=2000, seed=6)
    with chunked.write_layout(a, tmp_path / "c.h5", window=1024, max_nnz=30_000) as lay:
        ranges = lay.ranges(parts)
        nnzptr = lay.nnzptr
    assert len(ranges) == parts
    assert ranges[0][0] == 0 and ranges[-1][1] == len(nnzptr) - 1
    assert all(c0 <= c1 for c0, c1 in ranges) and all(ranges[i][1] == ranges[i + 1][0] for i in range(parts - 1))
    covered = np.concatenate([np.arange(c0, c1) for c0, c1 in ranges])
    np.testing.assert_array_equal(covered, np.arange(len(nnzptr) - 1))  # every chunk once, in order
    per = np.array([nnzptr[c1] - nnzptr[c0] for c0, c1 in ranges])
    biggest = int(np.diff(nnzptr).max())
    # each part within one chunk of its share
    assert (np.abs(per - a.nnz / parts) <= biggest).all()
    assert per.sum() == a.nnz


def test_a_layout_caps_the_non_zeros_of_its_chunks_and_records_the_cap(tmp_path):
    import h5py

    a = _band(m=2000, seed=6)
    with chunked.write_layout(a, tmp_path / "d.h5", window=1024, max_nnz=30_000) as lay:
        default = np.diff(lay.nnzptr)
    assert default.max() > 1500
    with chunked.write_layout(a, tmp_path / "c.h5", window=1024, max_nnz=30_000, chunk_cap=1500) as lay:
        assert np.diff(lay.nnzptr).max() <= 1500 and lay.chunks > len(default)
        assert lay.nnzptr[-1] == a.nnz
    with h5py.File(tmp_path / "c.h5") as f, h5py.File(tmp_path / "d.h5") as g:
        assert f.attrs["chunk_cap"] == 1500 and g.attrs["chunk_cap"] == chunked.MAX_CHUNK_NNZ
    with pytest.raises(ValueError, match="chunk_cap must be at least 1"):
        chunked.write_layout(a, tmp_path / "e.h5", window=1024, chunk_cap=0)
    assert not (tmp_path / "e.h5").exists()


# --------------------------------------------------------------------------- loading on a GPU
from test_chunked import UPLOAD_ON, _host_cupy  # noqa: E402  (the host stand-in for CuPy)
ARRAYS = ("indptr", "local", "data", "chunk_rows", "vptr", "voxels")


def _same(d, e) -> None:
    for name in ARRAYS + (("scale",) if d.half else ()):
        x, y = getattr(d, name).get(), getattr(e, name).get()
        assert x.dtype == y.dtype, name
        np.testing.assert_array_equal(x, y, err_msg=name)
    assert (d.shape, d.window, d.nnz, d.format, d.kernel) == (e.shape, e.window, e.nnz, e.format, e.kernel)


@pytest.mark.parametrize("where", UPLOAD_ON)
@pytest.mark.parametrize("fmt", FORMATS)
def test_from_layout_equals_upload_bit_for_bit(tmp_path, monkeypatch, where, fmt):
    """The whole layout loads as upload builds it; a chunk range as the same arrays' rows, rebased."""
    from mlemlib.backends import _compressed_cuda as gpu
    from mlemlib.formats import open_matrix

    if where == "host":
        monkeypatch.setattr(gpu, "cupy", _host_cupy)
        monkeypatch.setattr(gpu, "chunk_window", lambda device_id=None: chunked.DEFAULT_WINDOW)
    path, _ = _source(tmp_path, fmt)
    with open_matrix(path) as src:
        whole = gpu.DeviceChunked.upload(src, window=1024, max_nnz=9_000)
        lay = chunked.write_layout(src, tmp_path / "chunks.h5", window=1024, max_nnz=9_000)
    with lay:
        _same(gpu.DeviceChunked.from_layout(lay, max_nnz=5_000), whole)
        _same(gpu.DeviceChunked.from_layout(tmp_path / "chunks.h5"), whole)
        ip, cr, vp = whole.indptr.get(), whole.chunk_rows.get(), whole.vptr.get()
        for c0, c1 in lay.ranges(3) + [(0, 0), (lay.chunks - 1, lay.chunks)]:
            part = gpu.DeviceChunked.from_layout(lay, (c0, c1), max_nnz=7_000)
            r0, r1 = int(cr[c0]), int(cr[c1])
            e0, e1 = int(ip[r0]), int(ip[r1])
            np.testing.assert_array_equal(part.indptr.get(), ip[r0 : r1 + 1] - e0)
            np.testing.assert_array_equal(part.local.get(), whole.local.get()[e0:e1])
            np.testing.assert_array_equal(part.data.get(), whole.data.get()[e0:e1])
            np.testing.assert_array_equal(part.chunk_rows.get(), cr[c0 : c1 + 1] - r0)
            np.testing.assert_array_equal(part.vptr.get(), vp[c0 : c1 + 1] - vp[c0])
            np.testing.assert_array_equal(part.voxels.get(), whole.voxels.get()[vp[c0] : vp[c1]])
            if part.half:
                np.testing.assert_array_equal(part.scale.get(), whole.scale.get()[r0:r1])
            assert part.shape == (r1 - r0, whole.shape[1]) and part.nbytes == lay.device_bytes((c0, c1))
            assert part.nnz == int(lay.nnzptr[c1] - lay.nnzptr[c0])


def test_from_layout_refuses_a_window_larger_than_the_device_holds(tmp_path, monkeypatch):
    from mlemlib.backends import _compressed_cuda as gpu
    from mlemlib.errors import ConfigError

    monkeypatch.setattr(gpu, "cupy", _host_cupy)
    monkeypatch.setattr(gpu, "chunk_window", lambda device_id=None: 512)
    refusal = r"c\.h5: chunks of 1024 voxels, more than .* \(512\): make it with mlem chunk --window 512"
    with chunked.write_layout(_band(seed=2), tmp_path / "c.h5", window=1024) as lay, \
            pytest.raises(ConfigError, match=refusal):
        gpu.DeviceChunked.from_layout(lay)


def _problem(seed=9):
    a = _band(m=3000, n=4000, seed=seed, top=200)
    rng = np.random.default_rng(4)
    g = rng.poisson(a.to_scipy() @ rng.uniform(0.5, 2.0, a.shape[1])).astype(np.float32)
    norm = np.asarray(a.to_scipy().sum(axis=0)).ravel()
    return a, g, norm


def _image(be):
    """The image after 10 iterations (test_dist's helper)."""
    from test_dist import _image as iterate

    return iterate(be, iters=10)


@pytest.mark.gpu
@pytest.mark.parametrize("bp", ["onepass_chunked", "auto"])
def test_cuda_backend_with_a_layout_gives_the_image_without_it(tmp_path, bp):
    from mlemlib.backends import make_backend
    from mlemlib.formats import open_matrix
    from mlemlib.formats.h5 import write_matrix_h5

    a, g, norm = _problem()
    write_matrix_h5(tmp_path / "a.h5", a)
    chunked.write_layout(tmp_path / "a.h5", tmp_path / "chunks.h5").close()
    with open_matrix(tmp_path / "a.h5") as src:
        plain = make_backend("cuda", src, g, norm, bp=bp)
        with_file = make_backend("cuda", src, g, norm, bp=bp, chunks=tmp_path / "chunks.h5")
        d = with_file.describe()
        assert d["bp"] == plain.describe()["bp"]
        if d["bp"] == "onepass_chunked":
            assert d["chunks"]["file"] == str(tmp_path / "chunks.h5")
        np.testing.assert_array_equal(_image(with_file), _image(plain))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_nccl_backend_with_a_layout_gives_the_one_gpu_image(tmp_path, fmt):
    """The layout's chunk ranges on 1..N GPUs: the one-GPU image bit for bit (rows' sums and terms do not
    depend on their chunk)."""
    import cupy as cp

    from mlemlib.backends.cuda import CudaBackend
    from mlemlib.backends.nccl import NcclBackend
    from mlemlib.formats import open_matrix

    path, _ = _source(tmp_path, fmt, seed=12)
    _, g, norm = _problem()
    with open_matrix(path) as src:
        m, n = src.shape
        a = src.read_rows(0, m)
        g = np.random.default_rng(2).poisson(a.to_scipy() @ np.ones(n)).astype(np.float32)
        norm = np.asarray(a.to_scipy().sum(axis=0)).ravel()
        chunked.write_layout(src, tmp_path / "chunks.h5").close()
        one = _image(CudaBackend(src, g, norm, bp="onepass_chunked"))
        for p in range(1, min(cp.cuda.runtime.getDeviceCount(), 4) + 1):
            with NcclBackend(src, g, norm, gpus=p, layout="local", bp="onepass_chunked",
                             chunks=tmp_path / "chunks.h5") as be:
                assert be.describe()["chunks"]["file"] == str(tmp_path / "chunks.h5")
                np.testing.assert_array_equal(_image(be), one)


def test_cli_reconstruct_takes_chunks_and_the_cpu_backend_leaves_them(tmp_path, capsys):
    """--chunks reaches make_backend; the cpu backend chunks on its own (the image does not change)."""
    from mlemlib.cli import main
    from mlemlib.formats.h5 import write_matrix_h5
    from mlemlib.formats.lmsino import write_lmsino
    from mlemlib.image import read_image

    a = _band(m=400, n=1500, seed=3, top=60)
    g = np.random.default_rng(1).poisson(a.to_scipy() @ np.ones(a.shape[1])).astype(np.int32)
    write_matrix_h5(tmp_path / "a.h5", a)
    write_lmsino(tmp_path / "g.LMsino", g)
    assert main(["chunk", str(tmp_path / "a.h5"), "-o", str(tmp_path / "chunks.h5"), "-w", "512"]) == 0
    images = []
    for extra in ([], ["--chunks", str(tmp_path / "chunks.h5")]):
        out = tmp_path / f"run{len(extra)}" / "image.h5"
        assert main(["reconstruct", "-m", str(tmp_path / "a.h5"), "-s", str(tmp_path / "g.LMsino"), "-n", "3",
                     "-b", "cpu", "--bp", "onepass_chunked", "-k", "0", "-o", str(out), *extra]) == 0
        images.append(read_image(out)[0])
    np.testing.assert_array_equal(images[0], images[1])


def test_workflow_chunks_a_matrix_once_for_the_runs_that_read_chunks(tmp_path):
    """chunk_matrix is in the DAG where a cuda run reads chunks (onepass_chunked, or auto on a reordered
    matrix; one GPU or the local layout), once per matrix, and those runs (only) take chunks.h5."""
    pytest.importorskip("snakemake")
    from test_workflow import changed, dry_run, snakemake

    runs = [
        {"backend": "cuda", "fp": "auto", "bp": "auto", "gpus": [1, 2], "layout": ["local", "thesis"]},
        {"backend": "cuda", "bp": "onepass_chunked"},
        {"backend": "cuda", "fp": "csr_vector", "bp": "csr_vector"},
        {"backend": "cpu", "bp": "onepass_chunked"},
    ]
    config = changed(use_gpu=True, runs=runs)
    gpus = ("--resources", "gpu=2")  # use_gpu: true plans GPU jobs where GPUs are given
    assert dry_run(tmp_path, config, *gpus)["chunk_matrix"] == 1
    plan = snakemake(tmp_path, "--dry-run", *gpus, config=config).stdout
    reading = set()
    for rule in plan.split("rule run_mlem:")[1:]:
        rule = rule.split("\n\n", 1)[0]
        if "chunks.h5" in rule.split("output:", 1)[0]:
            reading.add(rule.split("output: ", 1)[1].split("/image.h5", 1)[0].split("/runs/", 1)[1])
    key = "it{iterations}-rep{repetitions}-ck{checkpoint_every}".format(**config["mlem"])
    assert reading == {f"nema-seed1/cuda-auto-auto-{key}/gpus-1-local", f"nema-seed1/cuda-auto-auto-{key}/gpus-2-local",
                       f"nema-seed1/cuda-auto-onepass_chunked-{key}/gpus-1-local"}, reading
    # not reordered: auto keeps its sample (no chunks to reuse voxels), only onepass_chunked reads the file
    jobs = dry_run(tmp_path, dict(config, reorder="none", runs=runs[:1] + runs[2:]), *gpus)
    assert "chunk_matrix" not in jobs
