"""`puzzletron-data pack-report --mixture CONFIG`: a mixture's first epoch as a per-component table and a PNG
of each component's cumulative share of the real tokens over the global steps (the asked share dashed).

``CONFIG`` is a YAML file holding a ``data:`` block with a ``mixture:`` block (or the ``data:`` block
itself), read by `puzzletron.dataset.pipelines.mixture_config.read_mixture`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from puzzletron.cli._figures import pyplot, save_figure
from puzzletron.cli._output import emit

__all__ = ["draw_shares", "mixture_report"]


def step_shares(batches: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(cumulative real tokens [steps, K], asked share [steps, K])`` of the epoch's global steps, from the
    deal and the rows' tokens (no batch is built)."""
    plan, deal = batches.plan, batches.sampler.deal()
    steps = deal.shape[0]
    ids = deal.reshape(steps, -1)
    real = np.where(ids >= 0, plan.real_tokens[np.maximum(ids, 0)], 0).astype(np.int64)
    component, _ = plan.locate(np.maximum(ids, 0))
    per = np.zeros((steps, len(plan.names)), dtype=np.int64)
    np.add.at(per, (np.repeat(np.arange(steps), ids.shape[1]), component.reshape(-1)), real.reshape(-1))
    cumulative = per.cumsum(axis=0)
    totals = cumulative.sum(axis=1)
    asked = np.stack([plan.weights.owed(t) / max(t, 1) for t in totals]) if steps else np.zeros((0, 0))
    return cumulative, asked


def draw_shares(
    names: tuple[str, ...], cumulative: np.ndarray, asked: np.ndarray, out: Path, *, title: str
) -> None:
    """Write a PNG: each component's share of the real tokens delivered by each global step."""
    plt = pyplot()
    totals = np.maximum(cumulative.sum(axis=1, keepdims=True), 1)
    steps = np.arange(1, cumulative.shape[0] + 1)
    fig, ax = plt.subplots(figsize=(10, 5))
    for k, name in enumerate(names):
        (line,) = ax.plot(steps, cumulative[:, k] / totals[:, 0], label=f"{name}")
        ax.plot(steps, asked[:, k], linestyle="--", color=line.get_color(), linewidth=0.9)
    ax.set_xlabel("global step")
    ax.set_ylabel("share of the real tokens delivered so far")
    ax.set_ylim(0, 1)
    ax.set_title(title + "  (dashed: asked)", fontsize=10)
    ax.legend(fontsize=9)
    save_figure(fig, out)


def mixture_report(args: argparse.Namespace) -> int:
    """Plan the mixture of ``args.mixture``, print its table and draw its shares."""
    import yaml

    from puzzletron.dataset.errors import ConfigError
    from puzzletron.dataset.pipelines.mixture_config import mixture_batches

    try:
        raw = yaml.safe_load(Path(args.mixture).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"--mixture {args.mixture}: cannot read it as YAML ({exc})") from exc
    data = raw.get("data", raw) if isinstance(raw, dict) else raw
    options = {"tokenizer": args.tokenizer, "processor": args.processor, "cache_dir": args.cache_dir}
    batches = mixture_batches(
        data, batch_size=args.batch_size, dp_size=args.dp_size, seed=args.seed, **options
    )
    cumulative, asked = step_shares(batches)
    row_size = batches.plan.row_size
    totals = cumulative.sum(axis=1, keepdims=True)
    gap = float(np.abs(cumulative - totals * asked).max(initial=0)) / row_size
    report = batches.report()  # with each component's supervised tokens
    exceptions = batches.sampler.image_exceptions()
    tokens = int(batches.plan.real_tokens[batches.plan.order(0)].sum())
    fill = tokens / max(len(batches.plan.order(0)) * row_size, 1)
    draw_shares(batches.plan.names, cumulative, asked, Path(args.out), title=f"{Path(args.mixture).name}")
    if args.json:
        facts = {
            "path": str(Path(args.mixture).absolute()),
            "token_count": tokens,
            "components": [vars(c) for c in report],
            "steps": int(cumulative.shape[0]),
            "max_share_gap_rows": gap,
            "image_exceptions": exceptions,
            "fill": fill,
            "picture": str(Path(args.out).absolute()),
        }
        emit("pack-report", "ok", **facts)
        return 0
    print(f"mixture         {args.mixture}: {len(report)} components, {tokens:,} real tokens")
    print(
        f"{'component':<16}{'samples':>10}{'used':>10}{'rows':>9}{'passes':>8}{'tokens':>14}{'asked':>8}{'got':>8}"
    )
    for c in report:
        print(
            f"{c.name:<16}{c.samples:>10,}{c.samples_used:>10,}{c.rows_used:>9,}{c.passes:>8.2f}"
            f"{c.real_tokens:>14,}{c.share_asked:>8.2%}{c.share_achieved:>8.2%}"
        )
    print(f"steps           {cumulative.shape[0]} of {args.dp_size} x {args.batch_size} rows")
    print(f"share gap       {gap:.2f} rows at most, at any step")
    print(f"fill            {fill:.4%}  (real tokens / row slots)")
    print(f"image steps     {exceptions} with images on some ranks only")
    print(f"picture         {args.out}")
    return 0
