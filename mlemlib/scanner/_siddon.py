"""Numba kernels of the exact ray tracer (Siddon's method, incremental form; CPU only).

A ray ``P0 -> P1`` is clipped to the voxel box (slab method), then walked
voxel by voxel: at each step the nearest of the next ``x``, ``y`` and ``z``
voxel planes ends the current segment, whose length goes to the current
voxel. Plane crossings are computed from the plane's own coordinate (not by
accumulating increments), so the segment lengths of a ray telescope to its
chord length through the box up to rounding. Segments of at most
:data:`TOL_MM` are dropped, so a ray through a voxel edge or corner (two
crossings at the same point, up to rounding) leaves no slivers.

A tube of response is the set of rays between the ``k x k`` points of two
crystal faces (all ``k**4`` pairs). Its row holds, per voxel, the sum of the
rays' segment lengths divided by the number of rays. Voxels hit by several rays
are merged in a per-thread dense accumulator of the voxel count, zero outside the
row being traced: a voxel is new to the row where its sum is still 0 (every
kept segment is longer than :data:`TOL_MM`), and the row's voxels are set
back to 0 once the row is written (:func:`_emit_row`, :func:`_clear`). The
columns of a row are then sorted in place (radix sort).

The generator traces each row once: :func:`fill_rows_arena` appends each
row to its thread's arena (lengths not known in advance) and
:func:`gather_rows` copies the arenas into a CSR block; :func:`rows_hit_box`
(clipping only, no voxel walk) finds the tubes that cross the grid, the
stored rows of a folded matrix. :func:`count_rows` (distinct voxels per row)
and :func:`fill_rows` (columns and values into pre-sized arrays) trace rows
for the sampled estimate and for :func:`mlemlib.scanner.trace_rows`. Every
kernel is parallel over threads with batches of :data:`ROW_BATCH` consecutive
rows interleaved (thread ``t`` takes batches ``t, t + T, ...`` of the list).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

#: Segments of at most this length (mm) are dropped.
TOL_MM = 1e-9
#: Bits per pass of the radix sort of a row's columns.
RADIX_BITS = 10
#: Consecutive rows a thread traces in a row (batch ``b`` of the list goes to thread ``b % T``): neighbouring
#: tubes share voxels, whose sums are then still in the thread's cache.
ROW_BATCH = 8


@njit(cache=True, nogil=True)
def _clip(p0x, p0y, p0z, p1x, p1y, p1z, lo, vs, g):
    """Clip ray ``p0 -> p1`` to the voxel box (slab method): ``(hit, t0, t1, length)``.

    ``hit`` is False when the ray misses the box or crosses it over at most
    :data:`TOL_MM` (it then leaves no segment); :func:`_trace_ray` walks the
    voxels of ``[t0, t1]`` when it is True. :func:`tube_hits_box` asks only this.
    """
    dx = p1x - p0x
    dy = p1y - p0y
    dz = p1z - p0z
    length = math.sqrt(dx * dx + dy * dy + dz * dz)
    if length == 0.0:
        return False, 0.0, 0.0, length
    lox = lo[0]
    loy = lo[1]
    loz = lo[2]
    hix = lox + g[0] * vs[0]
    hiy = loy + g[1] * vs[1]
    hiz = loz + g[2] * vs[2]
    t0 = 0.0
    t1 = 1.0
    # slab clipping, half-open [lo, hi) for an axis the ray is parallel to
    if dx != 0.0:
        ta = (lox - p0x) / dx
        tb = (hix - p0x) / dx
        if ta > tb:
            ta, tb = tb, ta
        t0 = max(t0, ta)
        t1 = min(t1, tb)
    elif p0x < lox or p0x >= hix:
        return False, t0, t1, length
    if dy != 0.0:
        ta = (loy - p0y) / dy
        tb = (hiy - p0y) / dy
        if ta > tb:
            ta, tb = tb, ta
        t0 = max(t0, ta)
        t1 = min(t1, tb)
    elif p0y < loy or p0y >= hiy:
        return False, t0, t1, length
    if dz != 0.0:
        ta = (loz - p0z) / dz
        tb = (hiz - p0z) / dz
        if ta > tb:
            ta, tb = tb, ta
        t0 = max(t0, ta)
        t1 = min(t1, tb)
    elif p0z < loz or p0z >= hiz:
        return False, t0, t1, length
    tol_t = TOL_MM / length
    return t1 - t0 > tol_t, t0, t1, length


@njit(cache=True, nogil=True)
def _trace_ray(p0x, p0y, p0z, p1x, p1y, p1z, lo, vs, g, acc, touched, cnt):
    """Add the segments of ray ``p0 -> p1`` to ``acc``; return the new count of touched voxels.

    A voxel whose sum was 0 is new: it is appended to ``touched`` (which has
    room for one more entry than the row can have: the append is written
    unconditionally and kept only for a new voxel, without a branch).
    """
    hit, t0, t1, length = _clip(p0x, p0y, p0z, p1x, p1y, p1z, lo, vs, g)
    if not hit:
        return cnt
    dx = p1x - p0x
    dy = p1y - p0y
    dz = p1z - p0z
    lox = lo[0]
    loy = lo[1]
    loz = lo[2]
    wx = vs[0]
    wy = vs[1]
    wz = vs[2]
    gx = g[0]
    gy = g[1]
    gz = g[2]
    # first voxel: the one holding the entry point, clamped into the grid
    ix = math.floor((p0x + t0 * dx - lox) / wx)
    iy = math.floor((p0y + t0 * dy - loy) / wy)
    iz = math.floor((p0z + t0 * dz - loz) / wz)
    ix = min(max(ix, 0), gx - 1)
    iy = min(max(iy, 0), gy - 1)
    iz = min(max(iz, 0), gz - 1)
    inf = np.inf
    # next plane crossings; sx = +1/-1/0
    if dx > 0.0:
        sx = 1
        ox = 1
        nx = (lox + (ix + 1) * wx - p0x) / dx
    elif dx < 0.0:
        sx = -1
        ox = 0
        nx = (lox + ix * wx - p0x) / dx
    else:
        sx = 0
        ox = 0
        nx = inf
    if dy > 0.0:
        sy = 1
        oy = 1
        ny = (loy + (iy + 1) * wy - p0y) / dy
    elif dy < 0.0:
        sy = -1
        oy = 0
        ny = (loy + iy * wy - p0y) / dy
    else:
        sy = 0
        oy = 0
        ny = inf
    if dz > 0.0:
        sz = 1
        oz = 1
        nz = (loz + (iz + 1) * wz - p0z) / dz
    elif dz < 0.0:
        sz = -1
        oz = 0
        nz = (loz + iz * wz - p0z) / dz
    else:
        sz = 0
        oz = 0
        nz = inf
    # the voxel number, kept with the indices: v = ix + gx * (iy + gy * iz)
    v = ix + gx * (iy + gy * iz)
    vy = sy * gx
    vz = sz * gx * gy
    t = t0
    while True:
        tn = min(nx, ny, nz)
        end = min(tn, t1)
        seg = (end - t) * length
        if seg > TOL_MM:
            uv = np.uint64(v)  # unsigned: no negative-index wraparound test
            old = acc[uv]
            acc[uv] = old + seg
            touched[np.uint64(cnt)] = v
            cnt += old == 0.0
        if tn >= t1:
            break
        t = tn
        if nx <= tn:
            ix += sx
            if ix < 0 or ix >= gx:
                break
            v += sx
            nx = (lox + (ix + ox) * wx - p0x) / dx
        if ny <= tn:
            iy += sy
            if iy < 0 or iy >= gy:
                break
            v += vy
            ny = (loy + (iy + oy) * wy - p0y) / dy
        if nz <= tn:
            iz += sz
            if iz < 0 or iz >= gz:
                break
            v += vz
            nz = (loz + (iz + oz) * wz - p0z) / dz
    return cnt


@njit(cache=True, nogil=True)
def _trace_tube(pts, i, j, lo, vs, g, acc, touched):
    """Trace all ray pairs between the faces of crystals ``i`` and ``j``; return distinct voxels.

    The pair is traced in the canonical orientation ``min(i, j) -> max(i, j)``
    so that rows ``(i, j)`` and ``(j, i)`` are bit-identical. The voxels are
    ``touched[:cnt]`` with their sums in ``acc``; the caller clears them.
    """
    if i > j:
        i, j = j, i
    npts = pts.shape[1]
    cnt = 0
    for a in range(npts):
        ax = pts[i, a, 0]
        ay = pts[i, a, 1]
        az = pts[i, a, 2]
        for b in range(npts):
            cnt = _trace_ray(ax, ay, az, pts[j, b, 0], pts[j, b, 1], pts[j, b, 2], lo, vs, g, acc, touched, cnt)
    return cnt


@njit(cache=True, nogil=True)
def _clear(acc, tch, cnt):
    """Set the sums of a traced row's voxels ``tch[:cnt]`` back to 0 (the next row starts from zeros)."""
    for p in range(cnt):
        acc[tch[p]] = 0.0


@njit(cache=True, nogil=True)
def _sort_columns(a, cnt, tmp, hist):
    """Sort ``a[:cnt]`` (distinct non-negative int32) ascending, using ``tmp`` and ``hist`` as scratch.

    Short lists: insertion sort. Longer ones: least-significant-digit radix
    sort, :data:`RADIX_BITS` bits per pass (two passes for up to 2**20 voxels),
    several times faster than a comparison sort on a row's ~10**3 columns.
    """
    if cnt <= 48:
        for q in range(1, cnt):
            v = a[q]
            p = q - 1
            while p >= 0 and a[p] > v:
                a[p + 1] = a[p]
                p -= 1
            a[p + 1] = v
        return
    maxv = 0
    for q in range(cnt):
        maxv = max(maxv, a[q])
    nb = 1 << RADIX_BITS
    mask = nb - 1
    src = a
    dst = tmp
    shift = 0
    flipped = False
    while shift == 0 or (maxv >> shift) > 0:
        for d in range(nb + 1):
            hist[d] = 0
        for q in range(cnt):
            hist[((src[q] >> shift) & mask) + 1] += 1
        for d in range(nb):
            hist[d + 1] += hist[d]
        for q in range(cnt):
            d = (src[q] >> shift) & mask
            dst[hist[d]] = src[q]
            hist[d] += 1
        src, dst = dst, src
        flipped = not flipped
        shift += RADIX_BITS
    if flipped:
        for q in range(cnt):
            a[q] = tmp[q]


@njit(cache=True, nogil=True)
def _emit_row(tch, cnt, sort_tmp, hist, acc, inv_rays, indices, data, s, lab, unlab):
    """Sort a traced row's ``cnt`` voxels ``tch``, write them with their values from ``s`` on, clear ``acc``.

    ``lab``/``unlab`` (int32, or empty for the grid's own raster order): the
    columns are written as the voxels' labels ``lab[v]`` in another order
    (``unlab`` its inverse), sorted by label; ``acc`` stays indexed by voxel.
    """
    relabel = lab.shape[0] > 0
    if relabel:
        for p in range(cnt):
            tch[p] = lab[tch[p]]
    _sort_columns(tch, cnt, sort_tmp, hist)
    for p in range(cnt):
        u = tch[p]
        v = unlab[u] if relabel else u
        indices[s + p] = u
        data[s + p] = np.float32(acc[v] * inv_rays)
        acc[v] = 0.0


@njit(cache=True, nogil=True)
def tube_hits_box(pts, i, j, lo, vs, g):
    """Whether some ray between the faces of crystals ``i`` and ``j`` crosses the voxel box.

    The same clipping, in the same orientation, as :func:`_trace_tube`:
    a tube that misses traces to an empty row. (A tube whose rays all cross
    the box over only sub-:data:`TOL_MM` segments would be called a hit and
    trace empty; no preset has one.)
    """
    if i > j:
        i, j = j, i
    npts = pts.shape[1]
    for a in range(npts):
        for b in range(npts):
            hit, _, _, _ = _clip(pts[i, a, 0], pts[i, a, 1], pts[i, a, 2], pts[j, b, 0], pts[j, b, 1], pts[j, b, 2],
                                 lo, vs, g)  # fmt: skip
            if hit:
                return True
    return False


@njit(cache=True, nogil=True)
def _batches(nrows):
    """Batches of :data:`ROW_BATCH` consecutive rows in a list of ``nrows`` (the last one may be shorter)."""
    return (nrows + ROW_BATCH - 1) // ROW_BATCH


@njit(parallel=True, cache=True, nogil=True)
def rows_hit_box(pts, n_crystals, rows, lo, vs, g, out):
    """``out[q] = 1`` where row ``rows[q]``'s tube crosses the voxel box (:func:`tube_hits_box`), else 0."""
    for q in prange(rows.shape[0]):
        r = rows[q]
        i = r // n_crystals
        j = r - i * n_crystals
        out[q] = 1 if i != j and tube_hits_box(pts, i, j, lo, vs, g) else 0


@njit(parallel=True, cache=True, nogil=True)
def count_rows(pts, n_crystals, rows, lo, vs, g, acc, touched, counts):
    """Write into ``counts[q]`` the number of distinct voxels of row ``rows[q]``.

    ``acc`` (zeros) and ``touched`` are per-thread scratch arrays of shape
    ``(T, ...)``; ``acc`` is left zero. Rows with ``i == j`` are empty.
    """
    nt = acc.shape[0]
    nrows = rows.shape[0]
    for t in prange(nt):
        for b in range(t, _batches(nrows), nt):
            for q in range(b * ROW_BATCH, min(nrows, (b + 1) * ROW_BATCH)):
                r = rows[q]
                i = r // n_crystals
                j = r - i * n_crystals
                if i == j:
                    counts[q] = 0
                    continue
                cnt = _trace_tube(pts, i, j, lo, vs, g, acc[t], touched[t])
                _clear(acc[t], touched[t], cnt)
                counts[q] = cnt


@njit(parallel=True, cache=True, nogil=True)
def fill_rows(pts, n_crystals, rows, lo, vs, g, acc, touched, sort_tmp, hist, indptr, inv_rays, indices, data, bad,
              lab, unlab):
    """Fill the sorted columns and values of rows ``rows`` into pre-sized CSR arrays.

    ``sort_tmp`` (like ``touched``) and ``hist`` (``(T, 2**RADIX_BITS + 1)``
    int64) are sort scratch. ``indptr`` (length ``len(rows) + 1``) comes from the counting pass; a row
    whose count differs is reported in ``bad[t] = row + 1`` (never expected:
    the tracer is deterministic). Values are ``sum of segment lengths *
    inv_rays`` in float64, stored as float32. ``lab``, ``unlab``: the voxel
    labels of :func:`_emit_row` (empty: the raster order).
    """
    nt = acc.shape[0]
    nrows = rows.shape[0]
    for t in prange(nt):
        acc_t = acc[t]
        tch = touched[t]
        for b in range(t, _batches(nrows), nt):
            for q in range(b * ROW_BATCH, min(nrows, (b + 1) * ROW_BATCH)):
                r = rows[q]
                i = r // n_crystals
                j = r - i * n_crystals
                s = indptr[q]
                e = indptr[q + 1]
                if i == j:
                    if e != s:
                        bad[t] = r + 1
                    continue
                cnt = _trace_tube(pts, i, j, lo, vs, g, acc_t, tch)
                if cnt != e - s:
                    _clear(acc_t, tch, cnt)
                    bad[t] = r + 1
                    continue
                _emit_row(tch, cnt, sort_tmp[t], hist[t], acc_t, inv_rays, indices, data, s, lab, unlab)


@njit(parallel=True, cache=True, nogil=True)
def fill_rows_arena(
    pts, n_crystals, rows, lo, vs, g, acc, touched, sort_tmp, hist, inv_rays, a_idx, a_val, counts, starts, stop,
    lab, unlab,
):
    """Trace rows ``rows`` in one pass into per-thread arenas, without knowing their lengths first.

    Thread slot ``t`` takes the batches of :data:`ROW_BATCH` rows ``t, t + T, ...`` and appends each row's
    sorted columns and values to its arena ``a_idx[t]``, ``a_val[t]``
    (``(T, cap)`` int32 and float32): ``counts[q]`` elements from
    ``starts[q]``. When a row does not fit, the slot stops there:
    ``stop[t]`` is that row's position ``q`` (``len(rows)`` when the slot
    finished), so rows ``0 .. min(stop) - 1`` are complete. A slot's first
    row always fits when ``cap`` is at least the longest possible row.
    ``lab``, ``unlab``: the voxel labels of :func:`_emit_row` (empty: the raster order).
    """
    nt = acc.shape[0]
    nrows = rows.shape[0]
    cap = a_idx.shape[1]
    for t in prange(nt):
        acc_t = acc[t]
        tch = touched[t]
        pos = 0
        stop[t] = nrows
        for b in range(t, _batches(nrows), nt):
            for q in range(b * ROW_BATCH, min(nrows, (b + 1) * ROW_BATCH)):
                r = rows[q]
                i = r // n_crystals
                j = r - i * n_crystals
                cnt = 0
                if i != j:
                    cnt = _trace_tube(pts, i, j, lo, vs, g, acc_t, tch)
                if pos + cnt > cap:
                    _clear(acc_t, tch, cnt)
                    stop[t] = q
                    break
                _emit_row(tch, cnt, sort_tmp[t], hist[t], acc_t, inv_rays, a_idx[t], a_val[t], pos, lab, unlab)
                counts[q] = cnt
                starts[q] = pos
                pos += cnt
            if stop[t] < nrows:
                break


@njit(parallel=True, cache=True, nogil=True)
def gather_rows(a_idx, a_val, starts, indptr, indices, data):
    """Copy rows ``q < len(indptr) - 1`` from the arenas of :func:`fill_rows_arena` into CSR arrays."""
    nt = a_idx.shape[0]
    for q in prange(indptr.shape[0] - 1):
        t = (q // ROW_BATCH) % nt
        s = starts[q]
        o = indptr[q]
        for p in range(indptr[q + 1] - o):
            indices[o + p] = a_idx[t, s + p]
            data[o + p] = a_val[t, s + p]
