"""A damaged token store never serves a damaged byte (docs/trust-model.md): every manifest field is checked
at open, each block of a file is checked against its checksum the first time a read touches it, the index
is checked whole before its first use, and files are pinned at open. The damage is
`puzzletron.fixtures.tampering`'s; a forger who re-signs the store (`resign_store`) is caught by the
store's own consistency. Every error is one line naming the store and the file or field."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import datasets
import numpy as np
import pytest

from _token_store_data import ROWS_PER_SHARD
from puzzletron.dataset import PuzzletronDataSpec, formats
from puzzletron.dataset.config import TokenizeOptions
from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.formats.manifest import canonical_sha256
from puzzletron.dataset.formats.token_store import TokenStore
from puzzletron.dataset.pipelines.text import build_batches
from puzzletron.dataset.tokenize import build_token_store
from puzzletron.fixtures.tampering import (
    REMOVE,
    edit_manifest,
    flip_bit,
    resign_store,
    shift_index,
    swap_files,
)

OPTIONS = TokenizeOptions(rows_per_shard=ROWS_PER_SHARD)


@pytest.fixture(scope="module")
def store_path(snapshot: Path, tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("stores") / "train"
    return build_token_store(snapshot, tokenizer=tokenizer_dir, output=out, options=OPTIONS)


@pytest.fixture
def store(store_path: Path, tmp_path: Path) -> Path:
    """A private copy of the clean store to damage."""
    return Path(shutil.copytree(store_path, tmp_path / "store"))


def _one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(exc.value)
    assert "\n" not in text and "Traceback" not in text, text
    return text


def _every_sample(path: Path) -> tuple[np.ndarray, np.ndarray]:
    opened = TokenStore(path)
    return opened.read(opened.offsets[:-1], opened.offsets[1:])


def _shard_start(path: Path, k: int) -> int:
    return json.loads((path / "manifest.json").read_text())["shards"][k]["tokens"][0]


# ----------------------------------------------------------------------------------- content: block checksums


@pytest.mark.parametrize(
    ("rel", "offset", "bit"),
    [("shards/000001.tokens", 301, 0), ("shards/000001.mask", 17, 3), ("shards/000001.tokens", -1, 7)],
    ids=["an-id-bit", "a-mask-bit", "the-last-byte"],
)
def test_a_flipped_bit_in_a_shard_is_refused_before_a_byte_of_its_block_is_served(
    store: Path, store_path: Path, rel: str, offset: int, bit: int
) -> None:
    flip_bit(store / rel, offset, bit)
    opened = TokenStore(store)  # sizes and manifest are intact: it opens
    clean = TokenStore(store_path)
    start, stop = _shard_start(store, 1), _shard_start(store, 2)
    assert np.array_equal(opened.read([0], [start])[0], clean.read([0], [start])[0])  # shard 0 is fine
    with pytest.raises(SnapshotError) as exc:
        opened.read([start], [stop])
    assert re.search(rf"{re.escape(rel)}: bytes \d+\.\.\d+ \(block \d+\) do not match", _one_line(exc))
    assert not formats.verify(store).ok


def test_two_shards_swapped_are_refused(store: Path) -> None:
    swap_files(store / "shards/000002.tokens", store / "shards/000003.tokens")
    with pytest.raises(SnapshotError) as exc:
        _every_sample(store)
    assert "shards/00000" in _one_line(exc)
    swap_files(store / "shards/000002.tokens", store / "shards/000003.tokens")
    swap_files(store / "shards/000002.mask", store / "shards/000003.mask")
    resign_store(store)  # the forger re-signs the files: the counts still say which shard is which
    with pytest.raises(SnapshotError, match=r"shards/00000[23]\.mask has \d+ bytes; its counts imply"):
        TokenStore(store)


def test_offsets_and_lengths_shifted_together_are_refused_before_the_index_is_used(store: Path) -> None:
    first_of_shard_1 = json.loads((store / "manifest.json").read_text())["shards"][1]["samples"][0]
    shift_index(store, first_of_shard_1 - 1)  # the last sample of shard 0 and the first of shard 1
    opened = TokenStore(store)
    with pytest.raises(SnapshotError) as exc:
        _ = opened.lengths
    assert re.search(
        r"index/(offsets\.i64|lengths\.u32): bytes 0\.\.\d+ \(block 0\) do not match", _one_line(exc)
    )
    with pytest.raises(SnapshotError, match="do not match"):
        _ = opened.offsets
    resign_store(store)  # re-signed and self-consistent: shard 1 no longer starts where its samples do
    with pytest.raises(SnapshotError) as exc:
        _ = TokenStore(store).offsets
    assert "the index: shard 1's token range" in _one_line(exc)


def test_a_cached_store_with_one_flipped_bit_yields_no_batch(
    snapshot: Path, tokenizer_dir: Path, tmp_path: Path
) -> None:
    spec = PuzzletronDataSpec.from_mapping(
        {
            "modality": "text",
            "layout": "packed_varlen",
            "max_sample_length": 4096,
            "packing": {"pack_size": 4096},
        }
    )

    def batches():
        return build_batches(
            snapshot, tokenizer=tokenizer_dir, spec=spec, batch_size=2, cache_dir=tmp_path, options=OPTIONS
        )

    clean = [b.fingerprint for b in batches()]
    (cached,) = [p for p in tmp_path.iterdir() if (p / "manifest.json").is_file()]
    flip_bit(cached / "shards/000004.tokens", 1000, 2)
    got = []
    with pytest.raises(SnapshotError, match=r"000004\.tokens: bytes .* do not match"):
        for batch in batches():  # the cache is reused; the damaged block is refused when first read
            got.append(batch.fingerprint)
    assert got == clean[: len(got)] and len(got) < len(clean)  # what was served before the error was clean


# ------------------------------------------------------------------------------------ the manifest, at open


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("pad_token_id", 10**6, "pad_token_id is 1000000; expected an integer 0..534"),
        ("pad_token_id", 1.9, "pad_token_id is 1.9; expected an integer"),
        ("pad_token_id", True, "pad_token_id is True; expected an integer"),
        ("pad_token_id", "zero", "pad_token_id is 'zero'; expected an integer"),
        ("pad_token_id", REMOVE, "keys ['pad_token_id'] are missing"),
        ("pad_token_id", None, "pad_token_id is missing; expected an integer"),
        ("vocab_size", "535", "vocab_size is '535'; expected an integer 1..4294967296"),
        ("vocab_size", None, "vocab_size is missing; expected an integer 1..4294967296"),
        ("vocab_size", 70_000, "token_dtype is 'uint16'; a vocabulary of 70000 is stored as 'uint32'"),
        ("shards.2.tokens", "shift7", "shards[2].tokens starts at"),
        ("counts.rows", 199, "counts.rows 199 is not samples + skipped"),
        ("counts.supervised_tokens", 10**12, "do not fit together"),
        ("identity.snapshot.rows", 64, "identity.snapshot.rows is 64; counts.rows is 200"),
        ("identity_sha256", "0" * 64, "is not the SHA-256 of its identity"),
        ("rows_per_shard", 64, "7 shards for 200 rows of 64 rows per shard"),
        ("block_checksums.block_size", 4096, "this code reads xxh3_64 blocks of 65536 bytes"),
        ("built_with", "by hand", "built_with is 'by hand'"),
        ("surplus", 1, "unexpected"),
    ],
)
def test_every_manifest_field_is_checked_at_open_and_by_verify(
    store: Path, key: str, value, says: str
) -> None:
    if value == "shift7":
        tokens = edit_manifest(store, key, None)
        value = [tokens[0] + 7, tokens[1] + 7]
    edit_manifest(store, key, value)
    if key == "identity.snapshot.rows":  # a pasted identity comes with its own hash
        identity = json.loads((store / "manifest.json").read_text())["identity"]
        edit_manifest(store, "identity_sha256", canonical_sha256(identity))
    with pytest.raises(SnapshotError) as exc:
        TokenStore(store)
    assert says in _one_line(exc)
    report = formats.verify(store)
    assert not report.ok and says in report.problems[0] and len(report.problems) == 1


def test_a_pasted_identity_of_another_split_is_not_reused(
    store: Path, snapshot: Path, tokenizer_dir: Path, tmp_path: Path
) -> None:
    other = build_token_store(
        snapshot, tokenizer=tokenizer_dir, output=tmp_path / "validation", split="validation", options=OPTIONS
    )
    foreign = json.loads((other / "manifest.json").read_text())
    edit_manifest(store, "identity", foreign["identity"])
    edit_manifest(store, "identity_sha256", foreign["identity_sha256"])
    with pytest.raises(SnapshotError) as exc:
        build_token_store(
            snapshot, tokenizer=tokenizer_dir, output=store, split="validation", options=OPTIONS
        )
    assert "identity.snapshot.rows is 24; counts.rows is 200 (an identity of other data)" in _one_line(exc)


def _paste_identity(store: Path, other: Path) -> None:
    """Copy `other`'s identity and its hash into `store`'s manifest (both self-consistent)."""
    foreign = json.loads((other / "manifest.json").read_text())
    edit_manifest(store, "identity", foreign["identity"])
    edit_manifest(store, "identity_sha256", foreign["identity_sha256"])


@pytest.mark.parametrize("case", ["equal rows: another tokenizer", "no rows: a plain save_to_disk split"])
def test_a_pasted_identity_with_equal_or_no_rows_is_refused_everywhere(
    store_path: Path, snapshot: Path, tokenizer_dir: Path, tmp_path: Path, case: str
) -> None:
    if case.startswith("equal rows"):  # the same split under another template: the same counts
        source, tok = snapshot, Path(shutil.copytree(tokenizer_dir, tmp_path / "tok"))
        (tok / "chat_template.jinja").write_text("{{ 'x' }}" + (tok / "chat_template.jinja").read_text())
        victim = Path(shutil.copytree(store_path, tmp_path / "victim"))
    else:  # a plain folder: its identity records no rows
        plain = tmp_path / "plain"
        datasets.load_from_disk(str(snapshot / "train")).save_to_disk(str(plain))
        source, tok = plain, tokenizer_dir
        victim = build_token_store(
            snapshot, tokenizer=tokenizer_dir, output=tmp_path / "victim", options=OPTIONS
        )
    other = build_token_store(source, tokenizer=tok, output=tmp_path / "other", options=OPTIONS)
    _paste_identity(victim, other)
    says = "content_sha256 does not bind identity_sha256 to the files this manifest records"
    with pytest.raises(SnapshotError, match=says):
        TokenStore(victim)  # not served
    report = formats.verify(victim)
    assert not report.ok and says in report.problems[0]
    with pytest.raises(SnapshotError, match=says):  # not reused: the build refuses the damaged store there
        build_token_store(source, tokenizer=tok, output=victim, options=OPTIONS)
    cache = tmp_path / "cache"
    shutil.copytree(victim, cache / "pasted")
    found = build_token_store(source, tokenizer=tok, cache_dir=cache, options=OPTIONS)
    assert found != cache / "pasted" and TokenStore(found).manifest == TokenStore(other).manifest


# -------------------------------------------------------------------------- a forger's index: consistency


def _forge_index(store: Path, rel: str, dtype: str, edit) -> None:
    values = np.fromfile(store / rel, dtype=dtype)
    edit(values)
    (store / rel).write_bytes(values.tobytes())
    resign_store(store)


@pytest.mark.parametrize(
    ("rel", "dtype", "edit", "says"),
    [
        (
            "index/offsets.i64",
            "<i8",
            lambda v: v.__setitem__(5, v[7]),
            "disagree (or a sample has < 2 tokens)",
        ),
        ("index/lengths.u32", "<u4", lambda v: v.__setitem__(5, v[5] + 3), "disagree"),
        ("index/offsets.i64", "<i8", lambda v: v.__setitem__(-1, v[-1] + 8), "runs from 0 to"),
    ],
    ids=["backwards-offsets", "lengths-disagree", "offsets-past-the-end"],
)
def test_a_forged_index_is_refused_before_its_first_use(
    store: Path, rel: str, dtype: str, edit, says: str
) -> None:
    _forge_index(store, rel, dtype, edit)
    opened = TokenStore(store)
    with pytest.raises(SnapshotError) as exc:
        _ = opened.offsets
    assert says in _one_line(exc) and "the index" in str(exc.value)
    assert not formats.verify(store).ok


def test_forged_id_offsets_and_bytes_are_one_line_errors_not_a_memory_error(store: Path) -> None:
    _forge_index(store, "index/ids.i64", "<i8", lambda v: v.__setitem__(3, 2**40))
    with pytest.raises(SnapshotError) as exc:
        TokenStore(store).sample_ids([3])
    assert "index/ids.i64: string 3 spans bytes 1099511627776.." in _one_line(exc)
    ids = np.fromfile(store / "index/ids.i64", dtype="<i8")
    assert TokenStore(store).sample_ids([0]) == TokenStore(store).sample_ids([0])  # others still read
    data = bytearray((store / "index/ids.bin").read_bytes())
    data[int(ids[1])] = 0xFF  # not UTF-8
    (store / "index/ids.bin").write_bytes(bytes(data))
    resign_store(store)
    with pytest.raises(SnapshotError) as exc:
        TokenStore(store).sample_ids([1])
    assert "index/ids.bin: string 1 is not UTF-8" in _one_line(exc)


# -------------------------------------------------------------------------------------------- pinned files


def test_a_store_replaced_under_a_running_reader_is_an_error_not_a_mix(
    store: Path, snapshot: Path, tokenizer_dir: Path, tmp_path: Path
) -> None:
    opened = TokenStore(store)
    first = _shard_start(store, 1)
    ids = opened.read([0], [first])[0]  # shard 0 is open
    other = build_token_store(
        snapshot,
        tokenizer=tokenizer_dir,
        output=tmp_path / "other",
        options=TokenizeOptions(rows_per_shard=ROWS_PER_SHARD, id_field=None),
    )
    shutil.rmtree(store)
    shutil.copytree(other, store)  # republished at the same path: same sizes, other files
    assert np.array_equal(opened.read([0], [first])[0], ids)  # what is open keeps serving the old store
    with pytest.raises(SnapshotError) as exc:
        opened.read([first], [first + 10])  # shard 1 was never opened: it is not the pinned file
    assert re.search(r"shards/000001\.(tokens|mask): the file was replaced or changed since", _one_line(exc))
    assert TokenStore(store).read([first], [first + 10])[0].size == 10  # a new reader reads the new store


def test_damaged_offsets_are_a_data_error_naming_the_file_not_a_usage_error(store: Path) -> None:
    flip_bit(store / "index/offsets.i64", 80, 1)
    spec = PuzzletronDataSpec.from_mapping(
        {
            "modality": "text",
            "layout": "packed_varlen",
            "max_sample_length": 4096,
            "packing": {"pack_size": 4096},
        }
    )
    with pytest.raises(SnapshotError) as exc:  # a SnapshotError: the CLI exits 1 (not 2, "usage")
        list(build_batches(store, spec=spec, batch_size=2))
    assert "index/offsets.i64: bytes 0.." in _one_line(exc)
