"""Accuracy measures of reconstructed images (host, NumPy; every reduction in float64).

- :func:`image_sum`: the sum over the image, the thesis's own accuracy measure.
- :func:`relative_l2`: ``||f - r||_2 / ||r||_2`` against a reference (the
  float64 MLEM of the same problem) or the phantom's truth.
- :func:`relative_sum_error`: ``(sum f - sum r) / sum r``.
- :func:`image_digest`: SHA-256 of the float32 image bytes, to show whether
  repetitions are bit-identical.
- :func:`contrast_recovery`: per-sphere contrast recovery against the
  phantom's regions (NEMA-style, see :mod:`mlemlib.phantom`).

Images are compared as flat vectors in column order (``col = x + gridX*(y + gridY*z)``).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any

import numpy as np


def _flat64(a: Any) -> np.ndarray:
    return np.asarray(a, dtype=np.float64).reshape(-1)


def _check_same_size(f: np.ndarray, r: np.ndarray) -> None:
    if f.size != r.size:
        raise ValueError(f"images differ in size: {f.size} vs {r.size} voxels")


def image_sum(f: Any) -> float:
    """Sum of all voxels, accumulated in float64 (pairwise, deterministic)."""
    return float(np.sum(_flat64(f)))


def relative_l2(f: Any, ref: Any) -> float:
    """Relative L2 error ``||f - ref||_2 / ||ref||_2`` in float64.

    Returns 0.0 when both are zero and ``inf`` when only ``ref`` is zero.

    Raises
    ------
    ValueError
        If the images differ in size.
    """
    f = _flat64(f)
    r = _flat64(ref)
    _check_same_size(f, r)
    num = float(np.linalg.norm(f - r))
    den = float(np.linalg.norm(r))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def relative_sum_error(f: Any, ref: Any) -> float:
    """``(sum f - sum ref) / sum ref`` in float64 (0.0 when both sums are zero, inf when only ref's is)."""
    sf, sr = image_sum(f), image_sum(ref)
    if sr == 0.0:
        return 0.0 if sf == 0.0 else math.inf
    return (sf - sr) / sr


def image_digest(f: Any) -> str:
    """Hex SHA-256 of the image as contiguous float32 (equal digests: bit-identical float32 images)."""
    a = np.ascontiguousarray(np.asarray(f, dtype=np.float32).reshape(-1))
    return hashlib.sha256(a.tobytes()).hexdigest()


def spread(values: Sequence[float]) -> dict[str, float | int]:
    """min, max, mean, std (population) and max-min of a list of values (NaN-free input assumed)."""
    a = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=np.float64)
    if a.size == 0:
        nan = math.nan
        return {"n": 0, "min": nan, "max": nan, "mean": nan, "std": nan, "range": nan}
    return {
        "n": int(a.size),
        "min": float(a.min()),
        "max": float(a.max()),
        "mean": float(a.mean()),
        "std": float(a.std()),
        "range": float(a.max() - a.min()),
    }


def contrast_recovery(
    f: Any, masks: dict[str, np.ndarray], background: np.ndarray, activity: dict[str, float], background_activity: float
) -> dict[str, float]:
    """NEMA-style contrast recovery of each region.

    For a hot region (``activity > background_activity``)
    ``CR = (C_region / C_bg - 1) / (a_region / a_bg - 1)``; for a cold region
    (``activity < background_activity``) ``CR = 1 - C_region / C_bg``, where
    ``C`` are mean image values over the masks. 1.0 is perfect recovery.

    Parameters
    ----------
    f
        Image (any shape with the masks' size).
    masks
        Region label -> boolean mask (same size as ``f``).
    background
        Boolean mask of the background.
    activity
        Region label -> true activity.
    background_activity
        True background activity (must be > 0).

    Returns
    -------
    dict
        Label -> contrast recovery; NaN for an empty mask or a region whose
        activity equals the background's.
    """
    img = _flat64(f)
    bg = np.asarray(background, dtype=bool).reshape(-1)
    _check_same_size(img, bg)
    if background_activity <= 0:
        raise ValueError("background activity must be positive for contrast recovery")
    c_bg = float(img[bg].mean()) if bg.any() else math.nan
    out: dict[str, float] = {}
    for label, mask in masks.items():
        m = np.asarray(mask, dtype=bool).reshape(-1)
        _check_same_size(img, m)
        a = activity[label]
        if not m.any() or not math.isfinite(c_bg) or c_bg == 0.0 or a == background_activity:
            out[label] = math.nan
            continue
        ratio = float(img[m].mean()) / c_bg
        if a > background_activity:
            out[label] = (ratio - 1.0) / (a / background_activity - 1.0)
        else:
            out[label] = 1.0 - ratio
    return out


def accuracy(
    f: Any, *, reference: Any | None = None, truth: Any | None = None, regions: Any | None = None
) -> dict[str, Any]:
    """All accuracy measures of one image, as stored in ``timings.json``.

    Parameters
    ----------
    f
        The reconstructed image (float32 or float64).
    reference
        The float64 reference image of the same problem, or None.
    truth
        The phantom's true image (scaled to the expected counts), or None.
    regions
        A :class:`mlemlib.phantom.RegionMasks` for contrast recovery, or None.

    Returns
    -------
    dict
        ``image_sum``, ``image_sha256``, and where available
        ``reference_sum``, ``rel_l2_reference``, ``sum_rel_error_reference``,
        ``truth_sum``, ``rel_l2_truth``, ``contrast_recovery``.
    """
    out: dict[str, Any] = {"image_sum": image_sum(f), "image_sha256": image_digest(f)}
    if reference is not None:
        out["reference_sum"] = image_sum(reference)
        out["rel_l2_reference"] = relative_l2(f, reference)
        out["sum_rel_error_reference"] = relative_sum_error(f, reference)
    if truth is not None:
        out["truth_sum"] = image_sum(truth)
        out["rel_l2_truth"] = relative_l2(f, truth)
    if regions is not None:
        out["contrast_recovery"] = contrast_recovery(
            f, regions.masks, regions.background, regions.activity, regions.background_activity
        )
    return out
