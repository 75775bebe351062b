"""`puzzletron-data pack-report`: plan the packing of a text snapshot split (or a token store) and draw it.

The source is a text snapshot (tokenised here with ``--tokenizer``) or a token store (its lengths are read,
no tokenizer), a folder or an URL (a text snapshot at an URL is read from the node's verified copy,
`formats.local_copy`; a store through its ranged reads). The picture (a PNG) shows the first rows as bars
split by sample, and the length histogram; the numbers (rows against the lower bound, efficiency, lengths,
what was dropped, timings) go to stdout (``--json``: one line, keys of `puzzletron.cli._output` plus the
plan's). Errors are reported by `puzzletron.cli.main`: exit 1 on a data error (snapshot, split, tokenizer,
rows), 2 on a bad option (`ConfigError`, e.g. ``--pack-size 0``, or a snapshot without ``--tokenizer``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from puzzletron.cli._args import seed_type
from puzzletron.cli._figures import pyplot, save_figure
from puzzletron.cli._output import add_json, emit

if TYPE_CHECKING:
    import numpy as np

__all__ = ["draw_packing", "register"]


def draw_packing(plan: Any, lengths: np.ndarray, out: Path, *, title: str = "", max_rows: int = 40) -> None:
    """Write a PNG: the first ``max_rows`` rows as bars split by sample, and the length histogram.

    ``lengths`` ``[N]`` are the planned samples' token counts (``plan`` indexes into them).
    """
    import numpy as np
    from matplotlib.patches import Patch

    plt = pyplot()

    n_rows = min(plan.num_rows, max_rows)
    stop = int(plan.row_offsets[n_rows])
    order = plan.sample_order[:stop]
    widths = lengths[order]
    counts = np.diff(plan.row_offsets[: n_rows + 1])
    row_of = np.repeat(np.arange(n_rows), counts)
    before = np.cumsum(widths) - widths
    left = before - np.repeat(before[plan.row_offsets[:n_rows]], counts)  # start of each sample in its row
    # tab20 without its two greys, so no sample looks like padding.
    palette = plt.get_cmap("tab20")(np.r_[0:14, 16:20])
    colours = palette[np.arange(order.shape[0]) % palette.shape[0]]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 9.5), height_ratios=(3, 1.3))
    fig.suptitle(title or f"Packing into rows of {plan.pack_size} tokens", fontsize=13)
    padding_style = {"facecolor": "white", "hatch": "///", "edgecolor": "#999999", "linewidth": 0}
    top.barh(np.arange(n_rows), plan.pack_size, height=0.8, **padding_style)
    top.barh(row_of, widths, left=left, color=colours, height=0.8, edgecolor="black", linewidth=0.4)
    top.set_xlim(0, plan.pack_size)
    top.set_ylim(n_rows - 0.5, -0.5)
    top.set_xlabel(f"token position in the row (pack_size {plan.pack_size})")
    top.set_ylabel("row (planned order)")
    top.set_title(
        f"first {n_rows} of {plan.num_rows} rows (lower bound {plan.lower_bound_rows}); "
        f"efficiency {plan.efficiency:.2%} (non-pad tokens / slots)",
        fontsize=10,
        loc="right",
    )
    # Above the bars, left of the title, so it never hides a row.
    top.legend(
        handles=[
            Patch(facecolor=palette[0], edgecolor="black", label="sample (colours cycle)"),
            Patch(label="padding", **{**padding_style, "linewidth": 0.5}),
        ],
        loc="lower left",
        bbox_to_anchor=(0.0, 1.0),
        ncols=2,
        frameon=False,
        fontsize=9,
        borderaxespad=0.2,
    )
    bins = np.linspace(0, max(int(lengths.max(initial=1)), plan.pack_size), 61)
    bottom.hist(lengths, bins=bins, color="#4c72b0", label=f"{lengths.shape[0]} samples")
    bottom.axvline(plan.pack_size, color="#c44e52", linestyle="--", label=f"pack_size {plan.pack_size}")
    if plan.dropped:
        bottom.axvspan(
            plan.pack_size,
            bins[-1],
            color="#c44e52",
            alpha=0.12,
            label=f"dropped: {len(plan.dropped)} longer",
        )
    bottom.set_title("sample lengths", fontsize=10)
    bottom.set_xlabel("sample length (tokens)")
    bottom.set_ylabel("samples")
    bottom.legend(fontsize=9)
    save_figure(fig, out)


def _local_snapshot(snapshot: str) -> Path:
    """The folder of the text snapshot `snapshot`: itself, or for an URL the node's verified copy."""
    from puzzletron.dataset.formats.local_copy import local_text_snapshot
    from puzzletron.dataset.storage.objects import is_url

    return local_text_snapshot(snapshot) if is_url(snapshot) else Path(snapshot)


def _pack_report(args: argparse.Namespace) -> int:
    """Print the report and write the picture; a bad option raises `ConfigError` before any work."""
    import datasets
    import numpy as np

    from puzzletron.dataset.config import PackingSpec
    from puzzletron.dataset.errors import ConfigError
    from puzzletron.dataset.formats.token_store import TokenStore
    from puzzletron.dataset.packing import plan_packing
    from puzzletron.dataset.pipelines.text import is_token_store, load_text_split
    from puzzletron.dataset.storage.objects import is_url, url_name
    from puzzletron.dataset.tokenize import tokenize_conversations

    datasets.disable_progress_bars()
    if args.mixture is not None:
        from puzzletron.cli._pack_report_mixture import mixture_report

        return mixture_report(args)
    if args.snapshot is None or args.pack_size is None:
        raise ConfigError("pack-report needs SNAPSHOT and --pack-size (or --mixture CONFIG)")
    spec = PackingSpec(pack_size=args.pack_size)  # a bad option fails before any work
    start = time.perf_counter()
    if is_token_store(args.snapshot):
        store = TokenStore(args.snapshot)
        lengths = np.asarray(store.lengths, dtype=np.int64)
        n_rows, kept, skipped = store.manifest["counts"]["rows"], len(store), store.skipped
        what = f"token store     {args.snapshot}"
    else:
        if args.tokenizer is None:
            raise ConfigError(f"--tokenizer is required: {args.snapshot} is not a token store")
        rows = load_text_split(_local_snapshot(args.snapshot), split=args.split)
        tokenized = tokenize_conversations(rows, tokenizer=Path(args.tokenizer), num_proc=args.num_proc)
        lengths = tokenized.samples.lengths
        n_rows, kept, skipped = len(rows), len(tokenized.samples), tokenized.skipped
        what = f"snapshot        {args.snapshot} [{args.split}]"
    tokenize_s = time.perf_counter() - start
    start = time.perf_counter()
    plan = plan_packing(lengths, spec, seed=args.seed)
    plan_s = time.perf_counter() - start
    where = args.snapshot if is_url(args.snapshot) else str(Path(args.snapshot).absolute())
    name = url_name(where) if is_url(where) else Path(where).name
    title = f"Packing of {name} [{args.split}] into rows of {plan.pack_size} tokens"
    draw_packing(plan, lengths, Path(args.out), title=title)
    summary = plan.summary()
    if args.json:
        emit(
            "pack-report",
            "ok",
            path=where,
            row_count=n_rows,
            sample_count=kept,
            token_count=int(lengths.sum()),
            pack_size=plan.pack_size,
            packs=summary["rows"],
            lower_bound_packs=summary["lower_bound_rows"],
            efficiency=plan.efficiency,
            dropped_samples=summary["dropped"],
            dropped_tokens=summary["dropped_tokens"],
            picture=str(Path(args.out).absolute()),
        )
        return 0
    print(f"{what}: {n_rows} rows")
    print(f"tokenised       {kept} samples, skipped {skipped} (no supervised token)")
    if lengths.size:
        q = np.percentile(lengths, [50, 90, 99]).round().astype(int).tolist()
        print(
            f"lengths         min {lengths.min()}  median {q[0]}  p90 {q[1]}  p99 {q[2]}  max {lengths.max()}"
        )
    print(f"pack_size       {plan.pack_size}")
    print(f"rows            {summary['rows']} (lower bound {summary['lower_bound_rows']})")
    print(f"efficiency      {plan.efficiency:.4%}  (non-pad tokens / slots)")
    dropped, dropped_tokens = summary["dropped"], summary["dropped_tokens"]
    print(f"dropped         {dropped} samples longer than pack_size ({dropped_tokens} tokens)")
    print(f"time            tokenise {tokenize_s:.2f} s, plan {plan_s * 1000:.1f} ms")
    print(f"picture         {args.out}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``pack-report`` to the `puzzletron-data` parser."""
    report = sub.add_parser(
        "pack-report", help="plan the packing of a text snapshot (or a mixture) and draw it to a PNG"
    )
    report.add_argument(
        "snapshot", nargs="?", help="a Puzzle-KD text snapshot (split --split) or token store (folder or URL)"
    )
    report.add_argument(
        "--tokenizer",
        default=None,
        help="a transformers tokenizer folder with a chat template (required for a snapshot)",
    )
    report.add_argument("--pack-size", type=int, default=None, help="row length in tokens")
    report.add_argument("--out", required=True, help="where to write the PNG")
    report.add_argument("--split", default="train", help="split of the snapshot (default: train)")
    report.add_argument("--seed", type=seed_type, default=0, help="seed of the row order (default 0)")
    report.add_argument("--num-proc", type=int, default=1, help="tokenisation processes (default 1)")
    mixture = report.add_argument_group("a mixture (docs/mixtures.md)")
    mixture.add_argument(
        "--mixture", default=None, help="a YAML file with a data: block holding a mixture: block"
    )
    mixture.add_argument("--processor", default=None, help="the processor of a multimodal mixture")
    mixture.add_argument("--cache-dir", default=None, help="where its stores are found or built")
    mixture.add_argument("--dp-size", type=int, default=1, help="DP ranks the steps are dealt to (default 1)")
    mixture.add_argument("--batch-size", type=int, default=1, help="rows per rank per step (default 1)")
    add_json(report)
    report.set_defaults(handler=_pack_report)
