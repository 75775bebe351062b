"""Writing a conversation subset: the golden layout and manifest with the image bytes kept as they came,
byte-identical output for the same input, each sample on disk before the next is requested, diagnostics read
after the stream ends; a shortfall and every bad sample or source row publish nothing and name sample, row
and field; an encoded image is not decoded again; a complete subset is reused without reading the samples,
and the destination rules (non-empty, ``.``, empty) hold."""

from __future__ import annotations

import hashlib
import json

import pytest

from _conversation_samples import (
    MULTI,
    SINGLE,
    jpeg_bytes,
    multi_row,
    multi_samples,
    nemotron_row,
    png_bytes,
    single_row,
    single_samples,
)
from _files import siblings, tree_bytes
from puzzletron.dataset import (
    materialize_normalized_conversation_samples,
    materialize_normalized_intersyn_samples,
    normalize_intersyn_multi,
    normalize_intersyn_single,
    normalize_nemotron_vlm_sample,
)
from puzzletron.dataset.errors import ConversationError, SubsetError
from puzzletron.dataset.formats.subset import verify_subset


def test_golden_layout_manifest_and_kept_bytes(tmp_path):
    samples = [*single_samples(2), *multi_samples(1)]
    dest = tmp_path / "subset"
    manifest = materialize_normalized_conversation_samples(
        iter(samples), dest, acquisition={"adapter": "test"}
    )
    assert sorted(tree_bytes(dest)) == [
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
    assert siblings(dest) == ["subset"]


def test_same_input_gives_a_byte_identical_subset(tmp_path):
    for name in ("a", "b"):
        materialize_normalized_conversation_samples(
            iter(single_samples(3)), tmp_path / name, diagnostics={"k": 1}
        )
    assert tree_bytes(tmp_path / "a") == tree_bytes(tmp_path / "b")


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
    "undecodable image": (
        lambda mp: _with_image(b"GIF89a-not-really"),
        "not an image in a decoded format|undecodable",
    ),
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
    assert tree_bytes(dest) == {"notes.txt": b"mine"}


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
