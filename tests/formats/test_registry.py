"""`puzzletron.dataset.formats`: every manifest names its format, `verify`/`describe` dispatch on it, and
manifests written before formats were named (no ``format`` key) are still detected, verified and reused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _conversation_samples import single_samples
from puzzletron.dataset import formats
from puzzletron.dataset.errors import SubsetError
from puzzletron.dataset.formats import FORMATS, VerifyReport, format_of
from puzzletron.dataset.formats.manifest import (
    check_file,
    differing_keys,
    require_same_acquisition,
    sha256_file,
)
from puzzletron.dataset.formats.subset import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    materialize_normalized_conversation_samples,
    read_manifest,
)
from puzzletron.dataset.formats.text_snapshot import TEXT_SNAPSHOT_FORMAT, read_text_snapshot
from puzzletron.dataset.sources import TextAcquisitionSpec, materialize_puzzle_kd_dataset


def _rows(source, *, split, revision, seed):
    for i in range(3 if split == "train" else 2):
        yield {
            "messages": [{"role": "user", "content": f"{split} {i}"}, {"role": "assistant", "content": "ok"}]
        }


def _pinned(source: str, revision: str | None) -> str:
    return "a" * 40


def _never(source: str, revision: str | None) -> str:
    raise AssertionError("reuse must not resolve a revision")


def _spec(out: Path) -> TextAcquisitionSpec:
    return TextAcquisitionSpec(output_dir=out, train_samples=3, validation_samples=2)


@pytest.fixture
def subset(tmp_path: Path) -> Path:
    dest = tmp_path / "subset"
    materialize_normalized_conversation_samples(iter(single_samples(2)), dest)
    return dest


@pytest.fixture
def text(tmp_path: Path) -> Path:
    out = tmp_path / "text"
    materialize_puzzle_kd_dataset(_spec(out), dataset_loader=_rows, revision_resolver=_pinned)
    return out


@pytest.fixture
def unnamed_text(text: Path) -> Path:
    """A text snapshot as the code before `format` wrote it: the same manifest without the key."""
    manifest = json.loads((text / MANIFEST).read_text())
    del manifest["format"]
    (text / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return text


def _manifest(root: Path) -> dict:
    return json.loads((root / MANIFEST).read_text())


# ------------------------------------------------------------------------------------------- detection


@pytest.mark.parametrize(
    ("manifest", "expected"),
    [
        ({"format": "puzzletron-conversation-subset", "version": 2}, "puzzletron-conversation-subset"),
        ({"format": "puzzletron-text-snapshot", "version": 1}, "puzzletron-text-snapshot"),
        ({"version": 1, "splits": {"train": 3}, "acquisition": {}}, "puzzletron-text-snapshot"),
        ({"version": 1, "sample_count": 0, "image_count": 0, "images": []}, "puzzletron-conversation-subset"),
        ({"splits": {"train": 1}, "images": []}, "puzzletron-conversation-subset"),  # images: a subset
    ],
)
def test_format_of_reads_the_name_or_the_documented_fallback(manifest: dict, expected: str) -> None:
    assert format_of(manifest) == expected


@pytest.mark.parametrize(
    ("manifest", "pattern"),
    [
        ({"format": "puzzletron-future-store", "version": 1}, "unknown format 'puzzletron-future-store'"),
        ({"version": 1}, "no 'format', and not a manifest of a known format"),
        ([1, 2], "expected a JSON object, got list"),
    ],
)
def test_format_of_refuses_what_it_cannot_tell(manifest: object, pattern: str) -> None:
    with pytest.raises(SubsetError, match=pattern):
        format_of(manifest)


def test_every_manifest_written_now_names_its_format_and_version(subset: Path, text: Path) -> None:
    assert (
        (_manifest(subset)["format"], _manifest(subset)["version"])
        == (FORMAT, FORMAT_VERSION)
        == (
            "puzzletron-conversation-subset",
            2,
        )
    )
    assert (_manifest(text)["format"], _manifest(text)["version"]) == ("puzzletron-text-snapshot", 1)
    assert formats.detect(subset) == FORMAT and formats.detect(text) == TEXT_SNAPSHOT_FORMAT


# ------------------------------------------------------------------------------------ verify, describe


def test_verify_and_describe_dispatch_to_each_format(subset: Path, text: Path) -> None:
    report = formats.verify(subset)
    assert report == VerifyReport(str(subset), 2, 2, (), FORMAT) and formats.summary(report) == (
        "2 samples, 2 images"
    )
    report = formats.verify(text)
    assert report == VerifyReport(str(text), 5, 0, (), TEXT_SNAPSHOT_FORMAT)
    assert formats.summary(report) == "5 rows"
    info = formats.describe(subset)
    assert (info["format"], info["sample_count"], info["image_count"]) == (FORMAT, 2, 2)
    assert formats.render(info)[1] == "samples      2"
    info = formats.describe(text)
    assert (info["format"], info["kind"], info["splits"], info["row_count"]) == (
        TEXT_SNAPSHOT_FORMAT,
        "text-snapshot",
        {"train": 3, "validation": 2},
        5,
    )
    assert "split        validation: 2 rows" in formats.render(info)


def test_a_text_snapshot_written_before_format_loads_verifies_and_is_reused(unnamed_text: Path) -> None:
    before = (unnamed_text / MANIFEST).read_bytes()
    assert formats.detect(unnamed_text) == TEXT_SNAPSHOT_FORMAT
    assert formats.verify(unnamed_text).ok
    assert formats.describe(unnamed_text)["row_count"] == 5
    reused = materialize_puzzle_kd_dataset(
        _spec(unnamed_text), dataset_loader=_rows, revision_resolver=_never
    )
    assert "format" not in reused and reused["splits"] == {"train": 3, "validation": 2}
    assert (unnamed_text / MANIFEST).read_bytes() == before  # reuse rewrites nothing
    arrow = next((unnamed_text / "train").glob("*.arrow"))
    data = bytearray(arrow.read_bytes())
    data[-20] ^= 0xFF
    arrow.write_bytes(bytes(data))
    problems = formats.verify(unnamed_text).problems
    assert problems[0].endswith("SHA-256 differs from the manifest")
    assert all("do not decode" in p or "readable Arrow" in p for p in problems[1:]), problems  # its rows


def test_unknown_format_is_a_verify_problem_and_a_describe_error(subset: Path) -> None:
    manifest = _manifest(subset)
    manifest["format"] = "puzzletron-future-store"
    (subset / MANIFEST).write_text(json.dumps(manifest))
    report = formats.verify(subset)
    assert not report.ok and "unknown format 'puzzletron-future-store'" in report.problems[0]
    with pytest.raises(SubsetError, match="unknown format"):
        formats.describe(subset)
    with pytest.raises(SubsetError, match="not a conversation subset"):
        read_manifest(subset)


def test_a_directory_without_a_manifest_is_a_verify_problem(tmp_path: Path) -> None:
    report = formats.verify(tmp_path)
    assert report.problems == (f"{tmp_path / MANIFEST}: the manifest is missing",)
    with pytest.raises(SubsetError, match="the manifest is missing"):
        formats.describe(tmp_path)


def test_each_reader_refuses_the_other_format(subset: Path, text: Path) -> None:
    with pytest.raises(SubsetError, match="a 'puzzletron-text-snapshot' manifest, not a conversation subset"):
        read_manifest(text)
    with pytest.raises(SubsetError, match="not a Puzzle-KD text snapshot"):
        read_text_snapshot(subset)
    with pytest.raises(SubsetError, match="not a Puzzle-KD text snapshot"):
        materialize_puzzle_kd_dataset(_spec(subset), dataset_loader=_rows, revision_resolver=_pinned)


def test_a_text_snapshot_of_an_unknown_version_is_refused(text: Path) -> None:
    manifest = _manifest(text)
    manifest["version"] = 2
    (text / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(SubsetError, match="format version 2 is not supported"):
        materialize_puzzle_kd_dataset(_spec(text), dataset_loader=_rows, revision_resolver=_pinned)
    assert "format version 2 is not supported" in formats.verify(text).problems[0]


def test_a_new_format_is_one_entry_in_the_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def verify(path: Path) -> VerifyReport:
        return VerifyReport(str(path), 7, 0, (), "puzzletron-future-store")

    entry = formats.Format(
        verify=verify,
        describe=lambda path: {"format": "puzzletron-future-store", "path": str(path)},
        render=lambda info: [f"token store {info['path']}"],
        counts="{sample_count} sequences",
    )
    monkeypatch.setitem(FORMATS, "puzzletron-future-store", entry)
    (tmp_path / MANIFEST).write_text(json.dumps({"format": "puzzletron-future-store", "version": 1}))
    assert formats.summary(formats.verify(tmp_path)) == "7 sequences"
    assert formats.render(formats.describe(tmp_path)) == [f"token store {tmp_path}"]


# ----------------------------------------------------------------------------------- shared helpers


def test_check_file_names_the_file_and_what_is_wrong(tmp_path: Path) -> None:
    (tmp_path / "a.bin").write_bytes(b"abc")
    record = {"path": "a.bin", "bytes": 3, "sha256": sha256_file(tmp_path / "a.bin")}
    assert check_file(tmp_path, record, "sample file") == tmp_path / "a.bin"
    with pytest.raises(SubsetError, match=r"sample file 'a\.bin' has 3 bytes, the manifest records 4"):
        check_file(tmp_path, {**record, "bytes": 4}, "sample file")
    with pytest.raises(SubsetError, match=rf"^{tmp_path}: b\.bin is missing$"):
        check_file(tmp_path, {"path": "b.bin"})
    with pytest.raises(SubsetError, match=r"contains '\.\.'"):
        check_file(tmp_path, {"path": "../a.bin"})
    with pytest.raises(SubsetError, match="expected a mapping with a path"):
        check_file(tmp_path, ["a.bin"])


def test_acquisition_comparison_names_every_differing_key(tmp_path: Path) -> None:
    recorded = {"adapter": "x", "seed": 1, "revision": "a"}
    assert differing_keys(recorded, {**recorded, "seed": 2, "revision": "b"}) == ["revision", "seed"]
    assert differing_keys(recorded, {**recorded, "revision": "b"}, ignore=("revision",)) == []
    require_same_acquisition(tmp_path, recorded, dict(recorded))
    with pytest.raises(
        SubsetError, match=r"does not match requested acquisition \(seed: existing 1 vs requested 2\)"
    ):
        require_same_acquisition(tmp_path, recorded, {**recorded, "seed": 2})
    with pytest.raises(SubsetError, match=r"\(seed: existing None vs requested 2\)"):
        require_same_acquisition(tmp_path, None, {"seed": 2})
    with pytest.raises(SubsetError, match=r"\(existing 'x' vs requested None\)"):
        require_same_acquisition(tmp_path, "x", None)


# -------------------------------------------------------------------------- documented import paths


def test_the_documented_import_paths_keep_their_constants() -> None:
    """The names themselves: tests/test_api.py imports each from its documented path."""
    import puzzletron.dataset.formats.subset as subset
    import puzzletron.dataset.sources as acquisition

    for module in (subset, acquisition):
        assert all(hasattr(module, name) for name in module.__all__)
    assert acquisition.MANIFEST_NAME == subset.MANIFEST == "manifest.json"
    assert acquisition.INTERSYN_SINGLE_SOURCE == "finyorko/single_turn"
    assert acquisition.INTERSYN_SINGLE_REVISION == "59acf6773cd2bf5b485f37296e862216aa99516b"
    assert acquisition.INTERSYN_MULTI_REVISION == "728987eff962e9df6f3da5ad5824a4accdd62bd2"
