"""Subsets are streamed, published atomically, reused only when complete, and verifiably tamper-evident."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import random
import re
import shutil
import signal
import time
from pathlib import Path

import pytest

from _conversation_samples import (
    jpeg_bytes,
    multi_row,
    multi_samples,
    nemotron_row,
    png_bytes,
    single_row,
    single_samples,
)
from puzzletron.dataset import (
    load_materialized_conversation_dataset,
    load_materialized_conversation_subset,
    load_materialized_intersyn_subset,
    materialize_normalized_conversation_samples,
    materialize_normalized_intersyn_samples,
    normalize_intersyn_multi,
    normalize_intersyn_single,
    normalize_nemotron_vlm_sample,
)
from puzzletron.dataset.errors import ConversationError, SubsetError
from puzzletron.dataset.formats.subset import SubsetReader, read_manifest, verify_subset

FORK = multiprocessing.get_context("fork")
SINGLE = ("finyorko/single_turn", "59acf6773cd2bf5b485f37296e862216aa99516b")
MULTI = ("finyorko/multi-turn", "728987eff962e9df6f3da5ad5824a4accdd62bd2")


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _siblings(dest: Path) -> list[str]:
    return sorted(p.name for p in dest.parent.iterdir())


def test_golden_layout_manifest_and_kept_bytes(tmp_path):
    samples = [*single_samples(2), *multi_samples(1)]
    dest = tmp_path / "subset"
    manifest = materialize_normalized_conversation_samples(
        iter(samples), dest, acquisition={"adapter": "test"}
    )
    assert sorted(_tree(dest)) == [
        "images/000000_00.jpg",
        "images/000001_00.jpg",
        "images/000002_00.png",
        "images/000002_01.png",
        "manifest.json",
        "samples.idx",
        "samples.jsonl",
    ]
    assert (dest / "images/000000_00.jpg").read_bytes() == jpeg_bytes(0)  # kept as it came
    assert (dest / "images/000002_01.png").read_bytes() == png_bytes(2)
    assert manifest["format"] == "puzzletron-conversation-subset" and manifest["version"] == 2
    assert (manifest["sample_count"], manifest["image_count"]) == (3, 4)
    assert manifest["sources"] == [
        {"dataset": MULTI[0], "revision": MULTI[1]},
        {"dataset": SINGLE[0], "revision": SINGLE[1]},
    ]
    assert manifest["acquisition"] == {"adapter": "test"}
    assert manifest["images"][0] == {
        "sample_index": 0,
        "row_id": "s0",
        "image_index": 0,
        "path": "images/000000_00.jpg",
        "sha256": hashlib.sha256(jpeg_bytes(0)).hexdigest(),
        "width": 32,
        "height": 24,
        "format": "JPEG",
        "bytes": len(jpeg_bytes(0)),
    }
    assert [(r["sample_index"], r["image_index"], r["row_id"]) for r in manifest["images"]] == [
        (0, 0, "s0"),
        (1, 0, "s1"),
        (2, 0, "m0"),
        (2, 1, "m0"),
    ]
    first = json.loads((dest / "samples.jsonl").read_text().splitlines()[0])
    assert first["conversation"][0]["content"] == [
        {"type": "image", "image": "images/000000_00.jpg"},
        {"type": "text", "text": "What is in picture 0?"},
    ]
    assert json.loads((dest / "manifest.json").read_text()) == manifest
    assert _siblings(dest) == ["subset"]


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


def test_same_input_gives_a_byte_identical_subset(tmp_path):
    for name in ("a", "b"):
        materialize_normalized_conversation_samples(
            iter(single_samples(3)), tmp_path / name, diagnostics={"k": 1}
        )
    assert _tree(tmp_path / "a") == _tree(tmp_path / "b")


def test_each_sample_is_on_disk_before_the_next_is_requested(tmp_path):
    dest = tmp_path / "subset"
    seen = []

    def stream():
        for i, sample in enumerate(single_samples(4)):
            written = sorted(p.name for p in tmp_path.glob(".subset.txn-*/images/*"))
            seen.append(written)
            assert written == [f"{k:06d}_00.jpg" for k in range(i)]
            yield sample

    materialize_normalized_conversation_samples(stream(), dest)
    assert len(seen) == 4


def test_diagnostics_are_read_after_the_stream_ends(tmp_path):
    diagnostics: dict = {}

    def stream():
        yield from single_samples(2)
        diagnostics["rejected_rows"] = [{"row_id": "x", "reason": "bad"}]

    manifest = materialize_normalized_conversation_samples(stream(), tmp_path / "d", diagnostics=diagnostics)
    assert manifest["diagnostics"] == {"rejected_rows": [{"row_id": "x", "reason": "bad"}]}


def test_shortfall_against_expected_count_publishes_nothing(tmp_path):
    dest = tmp_path / "subset"
    with pytest.raises(SubsetError, match=r"ran out after 2 of the expected 3; nothing was published"):
        materialize_normalized_conversation_samples(iter(single_samples(2)), dest, expected_count=3)
    assert list(tmp_path.iterdir()) == []


def _bad(sample_index_2_override):
    samples = single_samples(4)
    samples[2] = sample_index_2_override(samples[2])
    return samples


def _with_image(value):
    def change(sample):
        sample["conversation"][0]["content"][0]["image"] = value
        return sample

    return change


def _bomb(monkeypatch):
    from PIL import Image

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 5000)  # the other samples have 32x24 = 768 pixels
    return {"bytes": png_bytes(5, (200, 200)), "path": None}


BAD_SAMPLES = {
    "truncated image": (lambda mp: _with_image(jpeg_bytes(2)[:300]), "undecodable or truncated"),
    "undecodable image": (lambda mp: _with_image(b"GIF89a-not-really"), "not a decodable image|undecodable"),
    "url image": (lambda mp: _with_image("https://example.com/x.png"), "never downloads"),
    "src struct": (lambda mp: _with_image({"src": "https://datasets-server/x.jpg"}), "never downloads"),
    "missing image": (lambda mp: _with_image(None), r"content\[0\]\.image'.*missing"),
    "decompression bomb": (lambda mp: _with_image(_bomb(mp)), "decompression bomb"),
    "wrong image_count": (lambda mp: lambda s: {**s, "image_count": 2}, "'image_count'"),
    "video item": (
        lambda mp: (
            lambda s: (
                s
                | {
                    "conversation": [
                        {"role": "user", "content": [{"type": "video", "video": "v.mp4"}]},
                        *s["conversation"][1:],
                    ]
                }
            )
        ),
        r"content\[0\]\.type'.*'video'",
    ),
    "non-string text": (
        lambda mp: (
            lambda s: (
                s
                | {
                    "conversation": [
                        s["conversation"][0],
                        {"role": "assistant", "content": [{"type": "text", "text": 3}]},
                    ]
                }
            )
        ),
        r"content\[0\]\.text'",
    ),
    "wrong role": (
        lambda mp: (
            lambda s: s | {"conversation": [s["conversation"][0], {**s["conversation"][1], "role": "bot"}]}
        ),
        r"conversation\[1\]\.role'",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_SAMPLES))
def test_bad_sample_fails_naming_sample_and_row_and_publishes_nothing(tmp_path, monkeypatch, case):
    make, pattern = BAD_SAMPLES[case]
    dest = tmp_path / "subset"
    with pytest.raises(
        ConversationError, match=rf"sample 2 \(finyorko/single_turn row 's2'\).*(?:{pattern})"
    ):
        materialize_normalized_conversation_samples(iter(_bad(make(monkeypatch))), dest)
    assert list(tmp_path.iterdir()) == []


# A corpus of raw source rows as the real sources produce them, each broken in one way. The broken row is
# row 2 of a lazily normalised stream of four, so rows 0 and 1 (and their images) are already written into
# the transaction when the error comes: it must name row and field, and nothing may be left behind.
def _nemotron_messages(*user_items):
    return [{"role": "user", "content": list(user_items)}, {"role": "assistant", "content": "ok"}]


_IMAGE_ITEM = {"type": "image", "image": "2.png"}
_SINGLE_AT = r"finyorko/single_turn row 's2'"
_SINGLE_IMAGE = (
    r"sample 2 \(finyorko/single_turn row 's2'\) image 0 \(conversation\[0\]\.content\[0\]\.image\)"
)
_NEMOTRON_AT = r"nvidia/Nemotron-VLM-Dataset-v2 row 'n2'"
BAD_ROWS = {
    # (source, the broken fields of row 2, the expected error: row and field)
    "missing text": ("single", {"human": None}, rf"{_SINGLE_AT}: field 'human'"),
    "empty text": ("single", {"gpt": "  "}, rf"{_SINGLE_AT}: field 'gpt'.*empty"),
    "non-string text": ("single", {"gpt": ["a"]}, rf"{_SINGLE_AT}: field 'gpt'.*got list"),
    "missing image": ("single", {"image": None}, rf"{_SINGLE_AT}: field 'image': missing image"),
    "undecodable image": (
        "single",
        {"image": {"bytes": b"\x89PNG\r\n\x1a\n garbage", "path": None}},
        rf"{_SINGLE_IMAGE}: (not a decodable|undecodable)",
    ),
    "truncated image": (
        "single",
        {"image": {"bytes": jpeg_bytes(2)[:-200], "path": None}},
        rf"{_SINGLE_IMAGE}: undecodable or truncated",
    ),
    "decompression bomb": (
        "single",
        {"image": {"bytes": png_bytes(2, (200, 200)), "path": None}},  # MAX_IMAGE_PIXELS lowered to 5000
        rf"{_SINGLE_IMAGE}: decompression bomb",
    ),
    "multi: one image where two are needed": (
        "multi",
        {f"{k}{g}": None for g in (2, 3, 4, 5) for k in ("human", "gpt", "image", "caption")},
        r"finyorko/multi-turn row 'm2': field 'image1..image5'.*at least two images",
    ),
    "multi: a group without its image": ("multi", {"image2": None}, r"row 'm2': field 'image2'"),
    "video item": (
        "nemotron",
        {"messages": _nemotron_messages(_IMAGE_ITEM, {"type": "video", "video": "2.mp4"})},
        rf"{_NEMOTRON_AT}: field 'messages\[0\]\.content\[1\]'.*video",
    ),
    "zero images": (
        "nemotron",
        {"messages": _nemotron_messages({"type": "text", "text": "hi"})},
        rf"{_NEMOTRON_AT}: field 'messages'.*exactly one image item, found 0",
    ),
    "two images": (
        "nemotron",
        {"messages": _nemotron_messages(_IMAGE_ITEM, _IMAGE_ITEM)},
        rf"{_NEMOTRON_AT}: field 'messages'.*exactly one image item, found 2",
    ),
    "wrong role": (
        "nemotron",
        {"messages": [{"role": "human", "content": [_IMAGE_ITEM]}, {"role": "assistant", "content": "x"}]},
        rf"{_NEMOTRON_AT}: field 'messages\[0\]\.role'.*got 'human'",
    ),
    "non-string text item": (
        "nemotron",
        {"messages": _nemotron_messages(_IMAGE_ITEM, {"type": "text", "text": None})},
        rf"{_NEMOTRON_AT}: field 'messages\[0\]\.content\[1\]\.text'",
    ),
}


def _normalised(source: str, rows):
    for row in rows:
        if source == "single":
            yield normalize_intersyn_single(row)
        elif source == "multi":
            yield normalize_intersyn_multi(row)
        else:
            yield normalize_nemotron_vlm_sample(row, subset="tables", revision="r1")


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_bad_source_row_names_row_and_field_and_publishes_nothing(tmp_path, monkeypatch, case):
    from PIL import Image

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 5000)  # good rows have 32x24 = 768 pixels
    source, broken, pattern = BAD_ROWS[case]
    make = {"single": single_row, "multi": multi_row, "nemotron": nemotron_row}[source]
    rows = [make(i, **(broken if i == 2 else {})) for i in range(4)]
    dest = tmp_path / "out" / "subset"  # out/ is created by the run, and must go again
    with pytest.raises(ConversationError, match=pattern):
        materialize_normalized_conversation_samples(_normalised(source, rows), dest)
    assert list(tmp_path.iterdir()) == []


def test_an_encoded_image_is_stored_without_decoding_it_again(tmp_path, monkeypatch):
    from PIL import Image

    from puzzletron.dataset.conversation.images import encode_image

    sample = single_samples(1)[0]
    encoded = encode_image(jpeg_bytes(0))  # what an acquisition that validated the image already has
    sample["conversation"][0]["content"][0]["image"] = encoded

    def no_decoding(*args, **kwargs):
        raise AssertionError("the materialiser decoded an EncodedImage again")

    monkeypatch.setattr(Image, "open", no_decoding)
    manifest = materialize_normalized_conversation_samples(iter([sample]), tmp_path / "subset")
    assert (tmp_path / "subset/images/000000_00.jpg").read_bytes() == jpeg_bytes(0)
    record = manifest["images"][0]
    assert (record["format"], record["width"], record["height"]) == ("JPEG", 32, 24)
    assert record["sha256"] == hashlib.sha256(jpeg_bytes(0)).hexdigest()


def test_rerun_reuses_the_complete_subset_without_reading_samples(tmp_path):
    dest = tmp_path / "subset"
    first = materialize_normalized_conversation_samples(iter(single_samples(2)), dest, acquisition={"n": 2})

    def never():
        raise AssertionError("reuse must not read the samples")
        yield

    assert materialize_normalized_conversation_samples(never(), dest, acquisition={"n": 2}) == first
    assert materialize_normalized_intersyn_samples([], dest) == first
    with pytest.raises(SubsetError, match="does not match requested acquisition"):
        materialize_normalized_conversation_samples(never(), dest, acquisition={"n": 3})


def test_non_empty_directory_without_a_subset_is_an_error(tmp_path):
    dest = tmp_path / "subset"
    dest.mkdir()
    (dest / "notes.txt").write_text("mine")
    with pytest.raises(SubsetError, match="is not empty and holds no complete subset"):
        materialize_normalized_conversation_samples(iter(single_samples(1)), dest)
    assert _tree(dest) == {"notes.txt": b"mine"}


def test_dot_as_output_dir_is_filled_from_its_parent(tmp_path, monkeypatch):
    """`--output .` inside an empty directory: lock and transaction live in the parent, not in `.`."""
    dest = tmp_path / "here"
    dest.mkdir()
    monkeypatch.chdir(dest)
    manifest = materialize_normalized_conversation_samples(iter(single_samples(2)), ".")
    assert manifest["sample_count"] == 2
    names = sorted(p.name for p in dest.iterdir())
    assert names == ["images", "manifest.json", "samples.idx", "samples.jsonl"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here"]
    assert verify_subset(dest).ok


def test_empty_directory_is_filled(tmp_path):
    dest = tmp_path / "subset"
    dest.mkdir()
    assert materialize_normalized_conversation_samples(iter(single_samples(1)), dest)["sample_count"] == 1


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
    before = _tree(dest)
    samples = load_materialized_conversation_subset(dest)
    assert [s["source"]["row_id"] for s in samples] == ["old0", "old1"]
    assert Path(samples[1]["conversation"][0]["content"][0]["image"]).read_bytes() == images[1]
    assert Path(samples[1]["conversation"][0]["content"][0]["image"]).is_absolute()
    assert verify_subset(dest).ok
    assert materialize_normalized_conversation_samples(iter(()), dest)["version"] == 1  # reused
    assert _tree(dest) == before


@pytest.mark.parametrize(
    ("bad_path", "pattern"),
    [("../outside.png", r"contains '\.\.'"), ("/etc/passwd", "is absolute")],
)
def test_original_layout_paths_must_stay_inside(tmp_path, bad_path, pattern):
    dest = tmp_path / "old"
    _write_original_layout(dest, image_paths=["images/0000_00.png", bad_path])
    with pytest.raises(SubsetError, match=rf"sample 1 \(finyorko/single_turn row 'old1'\).*{pattern}"):
        load_materialized_conversation_subset(dest)


# ---------------------------------------------------------------------------------- reliability


# The kill points are audit events (PEP 578: `open`, `os.mkdir`, `os.rename`, ...) on paths under the
# destination's parent, counted in the child: the hook runs *before* the operation, so "kill at event k"
# is a precise, repeatable place. A traced run (not killed) lists the events and their phases once.
_WATCHED = {"open", "os.mkdir", "os.rename", "os.unlink", "os.remove", "os.rmdir", "os.listdir", "os.scandir"}
_KILL_SAMPLES = 6


def _kill_samples() -> list:
    return [
        normalize_intersyn_single(single_row(i, image={"bytes": jpeg_bytes(i, (64, 48)), "path": None}))
        for i in range(_KILL_SAMPLES)
    ]


def _materialize_until_event(dest: Path, kill_at: int | None, trace: Path | None) -> None:
    """Child process: materialise, SIGKILLing itself at the `kill_at`-th watched event (1-based)."""
    import sys

    parent, seen = str(dest.parent), []

    def hook(event: str, args: tuple) -> None:
        if event not in _WATCHED or not args or not isinstance(args[0], str | os.PathLike):
            return
        path = os.fspath(args[0])
        if not isinstance(path, str) or not path.startswith(parent):
            return
        seen.append((event, os.path.relpath(path, parent)))
        if len(seen) == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    sys.addaudithook(hook)
    materialize_normalized_conversation_samples(
        iter(_kill_samples()), dest, acquisition={"k": "kill"}, expected_count=_KILL_SAMPLES
    )
    if trace is not None:
        trace.write_text(json.dumps(seen))


def _phase(events: list, k: int) -> str:
    """The phase of the 1-based event `k` of a traced run."""

    def first(test) -> int:
        return next(i for i, (event, path) in enumerate(events, 1) if test(event, path))

    first_image = first(lambda event, path: "/images/" in path)
    index = first(lambda event, path: path.endswith("/samples.idx"))  # written after the last sample
    rename = first(lambda event, path: event == "os.rename")
    if k < first_image:
        return "before: lock, sweep, transaction directory, sample file"
    if k < index:
        return "image writes"
    if k < rename:
        return "index, manifest, fsync of the tree and the parent"
    if k == rename:
        return "at the rename"
    return "after the rename"


@pytest.mark.slow
def test_sigkill_in_every_phase_leaves_absent_or_complete_and_a_rerun_leaves_no_debris(tmp_path):
    trace = tmp_path / "trace.json"
    probe = FORK.Process(target=_materialize_until_event, args=(tmp_path / "probe" / "dest", None, trace))
    probe.start()
    probe.join(60)
    assert probe.exitcode == 0
    events = json.loads(trace.read_text())
    phases: dict[str, list[int]] = {}
    for k in range(1, len(events) + 1):
        phases.setdefault(_phase(events, k), []).append(k)
    assert len(phases) == 5, phases
    # 20 kill points, seeded: 4 per phase (every event when a phase has fewer, the rest from the others).
    rng = random.Random(20240601)
    points = sorted({k for ks in phases.values() for k in rng.sample(ks, min(4, len(ks)))})
    spare = sorted(set(range(1, len(events) + 1)) - set(points))
    points = sorted(points + rng.sample(spare, 20 - len(points)))
    assert len(points) == 20
    seen_phases, outcomes = set(), set()
    for k in points:
        dest = tmp_path / f"kill{k}" / "dest"
        proc = FORK.Process(target=_materialize_until_event, args=(dest, k, None))
        proc.start()
        proc.join(60)
        assert proc.exitcode == -signal.SIGKILL, f"kill at event {k} {events[k - 1]} did not happen"
        phase = _phase(events, k)
        expected = "complete" if phase == "after the rename" else "absent"
        outcome = "complete" if dest.exists() else "absent"
        assert outcome == expected, f"kill at event {k} {events[k - 1]} ({phase}): {outcome}"
        if outcome == "complete":
            assert verify_subset(dest).ok, verify_subset(dest).problems
        seen_phases.add(phase)
        outcomes.add(outcome)
        manifest = materialize_normalized_conversation_samples(
            iter(_kill_samples()), dest, acquisition={"k": "kill"}
        )
        assert manifest["sample_count"] == _KILL_SAMPLES and verify_subset(dest).ok
        assert _siblings(dest) == ["dest"], f"debris (.txn-*, .lock) after the kill at event {k}"
    assert seen_phases == set(phases)
    assert outcomes == {"absent", "complete"}


def _concurrent_writer(dest: Path, barrier, results: Path) -> None:
    import logging

    # The library's own log says which path each process took: "published" (the writer) or "reusing".
    handler = logging.FileHandler(results / f"log-{os.getpid()}.txt")
    logger = logging.getLogger("puzzletron.dataset.formats.subset.writer")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)

    def stream():
        (results / f"writer-{os.getpid()}").touch()  # only the writer ever asks for samples
        for sample in single_samples(6):
            time.sleep(0.01)
            yield sample

    barrier.wait()
    manifest = materialize_normalized_conversation_samples(stream(), dest, acquisition={"c": 4})
    (results / f"manifest-{os.getpid()}.json").write_text(json.dumps(manifest, sort_keys=True))
    handler.close()


def test_four_concurrent_writers_one_writes_all_get_identical_manifests(tmp_path):
    dest, results = tmp_path / "out" / "dest", tmp_path / "results"
    results.mkdir()
    barrier = FORK.Barrier(4)
    procs = [FORK.Process(target=_concurrent_writer, args=(dest, barrier, results)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    writers = [p.name.removeprefix("writer-") for p in results.glob("writer-*")]
    assert len(writers) == 1
    logs = {p.name.removeprefix("log-").removesuffix(".txt"): p.read_text() for p in results.glob("log-*")}
    assert len(logs) == 4
    published = sorted(pid for pid, log in logs.items() if "published subset at" in log)
    reused = sorted(pid for pid, log in logs.items() if "reusing the complete subset" in log)
    assert published == writers and len(reused) == 3 and writers[0] not in reused
    manifests = {p.read_text() for p in results.glob("manifest-*.json")}
    assert len(list(results.glob("manifest-*.json"))) == 4 and len(manifests) == 1
    assert verify_subset(dest).ok
    assert _siblings(dest) == ["dest"]


def test_read_manifest_refuses_incomplete_subsets(tmp_path):
    with pytest.raises(SubsetError, match="no subset directory"):
        read_manifest(tmp_path / "nothing")
    (tmp_path / "half").mkdir()
    with pytest.raises(SubsetError, match="the manifest is missing"):
        read_manifest(tmp_path / "half")


def test_materialize_inside_a_callers_lock_of_the_same_destination(tmp_path):
    from puzzletron.dataset.storage.atomic import locked

    dest = tmp_path / "subset"
    with locked(dest):
        manifest = materialize_normalized_conversation_samples(iter(single_samples(1)), dest)
    assert manifest["sample_count"] == 1 and _siblings(dest) == ["subset"]


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
