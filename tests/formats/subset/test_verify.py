"""Subsets are verifiably tamper-evident: a deleted sample file, a flipped or truncated image, damaged
sample lines and a manifest of the wrong shape are reported by `verify_subset`, never a crash, and refused by
reuse and load where they would mislead."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _conversation_samples import jpeg_bytes, single_samples
from puzzletron.dataset import (
    load_materialized_conversation_subset,
    materialize_normalized_conversation_samples,
)
from puzzletron.dataset.errors import SubsetError
from puzzletron.dataset.formats.subset import verify_subset


def test_deleted_sample_file_is_detected_by_reuse_load_and_verify(tmp_path):
    dest = tmp_path / "subset"
    materialize_normalized_conversation_samples(iter(single_samples(2)), dest)
    (dest / "samples.jsonl").unlink()
    with pytest.raises(
        SubsetError, match=r"holds no complete subset.*sample file 'samples\.jsonl' is missing"
    ):
        materialize_normalized_conversation_samples(iter(single_samples(2)), dest)
    with pytest.raises(SubsetError, match=r"samples\.jsonl' is missing"):
        load_materialized_conversation_subset(dest)
    report = verify_subset(dest)
    assert not report.ok and any("samples.jsonl' is missing" in p for p in report.problems)


def test_tampered_images_are_detected(tmp_path):
    dest = tmp_path / "subset"
    materialize_normalized_conversation_samples(iter(single_samples(3)), dest)
    assert verify_subset(dest).ok
    # Same size, one byte flipped: only hashing sees it.
    flipped = bytearray((dest / "images/000000_00.jpg").read_bytes())
    flipped[100] ^= 0xFF
    (dest / "images/000000_00.jpg").write_bytes(bytes(flipped))
    # Truncated: reuse and load see it from the recorded size.
    (dest / "images/000001_00.jpg").write_bytes(jpeg_bytes(1)[:-10])
    report = verify_subset(dest)
    assert not report.ok
    assert any("000000_00.jpg': SHA-256 differs" in p for p in report.problems)
    assert any("000001_00.jpg' has" in p and "truncated" in p for p in report.problems)
    with pytest.raises(SubsetError, match=r"sample 1 \(row 's1'\).*000001_00.jpg"):
        materialize_normalized_conversation_samples(iter(single_samples(3)), dest)
    with pytest.raises(SubsetError, match=r"000001_00\.jpg"):
        load_materialized_conversation_subset(dest)


def _replace_line(dest: Path, index: int, text: bytes) -> None:
    """Overwrite line `index` of samples.jsonl with `text` padded to the same length (index stays valid)."""
    lines = (dest / "samples.jsonl").read_bytes().split(b"\n")
    assert len(text) <= len(lines[index])
    lines[index] = text.ljust(len(lines[index]))
    (dest / "samples.jsonl").write_bytes(b"\n".join(lines))


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (b"5", "sample 0 is int, not a JSON object"),
        (b"[1, 2]", "sample 0 is list, not a JSON object"),
        (b'{"conversation": "x", "source": {}}', "field 'source.dataset': expected a non-empty string"),
        (
            b'{"conversation": ["x"], "image_count": 0, '
            b'"source": {"dataset": "d", "revision": "r", "row_id": 1}}',
            "field 'conversation[0]': expected a mapping",
        ),
    ],
)
def test_verify_reports_damaged_sample_lines_instead_of_crashing(tmp_path, line, expected):
    dest = tmp_path / "subset"
    materialize_normalized_conversation_samples(iter(single_samples(2)), dest)
    _replace_line(dest, 0, line)
    report = verify_subset(dest)
    assert not report.ok
    assert any(expected in p for p in report.problems), report.problems
    assert any("'images/000000_00.jpg' is used by no sample" in p for p in report.problems)


def test_verify_reports_a_manifest_whose_images_is_not_a_list(tmp_path):
    dest = tmp_path / "subset"
    materialize_normalized_conversation_samples(iter(single_samples(2)), dest)
    manifest = json.loads((dest / "manifest.json").read_text())
    manifest["images"] = 3
    (dest / "manifest.json").write_text(json.dumps(manifest))
    report = verify_subset(dest)
    assert "'images' is 3; expected a list of records" in report.problems[0]


def test_a_manifest_that_lies_about_an_images_size_is_reported(tmp_path):
    dest = tmp_path / "subset"
    materialize_normalized_conversation_samples(iter(single_samples(3)), dest)
    manifest = json.loads((dest / "manifest.json").read_text())
    record = manifest["images"][1]
    width, height = record["width"], record["height"]
    record["width"], record["height"] = 10 * width, 10 * height  # file and SHA-256 untouched
    (dest / "manifest.json").write_text(json.dumps(manifest))
    report = verify_subset(dest)
    assert not report.ok
    image = f"image of sample {record['sample_index']} (row {record.get('row_id')!r}) {record['path']!r}"
    assert report.problems == (
        f"{dest}: {image}: is {width}x{height}, the manifest records {10 * width}x{10 * height}",
    )
