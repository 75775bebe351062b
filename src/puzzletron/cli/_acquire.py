"""`puzzletron-data materialize puzzle-kd|nemotron-vlm|intersyn` and `puzzletron-data hub serve|fixtures`.

``materialize`` takes one flag per spec field, shows progress bars on stderr (only when stderr is a
terminal and ``--quiet`` is not given) and prints one JSON line on stdout::

    {"status": "done" | "reused", "adapter": ..., "output": DIR, "manifest": DIR/manifest.json}

Exit codes: 0 done or reused, 1 a data error (Hub unreachable, mismatch with an existing snapshot,
shortfall), 2 usage (bad flags or spec fields).

``hub fixtures DIR`` writes the fixture repositories; ``hub serve DIR`` serves ``DIR/mirrors`` with the
Hub API on loopback (olah), prints the endpoint and runs until interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["register"]

_PROGRESS_LOGGER = "puzzletron.dataset.acquisition.progress"


class _ProgressHandler(logging.Handler):
    """Turns the acquisition's DEBUG progress records into one tqdm bar per stage on stderr."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.bars: dict[str, Any] = {}

    def emit(self, record: logging.LogRecord) -> None:
        progress = getattr(record, "progress", None)
        if progress is None:
            return
        from tqdm import tqdm

        stage, advance, total = progress
        bar = self.bars.get(stage)
        if bar is None:
            bar = self.bars[stage] = tqdm(total=total, desc=stage, unit="row", file=sys.stderr, leave=True)
        bar.update(advance)

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()
        super().close()


def _show_progress(args: argparse.Namespace) -> bool:
    return not args.quiet and sys.stderr.isatty()


def _run(args: argparse.Namespace, adapter: str, manifest_name: str, call: Callable[[], Any]) -> int:
    from puzzletron.dataset import _hub
    from puzzletron.dataset.errors import ConfigError, PuzzletronDataError

    output = Path(args.output)
    existed = output.is_dir() and any(output.iterdir())
    show = _show_progress(args)
    _hub.set_progress_bars(show)
    logger = logging.getLogger(_PROGRESS_LOGGER)
    handler = _ProgressHandler() if show else None
    old_level, old_propagate = logger.level, logger.propagate
    if handler is not None:
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
        logger.propagate = False  # progress records feed the bars only, never the log
    try:
        call()
    except ConfigError as exc:
        print(f"puzzletron-data materialize {args.dataset}: {exc}", file=sys.stderr)
        return 2
    except (PuzzletronDataError, ValueError, OSError) as exc:
        print(f"puzzletron-data materialize {args.dataset}: {exc}", file=sys.stderr)
        return 1
    finally:
        if handler is not None:
            logger.removeHandler(handler)
            logger.setLevel(old_level)
            logger.propagate = old_propagate
            handler.close()
    line = {
        "status": "reused" if existed else "done",
        "adapter": adapter,
        "output": str(output),
        "manifest": str(output / manifest_name),
    }
    print(json.dumps(line), flush=True)
    return 0


def _puzzle_kd(args: argparse.Namespace) -> int:
    from puzzletron.dataset.acquisition import (
        MANIFEST_NAME,
        PUZZLE_KD_ADAPTER,
        TextAcquisitionSpec,
        materialize_puzzle_kd_dataset,
    )

    def call() -> Any:
        spec = TextAcquisitionSpec(
            output_dir=Path(args.output),
            train_samples=args.train_samples,
            validation_samples=args.validation_samples,
            seed=args.seed,
            revision=args.revision,
            source=args.source,
        )
        return materialize_puzzle_kd_dataset(spec)

    return _run(args, PUZZLE_KD_ADAPTER, MANIFEST_NAME, call)


def _subset_rows(values: list[str] | None) -> tuple[tuple[str, int], ...]:
    out = []
    for value in values or []:
        name, sep, rows = value.partition("=")
        if not sep or not name.strip() or not rows.strip().lstrip("-").isdigit():
            raise argparse.ArgumentTypeError(f"--subset-rows expects NAME=ROWS, got {value!r}")
        out.append((name.strip(), int(rows)))
    return tuple(out)


def _nemotron(args: argparse.Namespace) -> int:
    from puzzletron.dataset.acquisition import (
        NEMOTRON_VLM_ADAPTER,
        VlmAcquisitionSpec,
        materialize_nemotron_vlm_dataset,
    )
    from puzzletron.dataset.subset import MANIFEST

    try:
        rows = _subset_rows(args.subset_rows)
    except argparse.ArgumentTypeError as exc:
        print(f"puzzletron-data materialize nemotron-vlm: {exc}", file=sys.stderr)
        return 2
    subsets = tuple(args.subset) if args.subset else tuple(name for name, _ in rows)

    def call() -> Any:
        extra = {"subsets": subsets} if subsets else {}
        spec = VlmAcquisitionSpec(
            output_dir=Path(args.output),
            subset_rows=rows,
            num_samples=args.num_samples,
            seed=args.seed,
            max_shards_per_subset=args.max_shards_per_subset,
            revision=args.revision,
            source=args.source,
            **extra,
        )
        return materialize_nemotron_vlm_dataset(spec)

    return _run(args, NEMOTRON_VLM_ADAPTER, MANIFEST, call)


def _intersyn(args: argparse.Namespace) -> int:
    from puzzletron.dataset.acquisition import INTERSYN_ADAPTER, materialize_intersyn_subset
    from puzzletron.dataset.subset import MANIFEST

    def call() -> Any:
        return materialize_intersyn_subset(
            Path(args.output),
            rows_per_source=args.rows_per_source,
            single_turn_source=args.single_turn_source,
            single_turn_revision=args.single_turn_revision,
            multi_turn_source=args.multi_turn_source,
            multi_turn_revision=args.multi_turn_revision,
        )

    return _run(args, INTERSYN_ADAPTER, MANIFEST, call)


def _hub_fixtures(args: argparse.Namespace) -> int:
    from puzzletron.fixtures.hub import generate_fixture_hub

    try:
        hub = generate_fixture_hub(Path(args.dir), seed=args.seed)
    except (FileExistsError, OSError) as exc:
        print(f"puzzletron-data hub fixtures: {exc}", file=sys.stderr)
        return 1
    print(
        json.dumps({"root": str(hub.root), "mirrors": str(hub.mirrors), "shas": dict(hub.shas)}), flush=True
    )
    return 0


def _hub_serve(args: argparse.Namespace) -> int:
    from puzzletron.fixtures.mirror import serve_hub

    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        with serve_hub(Path(args.dir), port=args.port) as endpoint:
            print(endpoint, flush=True)
            print(f"serving {Path(args.dir) / 'mirrors'}; export HF_ENDPOINT={endpoint}", file=sys.stderr)
            with contextlib.suppress(KeyboardInterrupt):
                stop.wait()
    except (FileNotFoundError, RuntimeError) as exc:
        print(f"puzzletron-data hub serve: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def _common(parser: argparse.ArgumentParser, *, seed: int | None, source: str | None) -> None:
    parser.add_argument("--output", required=True, help="snapshot directory (created atomically)")
    if seed is not None:
        parser.add_argument("--seed", type=int, default=seed, help=f"shuffle seed (default {seed})")
        parser.add_argument(
            "--revision", default=None, help="commit sha, branch, or main/latest (default: main)"
        )
        parser.add_argument("--source", default=source, help=f"Hub dataset id (default {source})")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``materialize`` and ``hub`` to the `puzzletron-data` parser."""
    materialize = sub.add_parser("materialize", help="take a bounded, pinned snapshot of a Hub dataset")
    datasets = materialize.add_subparsers(dest="dataset", required=True, metavar="DATASET")

    pkd = datasets.add_parser("puzzle-kd", help="Puzzle-KD train/validation splits (datasets save_to_disk)")
    _common(pkd, seed=408, source="nvidia/Puzzle-KD-Nemotron-Post-Training-Dataset-v2")
    pkd.add_argument("--train-samples", type=int, default=8192)
    pkd.add_argument("--validation-samples", type=int, default=1024)
    pkd.set_defaults(handler=_puzzle_kd)

    vlm = datasets.add_parser("nemotron-vlm", help="Nemotron-VLM image conversations (conversation subset)")
    _common(vlm, seed=42, source="nvidia/Nemotron-VLM-Dataset-v2")
    vlm.add_argument(
        "--subset", action="append", help="subset name (repeatable; default the three image subsets)"
    )
    vlm.add_argument("--subset-rows", action="append", metavar="NAME=ROWS", help="subset weight (repeatable)")
    vlm.add_argument("--num-samples", type=int, default=512)
    vlm.add_argument("--max-shards-per-subset", type=int, default=1)
    vlm.set_defaults(handler=_nemotron)

    from puzzletron.dataset.acquisition import (
        INTERSYN_MULTI_REVISION,
        INTERSYN_MULTI_SOURCE,
        INTERSYN_SINGLE_REVISION,
        INTERSYN_SINGLE_SOURCE,
    )

    inter = datasets.add_parser("intersyn", help="the pinned InterSyn acceptance subset")
    _common(inter, seed=None, source=None)
    inter.add_argument("--rows-per-source", type=int, default=8)
    inter.add_argument("--single-turn-source", default=INTERSYN_SINGLE_SOURCE)
    inter.add_argument("--single-turn-revision", default=INTERSYN_SINGLE_REVISION)
    inter.add_argument("--multi-turn-source", default=INTERSYN_MULTI_SOURCE)
    inter.add_argument("--multi-turn-revision", default=INTERSYN_MULTI_REVISION)
    inter.set_defaults(handler=_intersyn)

    hub = sub.add_parser("hub", help="fixture Hub repositories and a loopback Hub mirror")
    hub_sub = hub.add_subparsers(dest="hub_command", required=True, metavar="ACTION")
    fixtures = hub_sub.add_parser("fixtures", help="generate the fixture repositories under DIR/mirrors")
    fixtures.add_argument("dir")
    fixtures.add_argument("--seed", type=int, default=0)
    fixtures.set_defaults(handler=_hub_fixtures)
    serve = hub_sub.add_parser("serve", help="serve DIR/mirrors/datasets/<org>/<name> git repos on 127.0.0.1")
    serve.add_argument("dir")
    serve.add_argument("--port", type=int, default=None, help="port (default: a free one)")
    serve.set_defaults(handler=_hub_serve)
