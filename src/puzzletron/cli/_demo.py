"""`puzzletron-data demo` and `puzzletron-data pack-report`.

``demo`` runs the data stage end to end on the built-in fixture Hub, offline, in a temporary folder (or
``--workdir``): generate the fixture repositories, serve them on loopback (olah), materialise the
Puzzle-KD, Nemotron-VLM and InterSyn snapshots and verify them, tokenise and pack the text split, shard a
packed batch over DP x CP x PP and check that it reassembles exactly, and print a short report. Every stage
is timed; a stage whose library code is not available yet is reported as ``skip`` with the reason (the
exit code stays 0), a stage that fails is ``FAIL`` (exit code 1).

``pack-report`` plans the packing of a tokenised snapshot split and draws it (rows as bars split by sample,
and the length histogram) into a PNG; the numbers go to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["register"]


class _Skip(Exception):
    """A stage that cannot run yet (its library code has not landed); not a failure."""


@dataclass
class _Stage:
    name: str
    status: str = "ok"
    seconds: float = 0.0
    lines: list[str] = field(default_factory=list)


@dataclass
class _Report:
    stages: list[_Stage] = field(default_factory=list)

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[_Stage]:
        stage = _Stage(name)
        self.stages.append(stage)
        print(f"[{len(self.stages)}] {name} ...", flush=True)
        start = time.perf_counter()
        try:
            yield stage
        except _Skip as exc:
            stage.status = "skip"
            stage.lines.append(f"skipped: {exc}")
        except (NotImplementedError, ImportError) as exc:
            stage.status = "skip"
            stage.lines.append(f"skipped, not implemented yet: {type(exc).__name__}: {exc}".rstrip(": "))
        except Exception as exc:
            stage.status = "FAIL"
            stage.lines.append(f"{type(exc).__name__}: {exc}")
            stage.lines.extend(traceback.format_exc().rstrip().splitlines()[-6:])
        finally:
            stage.seconds = time.perf_counter() - start
            for line in stage.lines:
                print(f"    {line}", flush=True)
            print(f"    -> {stage.status} in {stage.seconds:.2f} s", flush=True)

    @property
    def failed(self) -> bool:
        return any(s.status == "FAIL" for s in self.stages)


def _fp(batch: Any) -> str:
    """The first 12 hex digits of a batch's fingerprint."""
    fingerprint = getattr(batch, "fingerprint", None)
    if fingerprint is None:
        raise NotImplementedError("PuzzletronBatch.fingerprint")
    return str(fingerprint)[:12]


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


def _synthetic_stage(st: _Stage, *, seed: int) -> None:
    from puzzletron.dataset.config import PackingSpec, PuzzletronDataSpec
    from puzzletron.dataset.packing import TokenizedSamples, build_batch, plan_packing

    rng = np.random.default_rng(seed)
    lengths = np.clip(np.rint(rng.lognormal(np.log(60), 0.8, size=64)), 2, 256).astype(np.int64)
    ids = [rng.integers(1, 1000, size=n).tolist() for n in lengths]
    labels = [[*x[1:], -100] for x in ids]
    samples = TokenizedSamples.from_lists(ids, labels, sample_ids=[f"synthetic-{i}" for i in range(64)])
    spec = PuzzletronDataSpec("text", "packed_varlen", 256, PackingSpec(pack_size=256))
    plan = plan_packing(lengths, spec.packing, seed=seed)
    st.lines.append(
        f"{len(lengths)} synthetic samples, {plan.total_tokens} tokens -> {plan.num_rows} rows of 256 "
        f"(bound {plan.lower_bound_rows}), efficiency {plan.efficiency:.2%}"
    )
    rows = plan.rows[:4]
    batch = build_batch(samples, rows, spec=spec)
    st.lines.append(f"packed batch {tuple(batch.input_ids.shape)}: fingerprint {_fp(batch)}")
    st.lines.extend(check_sharding(batch, dp=2, cp=2, pp=2))
    one_row = build_batch(samples, rows[:1], spec=spec)
    st.lines.extend(check_sharding(one_row, dp=2, cp=1, pp=1))


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


def _tokenize_and_pack(
    st: _Stage,
    *,
    workdir: Path,
    text_dir: Path | None,
    hub_root: Path | None,
    seed: int,
    facts: dict[str, Any],
) -> tuple[Any, Any, Any, int]:
    import datasets

    from puzzletron.dataset.config import PackingSpec, PuzzletronDataSpec
    from puzzletron.dataset.packing import plan_packing
    from puzzletron.dataset.text import tokenize_conversations
    from puzzletron.fixtures.tokenizer import build_chat_tokenizer

    tok_dir = build_chat_tokenizer(workdir / "tokenizer")
    if text_dir is not None and (text_dir / "train").exists():
        rows = datasets.load_from_disk(str(text_dir / "train"))
        st.lines.append(f"source: Puzzle-KD snapshot {text_dir} (train, {len(rows)} rows)")
    elif hub_root is not None:
        from puzzletron.fixtures.hub import PUZZLE_KD, repo_path

        files = sorted(str(p) for p in repo_path(hub_root, PUZZLE_KD).glob("data/train-*.parquet"))
        rows = datasets.load_dataset("parquet", data_files=files, split="train")
        st.lines.append(f"source: fixture parquet (snapshot not available), {len(rows)} rows")
    else:
        raise _Skip("no text source")
    tokenized = tokenize_conversations(rows, tokenizer=tok_dir, num_proc=1)
    samples = tokenized.samples
    pack_size = 4096
    spec = PuzzletronDataSpec("text", "packed_varlen", pack_size, PackingSpec(pack_size=pack_size))
    plan = plan_packing(samples.lengths, spec.packing, seed=seed, sample_ids=samples.sample_ids)
    st.lines.append(
        f"tokenised {len(samples)} samples ({int(samples.lengths.sum())} tokens, skipped "
        f"{tokenized.skipped} without a supervised token); supervised tokens "
        f"{int((samples.labels != -100).sum())}"
    )
    st.lines.append(
        f"packed into {plan.num_rows} rows of {pack_size} (lower bound {plan.lower_bound_rows}), "
        f"efficiency {plan.efficiency:.2%}, dropped {len(plan.dropped)}"
    )
    facts.update(
        rows=plan.num_rows, bound=plan.lower_bound_rows, efficiency=plan.efficiency, tokens=plan.total_tokens
    )
    return samples, spec, plan, tokenized.pad_token_id


def _deal(st: _Stage, packed: tuple[Any, Any, Any, int], *, seed: int, facts: dict[str, Any]) -> Any:
    """Deal the plan's rows to 2 DP ranks for epoch 0, each pack once; return rank 0's first batch."""
    from puzzletron.dataset.sampler import DistributedPackSampler, PackedBatches

    samples, spec, plan, pad = packed
    dataset = PackedBatches(samples, spec, plan, pad_token_id=pad)
    dealt: list[int] = []
    firsts = []
    for rank in range(2):
        sampler = DistributedPackSampler(len(dataset), batch_size=4, dp_rank=rank, dp_size=2, seed=seed)
        keys = list(sampler)
        dealt.extend(i for k in keys for i in k.items)
        firsts.append(dataset[keys[0]])
        padding = sum(k.is_padding for k in keys)
        st.lines.append(
            f"rank {rank}: {len(keys)} batches of 4 packs ({padding} padding), first {_fp(firsts[-1])}"
        )
    if sorted(dealt) != list(range(len(dataset))):
        raise AssertionError("the sampler did not deal every pack exactly once")
    st.lines.append(f"every one of {len(dataset)} packs dealt exactly once")
    facts["fingerprints"] = [_fp(b) for b in firsts]
    return firsts[0]


def _run_demo(args: argparse.Namespace) -> int:
    import datasets

    datasets.disable_progress_bars()
    report = _Report()
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if args.workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="puzzletron-demo-")))
        else:
            workdir = Path(args.workdir)
            workdir.mkdir(parents=True, exist_ok=True)
        print(f"puzzletron-data demo in {workdir}", flush=True)

        with report.stage("batch contract on synthetic tensors (pack, DP/CP/PP, reassemble)") as st:
            _synthetic_stage(st, seed=args.seed)

        hub_root: Path | None = None
        endpoint: str | None = None
        with report.stage("fixture Hub: generate and serve on loopback") as st:
            from puzzletron.fixtures.hub import generate_fixture_hub
            from puzzletron.fixtures.mirror import serve_hub

            hub_dir = workdir / "hub"
            hub = (
                generate_fixture_hub(hub_dir, seed=args.seed) if not (hub_dir / "mirrors").exists() else None
            )
            hub_root = hub_dir
            endpoint = stack.enter_context(serve_hub(hub_dir))
            stack.enter_context(_hf_env(workdir, endpoint))
            st.lines.append(f"serving {hub_dir / 'mirrors'} at {endpoint}")
            if hub is not None:
                st.lines.extend(f"{repo} @ {sha[:12]}" for repo, sha in hub.shas.items())

        text_dir = workdir / "snapshots" / "puzzle-kd"
        with report.stage("materialise + verify Puzzle-KD (text)") as st:
            if endpoint is None:
                raise _Skip("no Hub mirror")
            from puzzletron.dataset.acquisition import TextAcquisitionSpec, materialize_puzzle_kd_dataset

            spec = TextAcquisitionSpec(output_dir=text_dir, train_samples=512, validation_samples=64)
            manifest = materialize_puzzle_kd_dataset(spec)
            st.lines.append(_manifest_line("puzzle-kd", manifest))
            st.lines.append(_verify_text_snapshot(text_dir, manifest))

        with report.stage("materialise + verify Nemotron-VLM (images)") as st:
            if endpoint is None:
                raise _Skip("no Hub mirror")
            from puzzletron.dataset.acquisition import VlmAcquisitionSpec, materialize_nemotron_vlm_dataset

            vlm_dir = workdir / "snapshots" / "nemotron-vlm"
            spec = VlmAcquisitionSpec(output_dir=vlm_dir, num_samples=24)
            st.lines.append(_manifest_line("nemotron-vlm", materialize_nemotron_vlm_dataset(spec)))
            st.lines.append(_verify(vlm_dir))

        with report.stage("materialise + verify InterSyn (images)") as st:
            if hub_root is None:
                raise _Skip("no Hub mirror")
            _intersyn(st, workdir=workdir, hub_root=hub_root)

        packed = None
        facts: dict[str, Any] = {}
        with report.stage("tokenise (chat template) and pack the text split") as st:
            packed = _tokenize_and_pack(
                st,
                workdir=workdir,
                text_dir=text_dir if text_dir.exists() else None,
                hub_root=hub_root,
                seed=args.seed,
                facts=facts,
            )

        batch = None
        with report.stage("deal the packs to DP=2 ranks (sampler) and build batches") as st:
            if packed is None:
                raise _Skip("no packed text split")
            batch = _deal(st, packed, seed=args.seed, facts=facts)

        with report.stage("shard a packed text batch over DP=2 x CP=2 x PP=2 and reassemble") as st:
            if batch is None:
                raise _Skip("no tokenised batch")
            st.lines.extend(check_sharding(batch, dp=2, cp=2, pp=2))

    total = time.perf_counter() - started
    if facts:
        print(
            f"\ntext split: {facts['tokens']:,} tokens packed into {facts['rows']} rows "
            f"(lower bound {facts['bound']}), efficiency {facts['efficiency']:.2%}"
        )
    if "fingerprints" in facts:
        print("first batch per DP rank: " + "  ".join(facts["fingerprints"]))
    print("\nsummary")
    for s in report.stages:
        print(f"  {s.status:>4}  {s.seconds:7.2f} s  {s.name}")
    print(f"  total {total:.1f} s; {'FAILED' if report.failed else 'ok'}")
    return 1 if report.failed else 0


def _intersyn(st: _Stage, *, workdir: Path, hub_root: Path) -> None:
    import inspect

    from puzzletron.dataset.acquisition import materialize_intersyn_subset
    from puzzletron.fixtures.hub import INTERSYN_MULTI, INTERSYN_SINGLE
    from puzzletron.fixtures.hub import repo_path as _repo_path

    out = workdir / "snapshots" / "intersyn"
    params = inspect.signature(materialize_intersyn_subset).parameters
    kwargs: dict[str, Any] = {"rows_per_source": 4}
    # The fixture mirror cannot carry the pinned upstream shas: pin the fixture's own commits.
    shas = {repo: _git_head(_repo_path(hub_root, repo)) for repo in (INTERSYN_SINGLE, INTERSYN_MULTI)}
    for name in params:
        if "revision" in name and "single" in name:
            kwargs[name] = shas[INTERSYN_SINGLE]
        elif "revision" in name and "multi" in name:
            kwargs[name] = shas[INTERSYN_MULTI]
    st.lines.append(_manifest_line("intersyn", materialize_intersyn_subset(out, **kwargs)))
    st.lines.append(_verify(out))


def _git_head(repo: Path) -> str:
    import subprocess

    return subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()


def _load_split(snapshot: Path, split: str) -> Any:
    import datasets

    if (snapshot / split).is_dir():
        return datasets.load_from_disk(str(snapshot / split))
    loaded = datasets.load_from_disk(str(snapshot))
    return loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded


def draw_packing(plan: Any, lengths: np.ndarray, out: Path, *, max_rows: int = 40) -> None:
    """Write a PNG: the first ``max_rows`` rows as bars split by sample, and the length histogram."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_rows = min(plan.num_rows, max_rows)
    stop = int(plan.row_offsets[n_rows])
    order = plan.sample_order[:stop]
    widths = lengths[order]
    counts = np.diff(plan.row_offsets[: n_rows + 1])
    row_of = np.repeat(np.arange(n_rows), counts)
    before = np.cumsum(widths) - widths
    left = before - np.repeat(before[plan.row_offsets[:n_rows]], counts)  # start of each sample in its row
    colours = plt.get_cmap("tab20")(np.arange(order.shape[0]) % 20)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 9), height_ratios=(3, 1.3))
    top.barh(np.arange(n_rows), plan.pack_size, color="#dddddd", height=0.8)  # slots (padding shows grey)
    top.barh(row_of, widths, left=left, color=colours, height=0.8, edgecolor="black", linewidth=0.4)
    top.set_xlim(0, plan.pack_size)
    top.set_ylim(n_rows - 0.5, -0.5)
    top.set_xlabel("tokens")
    top.set_ylabel("row")
    top.set_title(
        f"{plan.num_rows} rows of {plan.pack_size} (lower bound {plan.lower_bound_rows}), "
        f"efficiency {plan.efficiency:.2%}; first {n_rows} rows shown, one colour per sample"
    )
    bottom.hist(lengths, bins=60, color="#4c72b0")
    bottom.axvline(plan.pack_size, color="#c44e52", linestyle="--", label=f"pack_size {plan.pack_size}")
    bottom.set_xlabel("sample length (tokens)")
    bottom.set_ylabel("samples")
    bottom.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)


def _run_pack_report(args: argparse.Namespace) -> int:
    import datasets

    from puzzletron.dataset.config import PackingSpec
    from puzzletron.dataset.packing import plan_packing
    from puzzletron.dataset.text import tokenize_conversations

    datasets.disable_progress_bars()
    start = time.perf_counter()
    rows = _load_split(Path(args.snapshot), args.split)
    tokenized = tokenize_conversations(rows, tokenizer=Path(args.tokenizer), num_proc=args.num_proc)
    tokenize_s = time.perf_counter() - start
    lengths = tokenized.samples.lengths
    start = time.perf_counter()
    plan = plan_packing(lengths, PackingSpec(pack_size=args.pack_size), seed=args.seed)
    plan_s = time.perf_counter() - start
    draw_packing(plan, lengths, Path(args.out))
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


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``demo`` and ``pack-report`` to the `puzzletron-data` parser."""
    demo = sub.add_parser("demo", help="run the data stage end to end on the built-in fixture Hub, offline")
    demo.add_argument("--workdir", type=Path, default=None, help="keep everything here (default: a temp dir)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the fixtures, plans and samplers")
    demo.set_defaults(handler=_run_demo)

    report = sub.add_parser("pack-report", help="plan the packing of a text snapshot and draw it to a PNG")
    report.add_argument("snapshot", type=Path, help="a Puzzle-KD snapshot (save_to_disk folder with splits)")
    report.add_argument(
        "--tokenizer", required=True, help="a transformers tokenizer folder with a chat template"
    )
    report.add_argument("--pack-size", type=int, required=True, help="row length in tokens")
    report.add_argument("--out", required=True, help="where to write the PNG")
    report.add_argument("--split", default="train", help="split of the snapshot (default: train)")
    report.add_argument("--seed", type=int, default=0)
    report.add_argument("--num-proc", type=int, default=1, help="tokenisation processes")
    report.set_defaults(handler=_run_pack_report)
