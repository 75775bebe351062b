"""Tampered snapshots and hostile local input (docs/trust-model.md): every reader and verify checks the
manifest first, and every case ends in one clear line (an error or a verify problem), never a traceback."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from pathlib import Path

import pytest

from _conversation_samples import single_samples
from puzzletron.cli import main
from puzzletron.dataset import (
    PuzzletronDataSpec,
    formats,
    load_materialized_conversation_dataset,
    load_materialized_conversation_subset,
)
from puzzletron.dataset.errors import ConfigError, SubsetError
from puzzletron.dataset.formats.subset import (
    MANIFEST,
    SubsetReader,
    materialize_normalized_conversation_samples,
    read_manifest,
    verify_subset,
)
from puzzletron.dataset.formats.text_snapshot import read_text_snapshot, verify_text_snapshot
from puzzletron.dataset.sources import (
    TextAcquisitionSpec,
    VlmAcquisitionSpec,
    materialize_puzzle_kd_dataset,
)

DEEP = "[" * 100_000 + "]" * 100_000  # past the parser's recursion limit
NESTED = '{"a":' * 80 + "1" + "}" * 80  # parses, but deeper than anything a snapshot holds


def _one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(exc.value)
    assert "\n" not in text and "Traceback" not in text, text
    return text


@pytest.fixture
def subset(tmp_path: Path) -> Path:
    dest = tmp_path / "subset"
    materialize_normalized_conversation_samples(iter(single_samples(3)), dest)
    return dest


def _edit_manifest(root: Path, edit) -> None:
    manifest = json.loads((root / MANIFEST).read_text())
    edited = edit(manifest)
    text = edited if isinstance(edited, str) else json.dumps(manifest if edited is None else edited)
    (root / MANIFEST).write_text(text)


def _set(key: str, value):
    def edit(manifest: dict) -> None:
        manifest[key] = value

    return edit


# ------------------------------------------------------------------------- subset manifests, checked first


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda m: "{not json", "is not JSON"),
        (lambda m: [m], "expected a JSON object, got list"),
        (lambda m: DEEP, "nests JSON more than 64 levels"),
        (lambda m: b"\xff\xfe".decode("latin-1"), "is not JSON"),
        (_set("version", 4), "format version 4 is not supported"),
        (_set("version", 3), "media is None; expected the keys"),  # version 3 keeps its images in shards
        (_set("version", "2"), "format version '2' is not supported"),
        (_set("version", True), "format version True is not supported"),
        (_set("version", 2.0), "format version 2.0 is not supported"),
        (_set("format", "puzzletron-text-snapshot"), "not a conversation subset|not a Puzzle-KD snapshot"),
        (_set("sample_count", 2), "3 samples on disk, the manifest records 2"),
        (_set("sample_count", "3"), "'sample_count' is '3'; expected a non-negative integer"),
        (_set("image_count", 2), "does not list image_count=2 images"),
        (_set("images", {"a": 1}), "'images' is {'a': 1}; expected a list of records"),
        (_set("samples", "samples.jsonl"), "'samples' is 'samples.jsonl'; expected a file record"),
    ],
)
def test_every_reader_and_verify_refuses_a_bad_subset_manifest_before_serving_a_sample(
    subset: Path, edit, says: str
) -> None:
    _edit_manifest(subset, edit)
    for read in (
        SubsetReader,
        load_materialized_conversation_subset,
        load_materialized_conversation_dataset,
        read_manifest,
        formats.describe,
    ):
        with pytest.raises(SubsetError) as exc:
            read(subset)
        assert re.search(says, _one_line(exc)), (read, exc.value)
    report = verify_subset(subset)
    assert not report.ok and any(re.search(says, p) for p in report.problems), report.problems
    assert all("\n" not in p for p in report.problems)


def test_a_subset_of_the_original_layout_with_another_version_is_refused(subset: Path) -> None:
    _edit_manifest(subset, lambda m: {k: v for k, v in m.items() if k != "format"} | {"version": 2})
    with pytest.raises(SubsetError, match="format version 2 is not supported"):
        SubsetReader(subset)


def _replace_sample_line(root: Path, line: bytes) -> None:
    """Replace sample 0 with `line` and keep the index and manifest consistent with the new sizes (a
    hand-made subset: verify's hashes differ, the readers' cheap checks pass)."""
    lines = (root / "samples.jsonl").read_bytes().splitlines(keepends=True)
    lines[0] = line + b"\n"
    (root / "samples.jsonl").write_bytes(b"".join(lines))
    index = bytearray((root / "samples.idx").read_bytes())
    offset = 0
    for i, text in enumerate(lines):
        struct.pack_into("<Q", index, 24 + 8 * i, offset)
        offset += len(text)
    struct.pack_into("<Q", index, 24 + 8 * len(lines), offset)
    (root / "samples.idx").write_bytes(bytes(index))
    _edit_manifest(root, lambda m: m["samples"].update(bytes=offset))


def test_a_nul_byte_in_an_image_path_is_one_line_in_verify_inspect_load_and_the_reader(
    subset: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sample = json.loads((subset / "samples.jsonl").read_bytes().splitlines()[0])
    sample["conversation"][0]["content"][0]["image"] = "images/000000_00.jpg\x00.png"
    _replace_sample_line(subset, json.dumps(sample, sort_keys=True).encode())
    with pytest.raises(SubsetError) as exc:
        SubsetReader(subset)[0]
    assert "contains a NUL byte" in _one_line(exc)
    with pytest.raises(SubsetError, match="contains a NUL byte"):
        load_materialized_conversation_subset(subset)
    assert main(["verify", str(subset)]) == 1
    assert "contains a NUL byte" in capsys.readouterr().out
    _edit_manifest(subset, lambda m: m["images"][0].update(path="images/a\x00.jpg"))
    assert main(["inspect", str(subset)]) == 1
    err = capsys.readouterr().err
    assert "contains a NUL byte" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(("line", "says"), [(DEEP.encode(), "nests JSON"), (NESTED.encode(), "nests JSON")])
def test_a_deeply_nested_sample_line_is_an_error_not_a_recursion_error(
    subset: Path, line: bytes, says: str
) -> None:
    _replace_sample_line(subset, line)
    with pytest.raises(SubsetError) as exc:
        SubsetReader(subset)[0]
    assert says in _one_line(exc)
    assert any(says in p for p in verify_subset(subset).problems)


@pytest.mark.parametrize(
    ("start", "end"), [(2**62, 2**62 + 10), (50, 10), (0, 2**40)], ids=["huge", "backwards", "past-the-end"]
)
def test_index_offsets_outside_the_sample_file_are_an_error_not_a_memory_error(
    subset: Path, start: int, end: int
) -> None:
    index = bytearray((subset / "samples.idx").read_bytes())
    struct.pack_into("<QQ", index, 24 + 8, start, end)  # sample 1 spans offsets[1]..offsets[2]
    (subset / "samples.idx").write_bytes(bytes(index))
    with pytest.raises(SubsetError) as exc:
        SubsetReader(subset)[1]
    assert "not inside the" in _one_line(exc) and "samples.idx" in str(exc.value)
    assert not verify_subset(subset).ok


# ------------------------------------------------------------------------------------------ text snapshots


def _rows(source, *, split, revision, seed):
    for i in range(3 if split == "train" else 2):
        yield {
            "messages": [{"role": "user", "content": f"{split} {i}"}, {"role": "assistant", "content": "ok"}]
        }


@pytest.fixture
def text(tmp_path: Path) -> Path:
    out = tmp_path / "text"
    spec = TextAcquisitionSpec(output_dir=out, train_samples=3, validation_samples=2)
    materialize_puzzle_kd_dataset(spec, dataset_loader=_rows, revision_resolver=lambda s, r: "a" * 40)
    return out


def _data_file(root: Path) -> Path:
    return next((root / "train").glob("data-*.arrow"))


@pytest.mark.parametrize(
    ("tamper", "says"),
    [
        (lambda r: _edit_manifest(r, _set("version", 99)), "format version 99 is not supported"),
        (lambda r: _edit_manifest(r, _set("version", 1.0)), "format version 1.0 is not supported"),
        (lambda r: _edit_manifest(r, lambda m: m["splits"].update(train="3")), "split 'train' has '3' rows"),
        (lambda r: _edit_manifest(r, _set("files", {"a": 1})), "'files' is {'a': 1}; expected a list"),
        (lambda r: _edit_manifest(r, _set("files", 5)), "'files' is 5; expected a list"),
        (lambda r: _edit_manifest(r, lambda m: NESTED), "nests JSON more than 64 levels"),
        (
            lambda r: _edit_manifest(r, lambda m: m["splits"].update({"../..": 1})),
            "split name '../..' is not",
        ),
        (lambda r: (r / "train" / "stray.bin").write_bytes(b"x"), "unexpected file train/stray.bin"),
    ],
)
def test_text_snapshot_tampering_is_a_verify_problem_and_a_reuse_error(text: Path, tamper, says: str) -> None:
    tamper(text)
    report = verify_text_snapshot(text)
    assert not report.ok and any(says in p for p in report.problems), report.problems
    if "unexpected file" not in says:  # reuse checks what the manifest lists, cheaply
        with pytest.raises(SubsetError) as exc:
            read_text_snapshot(text)
        assert says in _one_line(exc)


def test_a_text_snapshot_file_that_is_a_symlink_out_of_the_snapshot_fails_verify(
    text: Path, tmp_path: Path
) -> None:
    data = _data_file(text)
    outside = tmp_path / "elsewhere.arrow"
    shutil.move(data, outside)
    data.symlink_to(outside)  # same bytes, same size and hash: only where it lives differs
    problems = verify_text_snapshot(text).problems
    assert any("outside the snapshot" in p for p in problems), problems
    assert any("is a symbolic link" in p for p in problems), problems
    with pytest.raises(SubsetError, match="outside the snapshot"):
        read_text_snapshot(text)


def test_a_symlinked_split_folder_fails_verify(text: Path, tmp_path: Path) -> None:
    shutil.move(text / "validation", tmp_path / "validation")
    (text / "validation").symlink_to(tmp_path / "validation")
    problems = verify_text_snapshot(text).problems
    assert any("validation is a symbolic link" in p for p in problems), problems


def test_a_text_snapshot_under_a_path_that_is_not_utf8_verifies(text: Path, tmp_path: Path, capsys) -> None:
    odd = tmp_path / os.fsdecode(b"snap-\xff")
    text.rename(odd)
    assert verify_text_snapshot(odd).ok
    assert main(["verify", str(odd)]) == 0
    assert "OK " in capsys.readouterr().out


# ------------------------------------------------------------------------------------------ output paths


@pytest.mark.parametrize("size", [222, 223, 240, 255])
def test_output_names_up_to_255_bytes_are_written_and_leave_no_debris(tmp_path: Path, size: int) -> None:
    dest = tmp_path / ("n" * size)
    manifest = materialize_normalized_conversation_samples(iter(single_samples(1)), dest)
    assert manifest["sample_count"] == 1 and verify_subset(dest).ok
    assert [p.name for p in tmp_path.iterdir()] == [dest.name]
    assert materialize_normalized_conversation_samples(iter(()), dest) == manifest  # reused


def test_an_output_name_over_255_bytes_is_a_config_error_before_anything_is_written(
    hub_endpoint: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    long = tmp_path / ("x" * 200 + "é" * 28)  # 256 bytes in UTF-8
    with pytest.raises(ConfigError) as exc:
        materialize_normalized_conversation_samples(iter(single_samples(1)), long)
    assert "is 256 bytes; a file name may have at most 255" in _one_line(exc)
    with pytest.raises(ConfigError, match="is 256 bytes"):
        VlmAcquisitionSpec(output_dir=long)
    for argv in (
        ["materialize", "puzzle-kd", "--output", str(long)],
        ["materialize", "nemotron-vlm", "--output", str(long)],
        ["materialize", "intersyn", "--output", str(long)],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "is 256 bytes" in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_an_acquisition_output_path_that_is_not_utf8_is_refused_before_any_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    odd = tmp_path / os.fsdecode(b"out-\xff")
    assert main(["materialize", "puzzle-kd", "--output", str(odd), "--source", "acme/never-asked"]) == 2
    err = capsys.readouterr().err
    assert "is not valid UTF-8" in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------ configs


def test_an_omegaconf_missing_interpolation_is_a_config_error_naming_the_key() -> None:
    omegaconf = pytest.importorskip("omegaconf")
    block = {"modality": "text", "layout": "fixed", "max_sample_length": "${model.seq_len}"}
    with pytest.raises(ConfigError) as exc:
        PuzzletronDataSpec.from_mapping(omegaconf.OmegaConf.create(block))
    assert "data.max_sample_length cannot be resolved" in _one_line(exc)
    packed = {
        "modality": "text",
        "layout": "packed_varlen",
        "max_sample_length": 8,
        "packing": {"pack_size": "???"},
    }
    with pytest.raises(ConfigError, match=r"data\.packing\.pack_size cannot be resolved"):
        PuzzletronDataSpec.from_mapping(omegaconf.OmegaConf.create(packed))


@pytest.mark.parametrize("value", [2**100, 2**31])
def test_a_max_sample_length_past_int32_is_a_config_error(value: int) -> None:
    with pytest.raises(ConfigError, match=r"data.max_sample_length must be an int <= 2147483647"):
        PuzzletronDataSpec(modality="text", layout="fixed", max_sample_length=value)
