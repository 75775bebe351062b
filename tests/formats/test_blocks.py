"""Block checksums (`formats.blocks`): the same checksums for any chunking of the writes, each block verified
once per reader (a counted source), a damaged block refused by name before its bytes are served."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.formats.blocks import BLOCK_SIZE, READAHEAD, BlockChecks, BlockHasher, block_sums
from puzzletron.dataset.storage import LocalFiles


@settings(max_examples=50, deadline=None)
@given(st.binary(max_size=200), st.lists(st.integers(0, 60), max_size=8))
def test_streamed_checksums_equal_the_checksums_of_the_whole(data: bytes, cuts: list[int]) -> None:
    hasher = BlockHasher(block_size=16)
    at = 0
    for cut in [*cuts, len(data)]:
        hasher.update(data[at : at + cut])
        at = min(at + cut, len(data))
    hasher.update(data[at:])
    reference = [xxhash.xxh3_64_intdigest(data[a : a + 16]) for a in range(0, len(data), 16)]  # independent
    assert hasher.finish().tolist() == reference == block_sums(data, 16).tolist()


class _Counted(LocalFiles):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.reads: list[tuple[str, int, int]] = []

    def read_into(self, rel: str, offset: int, out: np.ndarray) -> None:
        self.reads.append((rel, offset, out.nbytes))
        super().read_into(rel, offset, out)


def test_each_block_is_verified_once_in_aligned_groups_and_damage_is_named(tmp_path: Path) -> None:
    size = BLOCK_SIZE * (READAHEAD + 3) + 100
    data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes()
    (tmp_path / "f.bin").write_bytes(data)
    (tmp_path / "g.bin").write_bytes(b"tiny")
    sums = np.concatenate([block_sums(data), block_sums(b"tiny")])
    source = _Counted(tmp_path)
    checks = BlockChecks(source, [("f.bin", size), ("g.bin", 4)], sums, where="store")
    checks.ensure_range("f.bin", BLOCK_SIZE * READAHEAD + 5, BLOCK_SIZE * READAHEAD + 9)
    assert source.reads == [
        ("f.bin", BLOCK_SIZE * READAHEAD, size - BLOCK_SIZE * READAHEAD)
    ]  # the last group
    checks.ensure_range("f.bin", size - 10, size)
    checks.ensure_file("g.bin")
    assert len(source.reads) == 2 and checks.verified[READAHEAD:].all() and not checks.verified[0]
    damaged = bytearray(data)
    damaged[BLOCK_SIZE * 2 + 7] ^= 1
    (tmp_path / "f.bin").write_bytes(bytes(damaged))
    fresh = BlockChecks(LocalFiles(tmp_path), [("f.bin", size), ("g.bin", 4)], sums, where="store")
    out = np.empty(10, np.uint8)
    with pytest.raises(
        SnapshotError, match=rf"store: f\.bin: bytes {2 * BLOCK_SIZE}\.\.{3 * BLOCK_SIZE} \(block 2\)"
    ):
        fresh.read_into("f.bin", 0, out)
    with pytest.raises(SnapshotError, match="2 block checksums for files of"):
        BlockChecks(source, [("f.bin", size)], sums[:2], where="store")
