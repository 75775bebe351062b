"""`puzzletron-data materialize puzzle-kd|nemotron-vlm|intersyn` and `puzzletron-data hub serve|fixtures`.

``materialize`` takes one flag per spec field, shows progress bars on stderr (only when stderr is a
terminal and ``--quiet`` is not given) and prints one JSON line on stdout (with or without ``--json``; keys:
`puzzletron.cli._output`)::

    {"command": "materialize puzzle-kd", "status": "done" | "reused", "adapter": ..., "path": DIR,
     "format": ..., "manifest": DIR/manifest.json, "row_count" | "sample_count", "image_count": ...}

``--output`` is a folder or an URL prefix (``s3://bucket/snapshots/pk``): the snapshot is materialised in a
private scratch folder and published there with its manifest last (`storage.publish`); a rerun of the
acquisition published there is "reused" from its manifest, with no Hub request; ``path`` and ``manifest``
are then the URL's.

An error that names a spec field (``max_shards_per_subset``) names its flag (``--max-shards-per-subset``).

Exit codes: 0 done or reused, 1 a data error (Hub unreachable, mismatch with an existing snapshot,
shortfall), 2 usage (bad flags or spec fields). The errors are the library's (`PuzzletronDataError`,
`ConfigError` for usage) or an `OSError`; `puzzletron.cli.main` prints them and picks the code.

``hub fixtures DIR`` writes the fixture repositories (one JSON line); ``hub serve DIR`` serves
``DIR/mirrors`` with the Hub API on loopback (olah), prints the endpoint (``--json``: a JSON line with
``endpoint``) and runs until interrupted; a ``--port`` in use is said and exits 1, one outside 1..65535 is a
usage error (exit 2).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import re
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from puzzletron.cli._args import port_type
from puzzletron.cli._output import CommandFailed, add_json, emit, folder_facts

__all__ = ["register"]


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


def _run(
    args: argparse.Namespace, adapter: str, call: Callable[[Path], Any], wanted: Callable[[], Any]
) -> int:
    """Materialise with `call(folder)` into ``--output``, or, for an URL, reuse the snapshot published there
    when its manifest records what `wanted()` (a spec or an acquisition) asks for, else build it in scratch
    and publish it (`_to_url`); then print the JSON line."""
    from puzzletron.dataset.sources import PROGRESS_LOGGER, hub
    from puzzletron.dataset.storage import publications
    from puzzletron.dataset.storage.objects import is_url

    url = args.output if is_url(args.output) else None
    output = Path(args.output)
    published = 0 if url else publications(output)
    show = _show_progress(args)
    hub.set_progress_bars(show)
    hub.log_through_application()  # each Hub retry said once on stderr, not twice
    logger = logging.getLogger(PROGRESS_LOGGER)
    handler = _ProgressHandler() if show else None
    old_level, old_propagate = logger.level, logger.propagate
    if handler is not None:
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
        logger.propagate = False  # progress records feed the bars only, never the log
    from puzzletron.dataset.errors import PuzzletronDataError

    try:  # a library error or OSError: `puzzletron.cli.main` (ConfigError exits 2, others 1)
        if url is not None:
            manifest, done = _to_url(url, args, call, wanted)
        else:
            manifest = call(output)
    except PuzzletronDataError as exc:
        flagged = _flag_names(str(exc), args)
        if flagged == str(exc):
            raise
        raise type(exc)(flagged) from exc
    finally:
        if handler is not None:
            logger.removeHandler(handler)
            logger.setLevel(old_level)
            logger.propagate = old_propagate
            handler.close()
    # "done" only when this run published the snapshot, whatever was there when it started
    if url is None:
        done = publications(output) > published
    status = "done" if done else "reused"
    facts = folder_facts(url or output)
    if hasattr(args, "media"):  # a subset: the layout it has (a reused one keeps its own)
        facts["media"] = "shards" if isinstance(manifest.get("media"), dict) else "files"
    emit(f"materialize {args.dataset}", status, adapter=adapter, **facts)
    return 0


def _to_url(
    url: str, args: argparse.Namespace, call: Callable[[Path], Any], wanted: Callable[[], Any]
) -> tuple[dict[str, Any], bool]:
    """``(manifest, done)`` of the snapshot at `url`: the published one when it is what `wanted()` asks for
    (no Hub request unless a revision must be resolved), else one materialised by `call` into a private
    scratch folder of the node's object cache (``builds/``, removed after) and published there
    (`storage.publish`: the manifest last)."""
    import secrets

    from puzzletron.dataset.formats.manifest import canonical_sha256
    from puzzletron.dataset.sources.published import check_published, published_snapshot
    from puzzletron.dataset.storage.object_cache import ObjectCache
    from puzzletron.dataset.storage.publish import publish_folder
    from puzzletron.dataset.storage.scratch import private_scratch

    there = published_snapshot(url)
    if there is not None:
        check_published(url, there, wanted())
        return there, False
    what = "text snapshot" if args.dataset == "puzzle-kd" else "conversation subset"
    token = secrets.token_hex(8)
    with private_scratch(ObjectCache.default().root / "builds" / f"materialize-{token}") as scratch:
        folder = scratch / "snapshot"
        manifest = call(folder)
        digest = canonical_sha256(manifest.get("acquisition"))
        done = publish_folder(folder, url, digest=digest, what=what)
    if not done:  # published by another meanwhile: that one is what the URL holds
        manifest = published_snapshot(url) or manifest
    return manifest, done


def _flag_names(message: str, args: argparse.Namespace) -> str:
    """``message`` with every option name of this command (``max_shards_per_subset``, also as
    ``TextAcquisitionSpec.train_samples``) as its flag (``--max-shards-per-subset``).

    >>> _flag_names("TextAcquisitionSpec.train_samples must be >= 1", argparse.Namespace(train_samples=1))
    '--train-samples must be >= 1'
    """
    names = sorted((n for n in vars(args) if "_" in n), key=len, reverse=True)
    for name in names:
        flag = "--" + name.replace("_", "-")
        message = re.sub(rf"(?<![\w.-])(?:[A-Za-z_]\w*\.)?{re.escape(name)}(?![\w-])", flag, message)
    return message


def _given(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    """The options among `names` given on the command line (the others keep the spec's default)."""
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def _spec(spec_cls: type, args: argparse.Namespace, output: Path, **fields_: Any) -> Any:
    """A spec writing to `output` from the flags every materialiser has, plus `fields_`."""
    common = _given(args, "seed", "revision", "source")
    return spec_cls(output_dir=output, **common, **fields_)


def _placeholder(args: argparse.Namespace) -> Path:
    """The output a spec is checked with when ``--output`` is an URL (its identity has no output)."""
    from puzzletron.dataset.storage.objects import url_name

    return Path(url_name(args.output) or "snapshot")


def _puzzle_kd(args: argparse.Namespace) -> int:
    from puzzletron.dataset.sources import (
        PUZZLE_KD_ADAPTER,
        TextAcquisitionSpec,
        materialize_puzzle_kd_dataset,
    )

    sizes = _given(args, "train_samples", "validation_samples")

    def call(output: Path) -> Any:
        return materialize_puzzle_kd_dataset(_spec(TextAcquisitionSpec, args, output, **sizes))

    return _run(
        args, PUZZLE_KD_ADAPTER, call, lambda: _spec(TextAcquisitionSpec, args, _placeholder(args), **sizes)
    )


def _subset_rows(values: list[str] | None) -> tuple[tuple[str, int], ...]:
    out = []
    for value in values or []:
        name, sep, rows = value.partition("=")
        if not sep or not name.strip() or not rows.strip().lstrip("-").isdigit():
            raise argparse.ArgumentTypeError(f"--subset-rows expects NAME=ROWS, got {value!r}")
        out.append((name.strip(), int(rows)))
    return tuple(out)


def _nemotron(args: argparse.Namespace) -> int:
    from puzzletron.dataset.errors import ConfigError
    from puzzletron.dataset.sources import (
        NEMOTRON_VLM_ADAPTER,
        VlmAcquisitionSpec,
        materialize_nemotron_vlm_dataset,
    )

    try:
        rows = _subset_rows(args.subset_rows)
    except argparse.ArgumentTypeError as exc:
        raise ConfigError(str(exc)) from None
    subsets = tuple(args.subset) if args.subset else tuple(name for name, _ in rows)

    extra = {"subsets": subsets} if subsets else {}
    sizes = _given(args, "num_samples", "max_shards_per_subset")

    def spec(output: Path) -> Any:
        return _spec(VlmAcquisitionSpec, args, output, subset_rows=rows, **sizes, **extra)

    def call(output: Path) -> Any:
        return materialize_nemotron_vlm_dataset(spec(output), media=args.media)

    return _run(args, NEMOTRON_VLM_ADAPTER, call, lambda: spec(_placeholder(args)))


def _intersyn(args: argparse.Namespace) -> int:
    from puzzletron.dataset.sources import INTERSYN_ADAPTER, intersyn_acquisition, materialize_intersyn_subset

    def call(output: Path) -> Any:
        return materialize_intersyn_subset(output, **_given(args, *_INTERSYN), media=args.media)

    return _run(args, INTERSYN_ADAPTER, call, lambda: intersyn_acquisition(**_given(args, *_INTERSYN)))


def _hub_fixtures(args: argparse.Namespace) -> int:
    from puzzletron.fixtures.hub import generate_fixture_hub

    hub = generate_fixture_hub(Path(args.dir), seed=args.seed)  # an OSError: exit 1 in `puzzletron.cli.main`
    emit(
        "hub fixtures",
        "done",
        path=str(Path(hub.root).absolute()),
        mirrors=str(hub.mirrors),
        shas=dict(hub.shas),
    )
    return 0


def _hub_serve(args: argparse.Namespace) -> int:
    from puzzletron.fixtures.mirror import serve_hub

    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        with serve_hub(Path(args.dir), port=args.port) as endpoint:
            if args.json:
                emit("hub serve", "serving", path=str(Path(args.dir).absolute()), endpoint=endpoint)
            else:
                print(endpoint, flush=True)
            print(f"serving {Path(args.dir) / 'mirrors'}; export HF_ENDPOINT={endpoint}", file=sys.stderr)
            with contextlib.suppress(KeyboardInterrupt):
                stop.wait()
    except (FileNotFoundError, RuntimeError) as exc:
        raise CommandFailed(str(exc)) from exc
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


# The help of each spec field's flag (its default is appended when the help is shown).
_HELP = {
    "train_samples": "rows to take from the train split",
    "validation_samples": "rows to take from the validation split",
    "num_samples": "image conversations to take, over all subsets (by --subset-rows)",
    "max_shards_per_subset": "media tar shards to read per subset at most (more: more usable rows)",
    "rows_per_source": "rows to take from each of the two InterSyn repositories",
    "single_turn_source": "Hub dataset id of the single-turn InterSyn repository",
    "single_turn_revision": "its commit (default: the pinned upstream commit; a mirror may need 'main')",
    "multi_turn_source": "Hub dataset id of the multi-turn InterSyn repository",
    "multi_turn_revision": "its commit (default: the pinned upstream commit; a mirror may need 'main')",
    "seed": "shuffle seed",
    "source": "Hub dataset id",
}
_INTS = frozenset({"train_samples", "validation_samples", "num_samples", "max_shards_per_subset"})
_INTS |= {"rows_per_source", "seed"}
_INTERSYN = ("rows_per_source", "single_turn_source", "single_turn_revision")
_INTERSYN += ("multi_turn_source", "multi_turn_revision")


def _defaults(dataset: str) -> dict[str, Any]:
    """The defaults of a materialiser's options: its spec's fields (InterSyn: its function's keywords).
    Read only to show the help: parsing imports nothing of the library, so a usage error is said at once."""
    from dataclasses import fields
    from inspect import signature

    from puzzletron.dataset import sources

    if dataset == "intersyn":
        parameters = signature(sources.materialize_intersyn_subset).parameters
        return {name: p.default for name, p in parameters.items()}
    spec = sources.TextAcquisitionSpec if dataset == "puzzle-kd" else sources.VlmAcquisitionSpec
    return {f.name: f.default for f in fields(spec)}


class _DefaultsHelp(argparse.HelpFormatter):
    """Appends each spec option's default (`_defaults`) to its help, read when the help is shown."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = str(action.help or "")
        field = getattr(action, "spec_field", None)
        if field is None:
            return text
        default = _defaults(field[0])[field[1]]
        shown = f"{default[:12]}..." if isinstance(default, str) and len(default) == 40 else default
        return f"{text} (default {shown})".replace("%", "%%")


def _flags(parser: argparse.ArgumentParser, dataset: str, *names: str) -> None:
    """One ``--name`` flag per field `names` of the `dataset`'s spec (unset: the spec's default)."""
    for name in names:
        action = parser.add_argument(
            f"--{name.replace('_', '-')}", type=int if name in _INTS else None, default=None, help=_HELP[name]
        )
        action.spec_field = (dataset, name)  # type: ignore[attr-defined]


def _common(parser: argparse.ArgumentParser, dataset: str) -> None:
    """The flags every materialiser has; with a spec (not InterSyn), also its seed, revision and source."""
    parser.add_argument(
        "--output",
        required=True,
        help="snapshot directory (created atomically), or an URL prefix (s3://bucket/prefix: built in a "
        "local scratch folder, then published there with its manifest last)",
    )
    if dataset != "intersyn":
        _flags(parser, dataset, "seed")
        parser.add_argument(
            "--revision",
            default=None,
            help="commit sha, branch, or main/latest (default: the commit an existing snapshot at --output "
            "pins, with no request; else main)",
        )
        _flags(parser, dataset, "source")
    if dataset != "puzzle-kd":  # a conversation subset: its images as files or in media shards
        parser.add_argument(
            "--media",
            choices=("files", "shards"),
            default="files",
            help="images as one file each (default) or in media shards of about 128 MiB, what object "
            "storage and parallel file systems want (docs/media-shard-format.md); a complete subset already "
            "at --output is reused in the layout it has",
        )
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    add_json(parser, always=True)


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``materialize`` and ``hub`` to the `puzzletron-data` parser."""
    materialize = sub.add_parser("materialize", help="take a bounded, pinned snapshot of a Hub dataset")
    datasets = materialize.add_subparsers(dest="dataset", required=True, metavar="DATASET")

    pkd = datasets.add_parser(
        "puzzle-kd",
        help="Puzzle-KD train/validation splits (datasets save_to_disk)",
        formatter_class=_DefaultsHelp,
    )
    _common(pkd, "puzzle-kd")
    _flags(pkd, "puzzle-kd", "train_samples", "validation_samples")
    pkd.set_defaults(handler=_puzzle_kd)

    vlm = datasets.add_parser(
        "nemotron-vlm",
        help="Nemotron-VLM image conversations (conversation subset)",
        formatter_class=_DefaultsHelp,
    )
    _common(vlm, "nemotron-vlm")
    vlm.add_argument(
        "--subset", action="append", help="subset name (repeatable; default the three image subsets)"
    )
    vlm.add_argument(
        "--subset-rows",
        action="append",
        metavar="NAME=ROWS",
        help="the subset's share of --num-samples, in proportion to ROWS (its row count; repeatable)",
    )
    _flags(vlm, "nemotron-vlm", "num_samples", "max_shards_per_subset")
    vlm.set_defaults(handler=_nemotron)

    inter = datasets.add_parser(
        "intersyn", help="the pinned InterSyn acceptance subset", formatter_class=_DefaultsHelp
    )
    _common(inter, "intersyn")
    _flags(inter, "intersyn", *_INTERSYN)
    inter.set_defaults(handler=_intersyn)

    hub = sub.add_parser("hub", help="fixture Hub repositories and a loopback Hub mirror")
    hub_sub = hub.add_subparsers(dest="hub_command", required=True, metavar="ACTION")
    fixtures = hub_sub.add_parser("fixtures", help="generate the fixture repositories under DIR/mirrors")
    fixtures.add_argument("dir", help="folder to create (must not exist); hub serve DIR serves it")
    fixtures.add_argument(
        "--seed", type=int, default=0, help="seed of the generated rows and images (default 0)"
    )
    add_json(fixtures, always=True)
    fixtures.set_defaults(handler=_hub_fixtures)
    serve = hub_sub.add_parser("serve", help="serve DIR/mirrors/datasets/<org>/<name> git repos on 127.0.0.1")
    serve.add_argument("dir", help="a folder with mirrors/ (hub fixtures DIR, or your mirrored repositories)")
    serve.add_argument("--port", type=port_type, default=None, help="port 1..65535 (default: a free one)")
    add_json(serve)
    serve.set_defaults(handler=_hub_serve)
