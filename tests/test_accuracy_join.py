"""The runs' accuracy against the float64 reference, joined where the summary is made (CPU only).

The workflow's runs do not wait for the reference (run_mlem has no reference
input); :func:`mlemlib.report.summarize` measures each run's image against
the reference image of the same problem and iteration count. These tests
prove that the joined numbers are those a run given ``reference=`` records.
"""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from mlemlib.mlem import reconstruct, reference
from mlemlib.problem import ModelSpec, RunSettings
from mlemlib.report.rows import join_reference_accuracy, load_timings
from mlemlib.report.summary import summarize
from test_mlem import _problem

ACCURACY = ("image_sum", "reference_sum", "rel_l2_reference", "sum_rel_error_reference", "image_sha256")


def _rows(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A reference after 12 iterations; the same run once with ``reference=`` and once without."""
    tmp = tmp_path_factory.mktemp("join")
    a, g = _problem()
    ref = tmp / "reference-it12" / "image.h5"
    ref.parent.mkdir()
    reference(ModelSpec(a, g), RunSettings(12, checkpoint_every=0), ref, timings_out=ref.with_name("timings.json"))
    for name, given in (("with", ref), ("without", None)):
        (tmp / name).mkdir()
        reconstruct(ModelSpec(a, g), RunSettings(12, repetitions=2, checkpoint_every=0, backend="cpu"),
                    tmp / name / "image.h5", reference=given)
    return tmp


def test_summary_joins_the_same_accuracy_a_run_with_its_reference_records(runs):
    summarize([runs / "with"], runs / "summary-with")
    summarize([runs / "without"], runs / "summary-without",
              references=[runs / "reference-it12" / "timings.json", runs / "reference-it12" / "image.h5"])
    recorded = _rows(runs / "summary-with" / "runs.csv")
    joined = [r for r in _rows(runs / "summary-without" / "runs.csv") if r["reference_mode"] == "False"]
    assert len(recorded) == len(joined) == 2
    for a, b in zip(recorded, joined):
        for column in ACCURACY:
            assert a[column] == b[column], column  # the same digits, not merely close
        assert 0 < float(b["rel_l2_reference"]) < 1e-5


def test_reference_of_another_iteration_count_is_not_joined(runs, tmp_path):
    a, g = _problem()
    other = tmp_path / "image.h5"
    reference(ModelSpec(a, g), RunSettings(11, checkpoint_every=0), other)
    ((_, t),) = join_reference_accuracy(load_timings([runs / "without"]), [other])
    assert all("rel_l2_reference" not in rep["accuracy"] for rep in t["repetitions"])


def test_a_repetition_with_another_image_gets_the_sums_only(runs):
    ((run_id, t),) = load_timings([runs / "without"])
    t = json.loads(json.dumps(t))
    t["repetitions"][0]["accuracy"]["image_sha256"] = "0" * 64  # as a run with atomics may differ
    ((_, t),) = join_reference_accuracy([(run_id, t)], [runs / "reference-it12" / "image.h5"])
    first, last = (rep["accuracy"] for rep in t["repetitions"])
    assert "rel_l2_reference" not in first and "rel_l2_reference" in last
    assert first["reference_sum"] == last["reference_sum"]
    assert first["sum_rel_error_reference"] == pytest.approx(
        (first["image_sum"] - first["reference_sum"]) / first["reference_sum"], rel=1e-15)
    assert np.isfinite(last["rel_l2_reference"])


def test_a_repetition_with_another_image_kept_in_image_h5_gets_its_own_accuracy(runs, tmp_path):
    """A run with atomics keeps the other repetitions' images under /repetitions; the join measures each."""
    from mlemlib import metrics
    from mlemlib.image import read_image, read_repetition_images, write_image

    ((run_id, t),) = load_timings([runs / "without"])
    t = json.loads(json.dumps(t))
    final, attrs = read_image(t["outputs"]["image"])
    other = (final * np.float32(1.001)).astype(np.float32)  # as another repetition's image may differ
    sha = metrics.image_digest(other)
    image = tmp_path / "image.h5"
    write_image(image, final, attrs=attrs, others={sha: other})
    assert list(read_repetition_images(image)) == [sha]
    t["outputs"]["image"] = str(image)
    t["repetitions"][0]["accuracy"]["image_sha256"] = sha
    ((_, t),) = join_reference_accuracy([(run_id, t)], [runs / "reference-it12" / "image.h5"])
    first, last = (rep["accuracy"] for rep in t["repetitions"])
    ref, _ = read_image(runs / "reference-it12" / "image.h5")
    assert first["rel_l2_reference"] == metrics.relative_l2(other, ref) != last["rel_l2_reference"]
    assert first["rel_l2_reference"] > 9e-4  # the 0.1% the image was scaled by


def test_a_deterministic_run_keeps_no_other_images(runs):
    from mlemlib.image import read_repetition_images

    assert read_repetition_images(runs / "without" / "image.h5") == {}
