"""What finding a token store by its identity under a cache directory costs a rank (`tokenize.cache`).

    .venv/bin/python benchmarks/bench_store_lookup.py                   # 16 stores of 700 shards each
    .venv/bin/python benchmarks/bench_store_lookup.py --stores 64 --shards 700

A real store of ``--shards`` shards (one row each: a manifest as long as a 45B-token store's, which has
~700 shards of 65,536 rows) is built once with the fixture tokenizer; the cache directory then holds it
under a user-chosen name (``puzzletron-data tokenize --output stores/<name>``) beside ``--stores - 1``
copies of other identities. Timed, medians of ``--repeats``:

- ``hashed``: the store sits at ``<cache>/<identity hash>`` (where a cache build puts it): one manifest is
  read, the store's files are checked (sizes);
- ``named``: it sits under a user-chosen name, last in the walk: every manifest is read and parsed once;
- ``absent``: no store of the identity: the whole walk, then the caller builds one.

Every rank of a job does this once at start; after the first rank the manifests come from the page cache.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import datasets

from puzzletron.dataset.config import TokenizeOptions
from puzzletron.dataset.formats import MANIFEST
from puzzletron.dataset.formats.text_snapshot import open_split
from puzzletron.dataset.tokenize import build_token_store, find_store, short_hash, store_identity
from puzzletron.fixtures.tokenizer import build_chat_tokenizer


def _time(call, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stores", type=int, default=16, help="stores in the cache directory")
    parser.add_argument("--shards", type=int, default=700, help="shards of each store (700: ~45B tokens)")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats (median)")
    args = parser.parse_args()
    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rows = [
            {
                "uuid": f"r{i}",
                "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}],
            }
            for i in range(args.shards)
        ]
        datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(root / "snap"))
        tok = build_chat_tokenizer(root / "tok")
        options = TokenizeOptions(rows_per_shard=1)
        built = build_token_store(root / "snap", tokenizer=tok, output=root / "built", options=options)
        identity = store_identity(open_split(root / "snap"), tokenizer=tok, options=options)
        cache = root / "cache"
        for i in range(args.stores - 1):  # other identities: their manifests differ in the identity only
            other = shutil.copytree(built, cache / f"other-{i:03d}")
            manifest = json.loads((other / MANIFEST).read_text())
            manifest["identity"]["options"]["messages_field"] = f"other-{i}"
            manifest["identity_sha256"] = f"{i:064x}"
            (other / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
        named = shutil.copytree(built, cache / "zz-puzzle-kd")
        size = (named / MANIFEST).stat().st_size
        print(f"{args.stores} stores of {args.shards} shards, manifests of {size / 2**20:.2f} MiB")
        assert find_store(cache, identity) == named
        print(f"  named   {_time(lambda: find_store(cache, identity), args.repeats) * 1e3:8.1f} ms")
        absent = {**identity, "version": -1}
        print(f"  absent  {_time(lambda: find_store(cache, absent), args.repeats) * 1e3:8.1f} ms")
        named.rename(cache / short_hash(identity))
        assert find_store(cache, identity) == cache / short_hash(identity)
        print(f"  hashed  {_time(lambda: find_store(cache, identity), args.repeats) * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
