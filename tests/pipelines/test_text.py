"""`build_batches`, snapshot + tokenizer + spec -> batches: hand-checked goldens of the packed, padded and
fixed layouts (labels never cross a document boundary), dealing to DP ranks from a snapshot folder; and from
a token store: batches identical to the in-memory path, no tokenizer needed, a snapshot + cache directory
tokenised once then reused, batches unchanged through DataLoader workers, and a rank that holds the index,
never the tokens."""

from __future__ import annotations

import logging
import pickle
import re
import shutil
from pathlib import Path

import datasets
import pytest

from _chat_rows import IDS_A, IDS_B, LABELS_A, LABELS_B, ROWS, X
from _token_store_data import ROWS_PER_SHARD, SKIPPED_ROWS, TRAIN_ROWS
from puzzletron.dataset.batch import DataLayout, PuzzletronBatch
from puzzletron.dataset.config import PackingSpec, PuzzletronDataSpec, TokenizeOptions
from puzzletron.dataset.errors import ConfigError, SubsetError
from puzzletron.dataset.formats.text_snapshot import load_text_split
from puzzletron.dataset.formats.token_store import TokenStore
from puzzletron.dataset.pipelines.text import TextBatches, build_batches
from puzzletron.dataset.tokenize import store as build_store
from puzzletron.dataset.tokenize.store import build_token_store

# ------------------------------------------------------------------ snapshot + tokenizer + spec -> batches


def _only_batch(batches) -> PuzzletronBatch:
    (batch,) = list(batches)
    return batch


def test_build_batches_packed_golden_labels_never_cross_the_document_boundary(tokenizer_dir: Path):
    spec = PuzzletronDataSpec("text", "packed_varlen", 40, PackingSpec(pack_size=40))
    batches = build_batches(ROWS, tokenizer=tokenizer_dir, spec=spec, batch_size=1, shuffle=False)
    assert batches.plan is not None and batches.plan.rows == ((0, 1),) and len(batches) == 1
    batch = _only_batch(batches)
    assert batch.layout is DataLayout.PACKED_VARLEN
    assert batch.input_ids.tolist() == [IDS_A + IDS_B + [0] * 9]
    # Position 15 is the last token of a ("\n"); the next token, position 16, is b's <|im_start|>. Its
    # label is -100: a document never predicts the next one.
    expected = [X] * 11 + [63, 291, 2, X, X] + [X] * 11 + [53, 2, X, X] + [X] * 9
    assert batch.labels.tolist() == [expected]
    assert batch.sequence.seq_ids.tolist() == [[0] * 16 + [1] * 15 + [-1] * 9]
    assert batch.sequence.global_cu_seqlens.tolist() == [0, 16, 31]
    assert batch.model_kwargs["position_ids"].tolist() == [list(range(16)) + list(range(15)) + [0] * 9]
    assert batch.sample_ids == ("a|b",)


@pytest.mark.parametrize(("multiple", "width"), [(1, 16), (12, 24)])
def test_build_batches_padded_golden(tokenizer_dir: Path, multiple: int, width: int):
    spec = PuzzletronDataSpec("text", "padded_varlen", 64)
    batches = build_batches(
        ROWS, tokenizer=tokenizer_dir, spec=spec, batch_size=2, shuffle=False, pad_to_multiple_of=multiple
    )
    batch = _only_batch(batches)
    assert batch.layout is DataLayout.PADDED_VARLEN
    assert batch.input_ids.tolist() == [IDS_A + [0] * (width - 16), IDS_B + [0] * (width - 15)]
    assert batch.labels.tolist() == [LABELS_A + [X] * (width - 16), LABELS_B + [X] * (width - 15)]
    assert batch.model_kwargs["attention_mask"].tolist() == [
        [1] * 16 + [0] * (width - 16),
        [1] * 15 + [0] * (width - 15),
    ]
    assert batch.sample_ids == ("a", "b")


def _fixed_batch(tokenizer_dir: Path, max_sample_length: int) -> PuzzletronBatch:
    spec = PuzzletronDataSpec("text", "fixed", max_sample_length)
    return _only_batch(build_batches(ROWS, tokenizer=tokenizer_dir, spec=spec, batch_size=2, shuffle=False))


def test_build_batches_fixed_golden_truncates_and_pads_to_max_sample_length(tokenizer_dir: Path):
    short = _fixed_batch(tokenizer_dir, 12)
    assert short.layout is DataLayout.FIXED
    assert short.input_ids.tolist() == [IDS_A[:12], IDS_B[:12]]
    # Truncated: the kept tokens keep their true targets (the "\n" before the reply still predicts it).
    assert short.labels.tolist() == [[X] * 11 + [63], [X] * 11 + [53]]
    long = _fixed_batch(tokenizer_dir, 18)
    assert long.input_ids.tolist() == [[*IDS_A, 0, 0], [*IDS_B, 0, 0, 0]]
    assert long.labels.tolist() == [[*LABELS_A, X, X], [*LABELS_B, X, X, X]]


def test_build_batches_deals_to_dp_ranks_and_reads_a_snapshot_folder(tokenizer_dir: Path, tmp_path: Path):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "snap" / "train"))
    spec = PuzzletronDataSpec("text", "fixed", 16)
    ranks = [
        build_batches(
            tmp_path / "snap", tokenizer=tokenizer_dir, spec=spec, batch_size=1, dp_rank=r, dp_size=2, seed=3
        )
        for r in range(2)
    ]
    assert sorted(b.sample_ids[0] for r in ranks for b in r) == ["a", "b"]
    assert [b.fingerprint for b in ranks[0].for_rank(1)] == [b.fingerprint for b in ranks[1]]
    assert [b.fingerprint for b in ranks[0].loader(num_workers=0)] == [b.fingerprint for b in ranks[0]]
    assert len(load_text_split(tmp_path / "snap")) == 2
    with pytest.raises(SubsetError, match="does not exist"):
        load_text_split(tmp_path / "missing")


def test_build_batches_rejects_a_multimodal_spec(tokenizer_dir: Path):
    spec = PuzzletronDataSpec("multimodal", "fixed", 16)
    with pytest.raises(ValueError, match=r"data\.modality is multimodal"):
        build_batches(ROWS, tokenizer=tokenizer_dir, spec=spec, batch_size=1)


def test_a_vlm_store_or_subset_is_named_and_sent_to_build_vlm_batches(
    tokenizer_dir: Path, vlm_stores: dict[str, Path], vlm_subset: Path
) -> None:
    """Before: "tokenizer is required to tokenise ... (not a token store)", as if a tokenizer would help."""
    spec = PuzzletronDataSpec("text", "fixed", 16)
    for source, kind in ((vlm_stores["qwen2_5_vl"], "vlm-store"), (vlm_subset, "conversation-subset")):
        for tokenizer in (None, tokenizer_dir):
            with pytest.raises(ConfigError, match=rf"is a puzzletron-{kind}: build_vlm_batches reads it"):
                build_batches(source, tokenizer=tokenizer, spec=spec, batch_size=1)


def test_a_spec_may_be_a_data_mapping(tokenizer_dir: Path) -> None:
    raw = {
        "modality": "text",
        "layout": "packed_varlen",
        "max_sample_length": 64,
        "packing": {"pack_size": 64},
    }
    spec = PuzzletronDataSpec.from_mapping(raw)
    given = build_batches(ROWS, tokenizer=tokenizer_dir, spec=raw, batch_size=1)
    assert [b.fingerprint for b in given] == [
        b.fingerprint for b in build_batches(ROWS, tokenizer=tokenizer_dir, spec=spec, batch_size=1)
    ]
    with pytest.raises(ConfigError, match=r"build_batches: spec must be a PuzzletronDataSpec or a data"):
        build_batches(ROWS, tokenizer=tokenizer_dir, spec=None, batch_size=1)


# -------------------------------------------------------------------------------------- from a token store


SPECS = {
    "packed": PuzzletronDataSpec("text", "packed_varlen", 1024, PackingSpec(1024)),
    "packed-truncate": PuzzletronDataSpec(
        "text", "packed_varlen", 512, PackingSpec(512, long_samples="truncate")
    ),
    "packed-split": PuzzletronDataSpec("text", "packed_varlen", 256, PackingSpec(256, long_samples="split")),
    "padded": PuzzletronDataSpec("text", "padded_varlen", 700),
    "fixed": PuzzletronDataSpec("text", "fixed", 300),  # shorter than many samples: truncation labels
}


@pytest.fixture(scope="module")
def store(snapshot: Path, tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("stores") / "store"
    return build_token_store(
        snapshot, tokenizer=tokenizer_dir, output=out, options=TokenizeOptions(rows_per_shard=ROWS_PER_SHARD)
    )


def _fingerprints(batches: TextBatches) -> list[str]:
    return [batch.fingerprint for rank in range(batches.sampler.dp_size) for batch in batches.for_rank(rank)]


def _retokenizer(tokenizer_dir: Path, out: Path) -> Path:
    """The fixture tokenizer with another chat template: another tokenizer identity, the same vocabulary."""
    out = Path(shutil.copytree(tokenizer_dir, out))
    (out / "chat_template.jinja").write_text("{{ 'Be brief.' }}" + (out / "chat_template.jinja").read_text())
    return out


@pytest.mark.parametrize(
    ("asked", "says"),
    [
        ({"split": "validation"}, "holds split 'train', not the split 'validation' asked for"),
        ({"split": "no-such-split"}, "holds split 'train', not the split 'no-such-split' asked for"),
        ({"tokenizer": "nonexistent/"}, "nonexistent is not a directory"),
        ({"tokenizer": "other"}, "was built with another tokenizer than "),
    ],
)
def test_a_split_or_tokenizer_that_is_not_the_stores_is_an_error_naming_both(
    store: Path, tokenizer_dir: Path, tmp_path: Path, asked: dict, says: str
) -> None:
    if asked.get("tokenizer") == "other":
        asked = {"tokenizer": _retokenizer(tokenizer_dir, tmp_path / "other")}
    with pytest.raises(ConfigError, match=re.escape(says)) as exc:
        build_batches(store, spec=SPECS["packed"], batch_size=2, **asked)
    assert str(store) in str(exc.value) and "\n" not in str(exc.value)
    same = build_batches(store, spec=SPECS["packed"], batch_size=2, split="train", tokenizer=tokenizer_dir)
    assert same.tokenized.samples.store.path == store  # said, and the store's: served


def test_another_tokenizers_store_is_found_through_the_cache_dir(
    store: Path, snapshot: Path, tokenizer_dir: Path, tmp_path: Path
) -> None:
    other = _retokenizer(tokenizer_dir, tmp_path / "other")
    options = TokenizeOptions(rows_per_shard=ROWS_PER_SHARD)
    built = build_token_store(snapshot, tokenizer=other, cache_dir=tmp_path / "cache", options=options)
    found = build_batches(
        store, tokenizer=other, spec=SPECS["packed"], batch_size=2, cache_dir=tmp_path / "cache"
    )
    assert found.tokenized.samples.store.path == built


@pytest.mark.parametrize("name", sorted(SPECS))
def test_batches_from_a_store_are_identical_to_the_in_memory_ones(
    name: str, snapshot: Path, tokenizer_dir: Path, store: Path
) -> None:
    spec = SPECS[name]
    options = {"spec": spec, "batch_size": 3, "dp_size": 2, "seed": 5}
    in_memory = build_batches(snapshot, tokenizer=tokenizer_dir, **options)
    from_store = build_batches(store, **options)  # no tokenizer: the store has the tokens
    assert _fingerprints(from_store) == _fingerprints(in_memory)
    assert len(_fingerprints(from_store)) >= 4
    assert from_store.tokenized.skipped == in_memory.tokenized.skipped == len(SKIPPED_ROWS)
    assert from_store.tokenized.skipped_ids == in_memory.tokenized.skipped_ids
    assert from_store.tokenized.pad_token_id == in_memory.tokenized.pad_token_id
    if spec.packing is not None:
        assert from_store.plan.summary() == in_memory.plan.summary()


def test_split_pieces_cover_every_supervised_token_of_the_long_samples(store: Path) -> None:
    batches = build_batches(store, spec=SPECS["packed-split"], batch_size=4, seed=0)
    assert batches.plan.cut_samples > 0
    names = [d for b in batches for d in b.source_metadata["document_ids"]]
    assert any("#1" in name for name in names)  # a second piece exists
    # Every stored token of the split is in exactly one piece of one batch.
    assert sum(int(b.hidden_mask.sum()) for b in batches) == TokenStore(store).num_tokens


def test_a_snapshot_with_a_cache_dir_is_tokenised_once_then_reused(
    snapshot: Path, tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = SPECS["packed"]
    first = build_batches(snapshot, tokenizer=tokenizer_dir, spec=spec, batch_size=2, cache_dir=tmp_path)
    (built,) = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert TokenStore(built).manifest["counts"]["samples"] == TRAIN_ROWS - len(SKIPPED_ROWS)

    def no_tokenising(*args: object, **kwargs: object) -> None:
        raise AssertionError("the store should have been reused")

    monkeypatch.setattr(build_store, "tokenize_rows", no_tokenising)
    again = build_batches(snapshot, tokenizer=tokenizer_dir, spec=spec, batch_size=2, cache_dir=tmp_path)
    assert [b.fingerprint for b in again] == [b.fingerprint for b in first]


def test_store_batches_come_through_dataloader_workers_unchanged(store: Path) -> None:
    batches = build_batches(store, spec=SPECS["packed"], batch_size=2, seed=1)
    assert [b.fingerprint for b in batches.loader(num_workers=2)] == [b.fingerprint for b in batches]
    assert pickle.loads(pickle.dumps(batches.dataset))[batches.sampler.key(0)] == next(iter(batches))


def test_a_rank_holds_the_index_never_the_tokens(store: Path) -> None:
    samples = build_batches(store, spec=SPECS["packed"], batch_size=2).tokenized.samples
    assert not hasattr(samples, "input_ids")  # tokens are read per batch from the shards
    assert samples.lengths.dtype.name == "uint32" and samples.lengths.shape == (len(samples),)


def test_a_snapshot_without_a_tokenizer_or_rows_with_a_cache_dir_are_errors(
    snapshot: Path, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match="tokenizer is required"):
        build_batches(snapshot, spec=SPECS["packed"], batch_size=1)
    with pytest.raises(ConfigError, match="cache_dir needs a snapshot folder"):
        build_batches(
            [{"messages": []}], tokenizer="unused", spec=SPECS["packed"], batch_size=1, cache_dir=tmp_path
        )


# ------------------------------------------------------------------------------------- what rank 0 logs

LOGGER = "puzzletron.dataset.pipelines.text"


def _messages(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOGGER]


def test_the_plan_drops_are_logged_once_on_rank_0(
    tokenizer_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """a has 16 tokens, b 15: a pack of 15 drops a, 16 of the 31 tokens (51.6 %)."""
    spec = PuzzletronDataSpec("text", "packed_varlen", 15, PackingSpec(pack_size=15))
    caplog.set_level(logging.INFO, logger=LOGGER)
    build_batches(ROWS, tokenizer=tokenizer_dir, spec=spec, batch_size=1, dp_rank=1, dp_size=2)
    assert _messages(caplog) == []  # another rank says nothing
    build_batches(ROWS, tokenizer=tokenizer_dir, spec=spec, batch_size=1, dp_rank=0, dp_size=2)
    messages = _messages(caplog)
    assert messages[0][0] == logging.INFO and messages[0][1].startswith("tokenised 2 rows in memory in ")
    assert messages[1:] == [
        (logging.INFO, "packed 15 tokens of 1 samples into 1 rows of 15 (lower bound 1), efficiency 100.00%"),
        (
            logging.WARNING,
            "dropped 1 of 2 samples longer than pack_size 15: 16 tokens, 51.6% of the split's tokens "
            "(data.packing.long_samples: truncate or split keeps them)",
        ),
    ]
    caplog.clear()
    truncate = PuzzletronDataSpec("text", "packed_varlen", 15, PackingSpec(15, long_samples="truncate"))
    build_batches(ROWS, tokenizer=tokenizer_dir, spec=truncate, batch_size=1)
    assert _messages(caplog)[-1] == (
        logging.WARNING,
        "truncated 1 of 2 samples longer than pack_size 15: 1 tokens cut, 3.2% of the split's tokens",
    )


def test_building_a_store_logs_its_progress_and_a_reuse_says_so(
    snapshot: Path, tokenizer_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    spec = SPECS["padded"]
    build_batches(snapshot, tokenizer=tokenizer_dir, spec=spec, batch_size=2, cache_dir=tmp_path)
    built = [m for _, m in _messages(caplog)]
    rows = f"{TRAIN_ROWS:,}"
    assert built[0] == f"tokenising {snapshot} [train] into a token store: 0/{rows} rows (0%)"
    assert built[-2] == f"tokenising {snapshot} [train] into a token store: {rows}/{rows} rows (100%)"
    assert built[-1].startswith(f"token store {tmp_path}") and " built in " in built[-1]
    caplog.clear()
    build_batches(snapshot, tokenizer=tokenizer_dir, spec=spec, batch_size=2, cache_dir=tmp_path)
    assert [m for _, m in _messages(caplog)] == [f"reusing token store {built[-1].split()[2]}"]


def test_under_a_process_group_its_rank_0_reports(
    tokenizer_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import torch.distributed as dist

    caplog.set_level(logging.INFO, logger=LOGGER)
    spec = PuzzletronDataSpec("text", "padded_varlen", 64)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        build_batches(ROWS, tokenizer=tokenizer_dir, spec=spec, batch_size=1, dp_rank=1, dp_size=2)
    finally:
        dist.destroy_process_group()
    assert len(_messages(caplog)) == 1  # the process group's rank 0, whatever dp_rank says


# ------------------------------------------------------------------------------- a store on object storage


def _rank_reads(url: str, rank: int, out) -> None:
    spec = PuzzletronDataSpec(
        "text", "packed_varlen", 4096, PackingSpec(pack_size=4096, long_samples="split")
    )
    batches = build_batches(url, spec=spec, batch_size=2, dp_rank=rank, dp_size=2, seed=3)
    loader = batches.loader(num_workers=1)
    out.put((rank, [batch.fingerprint for batch in batches], [batch.fingerprint for batch in loader]))


def test_two_ranks_read_a_store_at_an_url_as_they_read_it_on_disk(
    snapshot: Path, tokenizer_dir: Path, tmp_path: Path, bucket: str
) -> None:
    import multiprocessing

    options = TokenizeOptions(rows_per_shard=ROWS_PER_SHARD)
    url = build_token_store(snapshot, tokenizer=tokenizer_dir, output=f"{bucket}/pk", options=options)
    local = build_token_store(snapshot, tokenizer=tokenizer_dir, output=tmp_path / "pk", options=options)
    spec = PuzzletronDataSpec(
        "text", "packed_varlen", 4096, PackingSpec(pack_size=4096, long_samples="split")
    )
    want = {
        r: [
            b.fingerprint for b in build_batches(local, spec=spec, batch_size=2, dp_rank=r, dp_size=2, seed=3)
        ]
        for r in (0, 1)
    }
    fork = multiprocessing.get_context("fork")
    out = fork.Queue()
    ranks = [fork.Process(target=_rank_reads, args=(url, r, out)) for r in (0, 1)]
    for p in ranks:
        p.start()
    got = {rank: (direct, loaded) for rank, direct, loaded in (out.get(timeout=120) for _ in ranks)}
    for p in ranks:
        p.join(60)
    assert [p.exitcode for p in ranks] == [0, 0]
    assert {r: got[r][0] for r in (0, 1)} == want == {r: got[r][1] for r in (0, 1)}
    assert want[0] and set(want[0]).isdisjoint(want[1])
    with pytest.raises(SubsetError, match="not a token store or a text snapshot; build_batches reads those"):
        build_batches(f"{bucket}/nothing", spec=spec, batch_size=2)


def test_a_snapshot_at_an_url_gives_the_batches_of_its_folder(
    snapshot: Path, tokenizer_dir: Path, tmp_path: Path, bucket: str
) -> None:
    from puzzletron.dataset.storage.objects import Objects

    url = f"{bucket}/snapshots/pk"
    Objects(url).upload(snapshot)
    spec = SPECS["packed"]

    def prints(source, cache_dir) -> list[str]:
        batches = build_batches(source, tokenizer=tokenizer_dir, spec=spec, batch_size=2, cache_dir=cache_dir)
        return [batch.fingerprint for batch in batches]

    want = prints(snapshot, tmp_path / "local")
    assert want and prints(url, tmp_path / "from-url") == want  # a token store built from the node's copy
    assert prints(url, f"{bucket}/stores") == want  # ... and built at an URL: everything on object storage
    assert prints(url, None) == want  # tokenised in memory from the copy
    assert sorted(p.name for p in (tmp_path / "from-url").iterdir()) == sorted(
        p.name for p in (tmp_path / "local").iterdir()
    )  # the same identity: the same store name
