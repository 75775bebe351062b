"""Reading a subset: samples come back with absolute, existing image paths; `SubsetReader` reads one line
without parsing the others; a missing image, or an image path that leaves the subset (``..``, absolute,
symlink), is an error naming the sample everywhere (load, reader, dataset, verify, reuse); the original layout
(``samples.json``) still loads and verifies; incomplete subsets are refused; loading never opens a socket."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest

from _conversation_samples import SINGLE, jpeg_bytes, multi_samples, png_bytes, single_samples
from _files import tree_bytes
from puzzletron.dataset import (
    load_materialized_conversation_dataset,
    load_materialized_conversation_subset,
    load_materialized_intersyn_subset,
    materialize_normalized_conversation_samples,
)
from puzzletron.dataset.errors import SubsetError
from puzzletron.dataset.formats.subset import SubsetReader, read_manifest, verify_subset


def test_load_returns_samples_with_absolute_existing_image_paths(tmp_path):
    dest = tmp_path / "subset"
    materialize_normalized_conversation_samples(iter([*single_samples(2), *multi_samples(1)]), dest)
    samples = load_materialized_conversation_subset(dest)
    assert load_materialized_intersyn_subset(dest) == samples
    assert [s["source"]["row_id"] for s in samples] == ["s0", "s1", "m0"]
    image = samples[2]["conversation"][2]["content"][0]["image"]
    assert image == str((dest / "images/000002_01.png").absolute())
    assert Path(image).read_bytes() == png_bytes(2)
    assert samples[0]["captions"] == ["caption 0"] and samples[0]["image_count"] == 1


def test_missing_image_is_an_error_naming_it(tmp_path):
    dest = tmp_path / "subset"
    materialize_normalized_conversation_samples(iter(single_samples(2)), dest)
    (dest / "images/000001_00.jpg").unlink()
    with pytest.raises(SubsetError, match=r"sample 1 \(row 's1'\) 'images/000001_00.jpg' is missing"):
        load_materialized_conversation_subset(dest)
    with pytest.raises(SubsetError, match=r"sample 1 .*000001_00.jpg' is missing"):
        SubsetReader(dest)[1]
    assert SubsetReader(dest)[0]["source"]["row_id"] == "s0"


def _point_sample_1_at(dest: Path, path: str) -> None:
    """Make sample 1's image item (and its manifest record) say `path`, rewriting the line in place.

    JSON allows blanks after a value, so a shorter path is padded and the offset index stays valid.
    """
    old = "images/000001_00.jpg"
    assert len(path) <= len(old)
    data = (dest / "samples.jsonl").read_bytes()
    replacement = json.dumps(path) + " " * (len(old) - len(path))
    (dest / "samples.jsonl").write_bytes(data.replace(json.dumps(old).encode(), replacement.encode()))
    manifest = json.loads((dest / "manifest.json").read_text())
    manifest["images"][1]["path"] = path
    (dest / "manifest.json").write_text(json.dumps(manifest))


def _escape_by_dotdot(dest: Path) -> str:
    (dest.parent / "o.jpg").write_bytes(jpeg_bytes(1))  # a real image, so only the path is wrong
    _point_sample_1_at(dest, "images/../../o.jpg")
    return r"contains '\.\.'"


def _escape_by_absolute_path(dest: Path) -> str:
    _point_sample_1_at(dest, "/etc/passwd")  # exists, and is not ours
    return "is absolute"


def _escape_by_symlink(dest: Path) -> str:
    outside = dest.parent / "outside.jpg"
    shutil.move(dest / "images/000001_00.jpg", outside)
    (dest / "images/000001_00.jpg").symlink_to(outside)
    return "outside the subset"


@pytest.mark.parametrize("escape", [_escape_by_dotdot, _escape_by_absolute_path, _escape_by_symlink])
def test_image_paths_that_leave_the_subset_are_rejected_everywhere_naming_the_sample(tmp_path, escape):
    dest = tmp_path / "subset"
    materialize_normalized_conversation_samples(iter(single_samples(3)), dest)
    problem = escape(dest)
    names_sample_1 = rf"sample 1 \((finyorko/single_turn )?row 's1'\).*{problem}"
    with pytest.raises(SubsetError, match=names_sample_1):
        load_materialized_conversation_subset(dest)
    with pytest.raises(SubsetError, match=names_sample_1):
        SubsetReader(dest)[1]
    dataset = load_materialized_conversation_dataset(str(dest))
    assert dataset[0]["source"]["row_id"] == "s0"  # the others still read
    with pytest.raises(SubsetError, match=names_sample_1):
        dataset[1]
    report = verify_subset(dest)
    assert not report.ok
    assert any(re.search(names_sample_1, p) for p in report.problems), report.problems
    with pytest.raises(SubsetError, match=names_sample_1):  # nor is it reused
        materialize_normalized_conversation_samples(iter(single_samples(3)), dest)


def test_reader_reads_one_line_without_parsing_the_others(tmp_path):
    dest = tmp_path / "subset"
    materialize_normalized_conversation_samples(iter(single_samples(5)), dest)
    lines = (dest / "samples.jsonl").read_bytes().split(b"\n")
    lines[1] = b"#" * len(lines[1])  # corrupt sample 1 in place, same length
    (dest / "samples.jsonl").write_bytes(b"\n".join(lines))
    reader = SubsetReader(dest)
    assert len(reader) == 5
    assert [reader[i]["source"]["row_id"] for i in (4, 0, 3, -1)] == ["s4", "s0", "s3", "s4"]
    with pytest.raises(SubsetError, match=r"sample 1 .* is not JSON"):
        reader[1]
    with pytest.raises(IndexError):
        reader[5]
    assert reader.groups() == [0, 0, 0, 0, 0]


# ---------------------------------------------------------------------------------- the original layout


def _write_original_layout(root: Path, image_paths: list[str] | None = None) -> list[bytes]:
    """An original-layout subset, written by hand: manifest.json, a samples.json array, images/NNNN_MM.png."""
    (root / "images").mkdir(parents=True)
    images, records, samples = [], [], []
    for i in range(2):
        data = png_bytes(50 + i)
        rel = f"images/{i:04d}_00.png"
        (root / rel).write_bytes(data)
        images.append(data)
        path = image_paths[i] if image_paths else rel
        samples.append(
            {
                "conversation": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "image": path}, {"type": "text", "text": "q"}],
                    },
                    {"role": "assistant", "content": [{"type": "text", "text": "a"}]},
                ],
                "image_count": 1,
                "source": {"dataset": SINGLE[0], "revision": SINGLE[1], "row_id": f"old{i}"},
                "captions": ["c"],
            }
        )
        records.append(
            {
                "sample_index": i,
                "row_id": f"old{i}",
                "image_index": 0,
                "path": rel,
                "sha256": hashlib.sha256(data).hexdigest(),
                "width": 32,
                "height": 24,
            }
        )
    manifest = {
        "version": 1,
        "sample_count": 2,
        "image_count": 2,
        "sources": [{"dataset": SINGLE[0], "revision": SINGLE[1]}],
        "images": records,
    }
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2))
    (root / "samples.json").write_text(json.dumps(samples, indent=2))
    return images


def test_original_layout_loads_unchanged_and_verifies(tmp_path):
    dest = tmp_path / "old"
    images = _write_original_layout(dest)
    before = tree_bytes(dest)
    samples = load_materialized_conversation_subset(dest)
    assert [s["source"]["row_id"] for s in samples] == ["old0", "old1"]
    assert Path(samples[1]["conversation"][0]["content"][0]["image"]).read_bytes() == images[1]
    assert Path(samples[1]["conversation"][0]["content"][0]["image"]).is_absolute()
    assert verify_subset(dest).ok
    assert materialize_normalized_conversation_samples(iter(()), dest)["version"] == 1  # reused
    assert tree_bytes(dest) == before


@pytest.mark.parametrize(
    ("bad_path", "pattern"),
    [("../outside.png", r"contains '\.\.'"), ("/etc/passwd", "is absolute")],
)
def test_original_layout_paths_must_stay_inside(tmp_path, bad_path, pattern):
    dest = tmp_path / "old"
    _write_original_layout(dest, image_paths=["images/0000_00.png", bad_path])
    with pytest.raises(SubsetError, match=rf"sample 1 \(finyorko/single_turn row 'old1'\).*{pattern}"):
        load_materialized_conversation_subset(dest)


def test_read_manifest_refuses_incomplete_subsets(tmp_path):
    with pytest.raises(SubsetError, match="no subset directory"):
        read_manifest(tmp_path / "nothing")
    (tmp_path / "half").mkdir()
    with pytest.raises(SubsetError, match="the manifest is missing"):
        read_manifest(tmp_path / "half")


def test_loading_never_touches_the_network(tmp_path, monkeypatch):
    import socket

    dest = tmp_path / "subset"
    materialize_normalized_conversation_samples(iter(single_samples(2)), dest)

    def no_network(*args, **kwargs):
        raise AssertionError("the loader opened a socket")

    monkeypatch.setattr(socket, "socket", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    assert len(load_materialized_conversation_subset(dest)) == 2
    assert SubsetReader(dest)[1]["source"]["row_id"] == "s1"
