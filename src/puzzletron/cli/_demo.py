"""`puzzletron-data demo` and `puzzletron-data pack-report`.

``demo`` runs the data stage end to end on the built-in fixture Hub, offline, in a temporary folder (or
``--workdir``): check the batch contract on synthetic tensors, generate the fixture repositories and serve
them on loopback (olah), materialise the Puzzle-KD, Nemotron-VLM and InterSyn snapshots and verify them,
turn the text split into packed batches with `build_batches`, deal them to two DP ranks, shard one over
DP x CP x PP and check that it reassembles, and print a report (rows, tokens, packing efficiency,
fingerprints, time per stage). Stages run in order and the demo stops at the first that fails: it is
reported as ``FAIL`` with its error, the stages after it do not run (most need an earlier stage's result:
the Hub, the snapshot, the batches) and are counted in the report, and the exit code is 1. A ``--workdir``
of an earlier run is reused (its Hub and snapshots) only when that run used the same ``--seed``; any other
``hub/`` there fails stage 2. Ctrl-C or SIGTERM stops the Hub server on the way out.

``pack-report`` plans the packing of a tokenised snapshot split and draws it (rows as bars split by sample,
and the length histogram) into a PNG; the numbers go to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["register"]

PACK_SIZE = 4096  # the demo's text pack size (Puzzle-KD chat lengths: median ~800 fixture tokens)
DP, CP, PP = 2, 2, 2
PACKS_PER_BATCH = 4
HUB_MARKER = "demo-hub.json"  # written last into <workdir>/hub: the seed of a complete fixture Hub


@dataclass
class _Stage:
    name: str
    status: str = "ok"
    seconds: float = 0.0
    lines: list[str] = field(default_factory=list)


@dataclass
class _Demo:
    """What the stages hand on to each other, and the numbers for the final report."""

    workdir: Path
    seed: int
    stack: contextlib.ExitStack
    hub_dir: Path | None = None
    text_dir: Path | None = None
    batches: Any = None  # TextBatches of DP rank 0
    first_batch: Any = None  # rank 0's first batch of epoch 0
    facts: dict[str, Any] = field(default_factory=dict)


def _run_stage(number: int, name: str, body: Callable[[_Stage], None]) -> _Stage:
    """Run one stage, timed; an exception marks it ``FAIL`` with the error and the end of its traceback."""
    stage = _Stage(name)
    print(f"[{number}] {name} ...", flush=True)
    start = time.perf_counter()
    try:
        body(stage)
    except Exception as exc:
        stage.status = "FAIL"
        stage.lines.append(f"{type(exc).__name__}: {exc}")
        stage.lines.extend(
            traceback.format_exc().rstrip().splitlines()[-6:-1]
        )  # the last line repeats the error
    stage.seconds = time.perf_counter() - start
    for line in stage.lines:
        print(f"    {line}", flush=True)
    print(f"    -> {stage.status} in {stage.seconds:.2f} s", flush=True)
    return stage


def _fp(batch: Any) -> str:
    """The first 12 hex digits of a batch's fingerprint."""
    return str(batch.fingerprint)[:12]


# ---------------------------------------------------------------------------------------------------------
# Sharding: DP x CP x PP and back


def _cp_indices(batch: Any, *, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Load-balanced (zigzag, per document) CP token indices of ``batch``."""
    from puzzletron.dataset.parallel import batch_cp_indices

    return batch_cp_indices(batch, cp_rank=cp_rank, cp_size=cp_size)


def check_sharding(batch: Any, *, dp: int, cp: int, pp: int) -> list[str]:
    """Split ``batch`` over DP, then each DP shard over CP and PP; check each split reassembles exactly.

    Returns report lines (shard fingerprints); raises ``AssertionError`` naming what did not reassemble.
    """
    lines = []
    shards = [batch.dp_slice(dp_rank=r, dp_size=dp) for r in range(dp)]
    # One packed row is split by whole samples along the tokens (trailing pack padding dropped); several
    # rows are split into contiguous row blocks.
    axis = 1 if batch.batch_size == 1 and dp > 1 else 0
    width = int(batch.sequence.global_cu_seqlens[-1]) if axis == 1 else batch.sequence_length
    for name in ("input_ids", "labels"):
        joined = torch.cat([getattr(s, name) for s in shards], dim=axis)
        if not torch.equal(joined, getattr(batch, name)[:, :width]):
            raise AssertionError(f"DP shards do not concatenate back to the batch's {name}")
    lines.append(f"dp={dp}: " + " ".join(_fp(s) for s in shards))
    for r, shard in enumerate(shards):
        # CP: every rank's gathered tokens, scattered back to their positions, rebuild the shard.
        rebuilt_ids = torch.full_like(shard.input_ids, -7)
        rebuilt_labels = torch.full_like(shard.labels, -7)
        seen = torch.zeros(shard.sequence_length, dtype=torch.long)
        prints = []
        for c in range(cp):
            index = _cp_indices(shard, cp_rank=c, cp_size=cp)
            part = shard.cp_partition(index, cp_rank=c, cp_size=cp)
            rebuilt_ids[:, index] = part.input_ids
            rebuilt_labels[:, index] = part.labels
            seen[index] += 1
            prints.append(_fp(part))
        if not (torch.all(seen == 1) and torch.equal(rebuilt_ids, shard.input_ids)):
            raise AssertionError(f"CP partitions of DP shard {r} do not reassemble its input_ids")
        if not torch.equal(rebuilt_labels, shard.labels):
            raise AssertionError(f"CP partitions of DP shard {r} do not reassemble its labels")
        from puzzletron.dataset.parallel import gather_cp_partitions

        indices = [_cp_indices(shard, cp_rank=c, cp_size=cp) for c in range(cp)]
        gathered = gather_cp_partitions(
            [shard.cp_partition(i, cp_rank=c, cp_size=cp) for c, i in enumerate(indices)], indices
        )
        for name in ("input_ids", "labels", "hidden_mask"):
            if not torch.equal(getattr(gathered, name), getattr(shard, name)):
                raise AssertionError(f"gather_cp_partitions of DP shard {r} does not rebuild its {name}")
        # PP: microbatches are contiguous row groups.
        micro = shard.pp_microbatches(pp) if shard.batch_size >= pp else (shard,)
        if not torch.equal(torch.cat([m.input_ids for m in micro]), shard.input_ids):
            raise AssertionError(f"PP microbatches of DP shard {r} do not reassemble its input_ids")
        lines.append(f"  dp{r}: cp={cp} " + " ".join(prints) + f" | pp={len(micro)} microbatches ok")
    return lines


# ---------------------------------------------------------------------------------------------------------
# Stages


def _synthetic(demo: _Demo, st: _Stage) -> None:
    """The batch contract on synthetic samples: pack, shard over DP x CP x PP, reassemble."""
    from puzzletron.dataset.config import PackingSpec, PuzzletronDataSpec
    from puzzletron.dataset.packing import TokenizedSamples, build_batch, plan_packing

    rng = np.random.default_rng(demo.seed)
    lengths = np.clip(np.rint(rng.lognormal(np.log(60), 0.8, size=64)), 2, 256).astype(np.int64)
    ids = [rng.integers(1, 1000, size=n).tolist() for n in lengths]
    labels = [[*x[1:], -100] for x in ids]
    samples = TokenizedSamples.from_lists(ids, labels, sample_ids=[f"synthetic-{i}" for i in range(64)])
    spec = PuzzletronDataSpec("text", "packed_varlen", 256, PackingSpec(pack_size=256))
    plan = plan_packing(lengths, spec.packing, seed=demo.seed)
    st.lines.append(
        f"{len(lengths)} synthetic samples, {plan.total_tokens} tokens -> {plan.num_rows} rows of 256 "
        f"(lower bound {plan.lower_bound_rows}), efficiency {plan.efficiency:.2%}"
    )
    rows = plan.rows[:4]
    batch = build_batch(samples, rows, spec=spec)
    st.lines.append(f"packed batch {tuple(batch.input_ids.shape)}: fingerprint {_fp(batch)}")
    st.lines.extend(check_sharding(batch, dp=DP, cp=CP, pp=PP))
    # A batch of a single packed row is the special case of dp_slice: it splits by whole samples.
    one_row = build_batch(samples, rows[:1], spec=spec)
    dp_line = check_sharding(one_row, dp=DP, cp=1, pp=1)[0]
    st.lines.append(f"one packed row of {len(rows[0])} samples, split over DP by whole samples: {dp_line}")


def _serve_hub(demo: _Demo, st: _Stage) -> None:
    from puzzletron.fixtures.hub import generate_fixture_hub
    from puzzletron.fixtures.mirror import serve_hub

    hub_dir = demo.workdir / "hub"
    reuse = hub_dir.exists()  # a --workdir of an earlier run
    hub = None
    if reuse:
        _check_reusable_hub(hub_dir, demo.seed)
    else:
        # Generated aside and renamed into place with its seed recorded, so an interrupted run leaves no
        # half-written hub/ for the next run to mistake for a complete one.
        partial = demo.workdir / "hub.partial"
        shutil.rmtree(partial, ignore_errors=True)  # an interrupted earlier generation (ours by name)
        hub = generate_fixture_hub(partial, seed=demo.seed)
        (partial / HUB_MARKER).write_text(json.dumps({"seed": demo.seed}) + "\n")
        partial.rename(hub_dir)
    endpoint = demo.stack.enter_context(serve_hub(hub_dir))
    demo.stack.enter_context(_hf_env(demo.workdir, endpoint))
    demo.hub_dir = hub_dir
    st.lines.append(f"serving {hub_dir / 'mirrors'} at {endpoint}" + (" (reused)" if reuse else ""))
    if hub is not None:
        st.lines.extend(f"{repo} @ {sha[:12]}" for repo, sha in hub.shas.items())


def _check_reusable_hub(hub_dir: Path, seed: int) -> None:
    """Raise unless ``hub_dir`` is a complete fixture Hub that an earlier demo generated with ``seed``."""
    marker = hub_dir / HUB_MARKER
    try:
        recorded = json.loads(marker.read_text())["seed"]
    except (OSError, ValueError, KeyError, TypeError):
        raise FileExistsError(
            f"{hub_dir} exists but is not a complete fixture Hub of an earlier demo (no readable "
            f"{HUB_MARKER}); remove it or choose another --workdir"
        ) from None
    if recorded != seed:
        raise FileExistsError(
            f"{hub_dir} holds the fixture Hub of --seed {recorded}, not --seed {seed}; its snapshots would "
            "not match this seed: choose another --workdir or run with the same seed"
        )


def _puzzle_kd(demo: _Demo, st: _Stage) -> None:
    from puzzletron.dataset.acquisition import TextAcquisitionSpec, materialize_puzzle_kd_dataset

    text_dir = demo.workdir / "snapshots" / "puzzle-kd"
    spec = TextAcquisitionSpec(output_dir=text_dir, train_samples=512, validation_samples=64)
    manifest = materialize_puzzle_kd_dataset(spec)
    st.lines.append(_manifest_line("puzzle-kd", manifest))
    st.lines.append(_verify_text_snapshot(text_dir, manifest))
    demo.text_dir = text_dir


def _nemotron_vlm(demo: _Demo, st: _Stage) -> None:
    from puzzletron.dataset.acquisition import VlmAcquisitionSpec, materialize_nemotron_vlm_dataset

    vlm_dir = demo.workdir / "snapshots" / "nemotron-vlm"
    spec = VlmAcquisitionSpec(output_dir=vlm_dir, num_samples=24)
    st.lines.append(_manifest_line("nemotron-vlm", materialize_nemotron_vlm_dataset(spec)))
    st.lines.append(_verify(vlm_dir))


def _intersyn(demo: _Demo, st: _Stage) -> None:
    from puzzletron.dataset.acquisition import materialize_intersyn_subset
    from puzzletron.fixtures.hub import INTERSYN_MULTI, INTERSYN_SINGLE, repo_path

    out = demo.workdir / "snapshots" / "intersyn"
    # The fixture mirror cannot carry the pinned upstream shas: pin the fixture's own commits.
    manifest = materialize_intersyn_subset(
        out,
        rows_per_source=4,
        single_turn_revision=_git_head(repo_path(demo.hub_dir, INTERSYN_SINGLE)),
        multi_turn_revision=_git_head(repo_path(demo.hub_dir, INTERSYN_MULTI)),
    )
    st.lines.append(_manifest_line("intersyn", manifest))
    st.lines.append(_verify(out))


def _tokenize_and_pack(demo: _Demo, st: _Stage) -> None:
    """`build_batches` on the Puzzle-KD train split: chat template, assistant labels, packing plan."""
    from puzzletron.dataset.config import PackingSpec, PuzzletronDataSpec
    from puzzletron.dataset.text import build_batches
    from puzzletron.fixtures.tokenizer import build_chat_tokenizer

    tok_dir = build_chat_tokenizer(demo.workdir / "tokenizer")
    spec = PuzzletronDataSpec("text", "packed_varlen", PACK_SIZE, PackingSpec(pack_size=PACK_SIZE))
    batches = build_batches(
        demo.text_dir, tokenizer=tok_dir, spec=spec, batch_size=PACKS_PER_BATCH, dp_size=DP, seed=demo.seed
    )
    samples, plan = batches.tokenized.samples, batches.plan
    tokens = int(samples.lengths.sum())
    st.lines.append(
        f"tokenised {len(samples)} samples, {tokens:,} tokens ({int((samples.labels != -100).sum()):,} "
        f"supervised); skipped {batches.tokenized.skipped} rows without a supervised token"
    )
    st.lines.append(
        f"dropped {len(plan.dropped)} samples longer than pack_size ({plan.dropped_tokens:,} tokens); packed "
        f"{plan.total_tokens:,} tokens into {plan.num_rows} rows of {PACK_SIZE} (lower bound "
        f"{plan.lower_bound_rows}), efficiency {plan.efficiency:.2%}"
    )
    demo.batches = batches
    demo.facts.update(
        samples=len(samples),
        skipped=batches.tokenized.skipped,
        tokens=tokens,
        dropped=len(plan.dropped),
        dropped_tokens=plan.dropped_tokens,
        packed_tokens=plan.total_tokens,
        rows=plan.num_rows,
        bound=plan.lower_bound_rows,
        efficiency=plan.efficiency,
    )


def _deal(demo: _Demo, st: _Stage) -> None:
    """Build every batch of epoch 0 on both DP ranks; each pack (hence each packed sample) exactly once."""
    batches = demo.batches
    packs: list[int] = []
    docs: list[str] = []
    firsts = []
    for rank in range(DP):
        mine = batches.for_rank(rank)
        built = list(mine)
        packs.extend(i for b in built for i in b.source_metadata["items"] if i >= 0)
        docs.extend(d for b in built for d in b.source_metadata["document_ids"])
        padding = sum(b.source_metadata["padding"] for b in built)
        firsts.append(built[0])
        st.lines.append(
            f"rank {rank}: {len(built)} batches of {PACKS_PER_BATCH} packs x {PACK_SIZE} tokens "
            f"({padding} fully masked padding batches), first {_fp(built[0])}"
        )
    plan, samples = batches.plan, batches.tokenized.samples
    placed = sorted(samples.sample_ids[i] for i in plan.sample_order.tolist())
    if sorted(packs) != list(range(plan.num_rows)) or sorted(docs) != placed:
        raise AssertionError("the sampler did not deal every pack and every packed sample exactly once")
    st.lines.append(f"every one of {plan.num_rows} packs ({len(placed)} samples) dealt exactly once")
    demo.first_batch = firsts[0]
    demo.facts.update(fingerprints=[_fp(b) for b in firsts], steps=len(batches))


def _shard(demo: _Demo, st: _Stage) -> None:
    st.lines.extend(check_sharding(demo.first_batch, dp=DP, cp=CP, pp=PP))


STAGES: tuple[tuple[str, Callable[[_Demo, _Stage], None]], ...] = (
    ("batch contract on synthetic tensors (pack, shard over DP/CP/PP, reassemble)", _synthetic),
    ("fixture Hub: generate and serve on loopback", _serve_hub),
    ("materialise + verify Puzzle-KD (text)", _puzzle_kd),
    ("materialise + verify Nemotron-VLM (images)", _nemotron_vlm),
    ("materialise + verify InterSyn (images)", _intersyn),
    ("tokenise (chat template) and pack the text split (build_batches)", _tokenize_and_pack),
    (f"deal the packs to DP={DP} ranks and build every batch of epoch 0", _deal),
    (f"shard a packed text batch over DP={DP} x CP={CP} x PP={PP} and reassemble", _shard),
)


def _print_report(demo: _Demo, stages: list[_Stage], total: float) -> None:
    f = demo.facts
    print("\nreport")
    if "rows" in f:
        print(
            f"  text split    {f['samples']} samples, {f['tokens']:,} tokens "
            f"({f['skipped']} rows skipped: no supervised token)"
        )
        print(
            f"  packing       {f['rows']} rows of {PACK_SIZE} (lower bound {f['bound']}), efficiency "
            f"{f['efficiency']:.2%}; {f['packed_tokens']:,} tokens packed, {f['dropped']} samples "
            f"({f['dropped_tokens']:,} tokens) dropped as longer than pack_size"
        )
    if "fingerprints" in f:
        print(f"  sampler       {f['steps']} steps per epoch on each of {DP} DP ranks")
        print("  first batch per DP rank: " + "  ".join(f["fingerprints"]))
    print("  time per stage")
    for number, s in enumerate(stages, 1):
        print(f"  {s.status:>4}  {s.seconds:7.2f} s  [{number}] {s.name}")
    not_run = len(STAGES) - len(stages)
    failed = any(s.status == "FAIL" for s in stages)
    tail = f"FAILED at stage [{len(stages)}], {not_run} stage(s) after it not run" if failed else "ok"
    print(f"  total {total:.1f} s; {tail}")


def _run_demo(args: argparse.Namespace) -> int:
    import datasets

    if args.workdir is not None:
        try:
            Path(args.workdir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            print(f"puzzletron-data demo: --workdir {args.workdir}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    datasets.disable_progress_bars()
    started = time.perf_counter()
    stages: list[_Stage] = []
    with contextlib.ExitStack() as stack:
        # SIGTERM unwinds like Ctrl-C: the Hub server is stopped and the temporary workdir removed.
        stack.enter_context(_exit_on_sigterm())
        if args.workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="puzzletron-demo-")))
        else:
            workdir = Path(args.workdir)
        print(f"puzzletron-data demo in {workdir}", flush=True)
        demo = _Demo(workdir=workdir, seed=args.seed, stack=stack)
        for number, (name, body) in enumerate(STAGES, 1):
            stages.append(_run_stage(number, name, lambda st, body=body: body(demo, st)))
            if stages[-1].status == "FAIL":
                break  # later stages need the Hub, snapshot or batches of earlier ones
    _print_report(demo, stages, time.perf_counter() - started)
    return 1 if stages[-1].status == "FAIL" else 0


@contextlib.contextmanager
def _exit_on_sigterm() -> Iterator[None]:
    """While open, SIGTERM raises `SystemExit` (143) so that every ``finally`` and context exit runs."""

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _hf_env(workdir: Path, endpoint: str) -> contextlib.AbstractContextManager[None]:
    @contextlib.contextmanager
    def env() -> Iterator[None]:
        saved = {
            k: os.environ.get(k) for k in ("HF_ENDPOINT", "HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE")
        }
        os.environ.update(
            HF_ENDPOINT=endpoint,
            HF_HOME=str(workdir / "hf-home"),
            HF_HUB_CACHE=str(workdir / "hf-home" / "hub"),
            HF_DATASETS_CACHE=str(workdir / "hf-home" / "datasets"),
        )
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    return env()


def _manifest_line(name: str, manifest: Any) -> str:
    if isinstance(manifest, dict):
        keys = {k: manifest[k] for k in ("splits", "sample_count", "image_count") if k in manifest}
        return f"{name}: {keys}"
    return f"{name}: {manifest!r}"[:200]


def _verify(path: Path) -> str:
    from puzzletron.dataset.subset import verify_subset

    result = verify_subset(path)
    if result.problems:
        raise AssertionError(f"verify {path.name}: {'; '.join(result.problems[:3])}")
    return (
        f"verified {path.name}: {result.sample_count} samples, {result.image_count} images, every SHA-256 ok"
    )


def _verify_text_snapshot(path: Path, manifest: Any) -> str:
    """Every split the manifest lists loads offline with its row count and a ``messages`` column."""
    import datasets

    splits = dict(manifest["splits"])
    for split, expected in splits.items():
        rows = datasets.load_from_disk(str(path / split))
        if len(rows) != expected or "messages" not in rows.column_names:
            raise AssertionError(f"{path.name}/{split}: {len(rows)} rows, columns {rows.column_names}")
    return f"verified {path.name}: splits {splits} load offline with a messages column"


def _git_head(repo: Path) -> str:
    import subprocess

    return subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()


# ---------------------------------------------------------------------------------------------------------
# pack-report


def draw_packing(plan: Any, lengths: np.ndarray, out: Path, *, title: str = "", max_rows: int = 40) -> None:
    """Write a PNG: the first ``max_rows`` rows as bars split by sample, and the length histogram.

    ``lengths`` ``[N]`` are the planned samples' token counts (``plan`` indexes into them).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

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
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)


def _run_pack_report(args: argparse.Namespace) -> int:
    """Exit 0 with the report, 1 on a data error (snapshot, split, tokenizer, rows), 2 on a bad option."""
    from puzzletron.dataset.errors import ConfigError, PuzzletronDataError

    try:
        return _pack_report(args)
    except ConfigError as exc:
        print(f"puzzletron-data pack-report: {exc}", file=sys.stderr)
        return 2
    except (PuzzletronDataError, ValueError, KeyError, OSError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"puzzletron-data pack-report: {message}", file=sys.stderr)
        return 1


def _pack_report(args: argparse.Namespace) -> int:
    import datasets

    from puzzletron.dataset.config import PackingSpec
    from puzzletron.dataset.packing import plan_packing
    from puzzletron.dataset.text import load_text_split, tokenize_conversations

    datasets.disable_progress_bars()
    spec = PackingSpec(pack_size=args.pack_size)  # a bad option fails before any work
    start = time.perf_counter()
    rows = load_text_split(Path(args.snapshot), split=args.split)
    tokenized = tokenize_conversations(rows, tokenizer=Path(args.tokenizer), num_proc=args.num_proc)
    tokenize_s = time.perf_counter() - start
    lengths = tokenized.samples.lengths
    start = time.perf_counter()
    plan = plan_packing(lengths, spec, seed=args.seed)
    plan_s = time.perf_counter() - start
    title = f"Packing of {Path(args.snapshot).name} [{args.split}] into rows of {plan.pack_size} tokens"
    draw_packing(plan, lengths, Path(args.out), title=title)
    summary = plan.summary()
    print(f"snapshot        {args.snapshot} [{args.split}]: {len(rows)} rows")
    print(
        f"tokenised       {len(tokenized.samples)} samples, skipped {tokenized.skipped} (no supervised token)"
    )
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


def _seed(text: str) -> int:
    """An argparse type: an int >= 0 (numpy seeds cannot be negative)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an int >= 0, got {text!r}")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``demo`` and ``pack-report`` to the `puzzletron-data` parser."""
    demo = sub.add_parser("demo", help="run the data stage end to end on the built-in fixture Hub, offline")
    demo.add_argument("--workdir", type=Path, default=None, help="keep everything here (default: a temp dir)")
    demo.add_argument("--seed", type=_seed, default=0, help="seed of the fixtures, plans and samplers")
    demo.set_defaults(handler=_run_demo)

    report = sub.add_parser("pack-report", help="plan the packing of a text snapshot and draw it to a PNG")
    report.add_argument("snapshot", type=Path, help="a Puzzle-KD snapshot (save_to_disk folder with splits)")
    report.add_argument(
        "--tokenizer", required=True, help="a transformers tokenizer folder with a chat template"
    )
    report.add_argument("--pack-size", type=int, required=True, help="row length in tokens")
    report.add_argument("--out", required=True, help="where to write the PNG")
    report.add_argument("--split", default="train", help="split of the snapshot (default: train)")
    report.add_argument("--seed", type=_seed, default=0, help="seed of the row order")
    report.add_argument("--num-proc", type=int, default=1, help="tokenisation processes")
    report.set_defaults(handler=_run_pack_report)
