"""A subset or a text snapshot at an URL is verified and described from a local copy of only the files its
manifest lists, each at its recorded size: an object nobody listed is never fetched (an unlisted one where
the format allows none is reported), and a listed object of another size is reported unread."""

from __future__ import annotations

from pathlib import Path

import pytest

from _vlm_data import make_subset
from puzzletron.dataset import formats
from puzzletron.dataset.storage.objects import Objects

JUNK = 3 << 20  # stands for the 300 MiB object of the report: never fetched, whatever its size


@pytest.fixture
def subset(tmp_path: Path) -> Path:
    return make_subset(tmp_path / "subset", 6)


@pytest.fixture
def url(bucket: str, subset: Path) -> str:
    """The subset uploaded to ``s3://bkt/subsets/vlm``."""
    url = f"{bucket}/subsets/vlm"
    Objects(url).upload(subset)
    return url


def test_a_subset_at_an_url_fetches_only_what_its_manifest_lists(
    url: str, subset: Path, fetched: list[tuple[str, str]]
) -> None:
    objects = Objects(url)
    objects.put_bytes("junk/big.bin", b"\0" * JUNK)  # under the prefix, outside what the format names
    report = formats.verify(url)
    assert report.ok, report.problems
    assert formats.describe(url)["sample_count"] == 6
    assert not [path for _, path in fetched if "junk" in path]
    listed = {p.relative_to(subset).as_posix() for p in subset.rglob("*") if p.is_file()}
    assert {path.split("/subsets/vlm/", 1)[1] for _, path in fetched} == listed - {"manifest.json"}  # ranged


def test_an_unlisted_image_or_a_listed_one_of_another_size_is_reported_never_fetched(
    url: str, subset: Path, fetched: list[tuple[str, str]]
) -> None:
    objects = Objects(url)
    image = sorted(p for p in (subset / "images").iterdir())[0].relative_to(subset).as_posix()
    objects.put_bytes(image, b"x" * (JUNK + 1))  # replaced by something of another size
    objects.put_bytes("images/stray.png", b"\0" * JUNK)
    said = "\n".join(formats.verify(url).problems)
    assert f"{url}/{image} has {JUNK + 1} bytes, the manifest records" in said
    assert f"{url}/images/stray.png: unexpected object not in the manifest ({JUNK} bytes" in said
    assert not [path for _, path in fetched if path.endswith(("stray.png", image))]


def test_a_text_snapshot_at_an_url_holds_exactly_its_files(
    snapshot: Path, bucket: str, fetched: list[tuple[str, str]]
) -> None:
    url = f"{bucket}/snapshots/pk"
    objects = Objects(url)
    objects.upload(snapshot)
    assert formats.verify(url).ok
    objects.put_bytes("train/extra.arrow", b"\0" * JUNK)
    problems = formats.verify(url).problems
    assert problems == (f"{url}/train/extra.arrow: unexpected object not in the manifest ({JUNK} bytes, not "
                        "fetched)",)  # fmt: skip
    assert not [path for _, path in fetched if "extra" in path]
