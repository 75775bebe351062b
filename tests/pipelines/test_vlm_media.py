"""The pixel path over a subset whose images are in media shards: the same batches as the one-file-per-
image layout (the same fingerprints, in one process and through loader workers), images read by their
ranges with their SHA-256 checked; a changed shard byte is an error naming the image."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from _vlm_data import vlm_samples
from puzzletron.dataset.config import PuzzletronDataSpec
from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.formats.media_shards._layout import ENTRY, INDEX, shard_name
from puzzletron.dataset.formats.subset import materialize_normalized_conversation_samples
from puzzletron.dataset.pipelines.vlm import build_vlm_batches
from puzzletron.dataset.tokenize import build_vlm_store

SPEC = PuzzletronDataSpec.from_mapping(
    {
        "modality": "multimodal",
        "layout": "packed_varlen",
        "max_sample_length": 512,
        "packing": {"pack_size": 512},
    }
)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, processor_dirs: dict[str, Path]) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sharded")
    subset = root / "subset"
    materialize_normalized_conversation_samples(
        iter(vlm_samples(40)), subset, media="shards", shard_bytes=64 << 10
    )
    store = build_vlm_store(
        subset, processor=processor_dirs["qwen2_5_vl"], output=root / "store", rows_per_shard=16
    )
    return {"subset": subset, "store": store}


def _batches(store: Path, subset: Path, processor: Path, **kwargs):
    return build_vlm_batches(
        store, processor=processor, subset=subset, spec=SPEC, batch_size=2, seed=1, **kwargs
    )


def test_media_shards_give_the_batches_of_one_file_per_image(
    sharded, vlm_stores, vlm_subset, processor_dirs
) -> None:
    processor = processor_dirs["qwen2_5_vl"]
    files = [b.fingerprint for b in _batches(vlm_stores["qwen2_5_vl"], vlm_subset, processor)]
    shards = _batches(sharded["store"], sharded["subset"], processor)
    assert [b.fingerprint for b in shards] == files
    assert [b.fingerprint for b in shards.loader(num_workers=2)] == files


def test_a_changed_shard_byte_is_an_error_naming_the_image(sharded, processor_dirs, tmp_path) -> None:
    import shutil

    subset = shutil.copytree(sharded["subset"], tmp_path / "subset")
    batches = _batches(sharded["store"], subset, processor_dirs["qwen2_5_vl"])
    entry = np.fromfile(subset / INDEX, ENTRY)[0]
    shard = subset / shard_name(int(entry["shard"]))
    raw = bytearray(shard.read_bytes())
    raw[int(entry["offset"]) + 3] ^= 1  # the same size: only the image's SHA-256 tells
    shard.write_bytes(bytes(raw))
    with pytest.raises(
        SnapshotError, match=r"media image 0 \(media/shards/\d+\.bin bytes 0\.\.\d+\) does not match"
    ):
        list(batches)
