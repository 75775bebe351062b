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
    """Load-balanced (zigzag) CP token indices when `parallel` provides them, else a contiguous split."""
    try:
        from puzzletron.dataset.parallel import load_balanced_cp_indices

        return load_balanced_cp_indices(batch, cp_rank=cp_rank, cp_size=cp_size)
    except (ImportError, NotImplementedError, TypeError):
        length = batch.sequence_length
        if length % cp_size:
            raise ValueError(f"sequence length {length} not divisible by cp {cp_size}") from None
        chunk = length // cp_size
        return torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)


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
    return f"verified {path.name}: {result!r}"[:200]


def _tokenize_and_pack(st: _Stage, *, workdir: Path, text_dir: Path | None, hub_root: Path | None, seed: int):
    import datasets

    from puzzletron.dataset.config import PackingSpec, PuzzletronDataSpec
    from puzzletron.dataset.packing import build_batch, plan_packing
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
    pack_size = 1024
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
    batch = build_batch(samples, plan.rows[:8], spec=spec, pad_token_id=tokenized.pad_token_id)
    st.lines.append(f"first batch {tuple(batch.input_ids.shape)}: fingerprint {_fp(batch)}")
    return batch


def _run_demo(args: argparse.Namespace) -> int:
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
            st.lines.append(_manifest_line("puzzle-kd", materialize_puzzle_kd_dataset(spec)))
            with contextlib.suppress(ImportError, NotImplementedError):
                st.lines.append(_verify(text_dir))

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

        batch = None
        with report.stage("tokenise (chat template) and pack the text split") as st:
            batch = _tokenize_and_pack(
                st,
                workdir=workdir,
                text_dir=text_dir if text_dir.exists() else None,
                hub_root=hub_root,
                seed=args.seed,
            )

        with report.stage("shard a packed text batch over DP=2 x CP=2 x PP=2 and reassemble") as st:
            if batch is None:
                raise _Skip("no tokenised batch")
            st.lines.extend(check_sharding(batch, dp=2, cp=2, pp=2))

    total = time.perf_counter() - started
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


def _run_pack_report(args: argparse.Namespace) -> int:
    from puzzletron.cli._pack_report import pack_report

    return pack_report(
        Path(args.snapshot),
        tokenizer=Path(args.tokenizer),
        pack_size=args.pack_size,
        out=Path(args.out),
        split=args.split,
        seed=args.seed,
        num_proc=args.num_proc,
    )


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``demo`` and ``pack-report`` to the `puzzletron-data` parser."""
    demo = sub.add_parser("demo", help="run the data stage end to end on the built-in fixture Hub, offline")
    demo.add_argument("--workdir", type=Path, default=None, help="keep everything here (default: a temp dir)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the fixtures, plans and samplers")
    demo.set_defaults(handler=_run_demo)

    report = sub.add_parser("pack-report", help="plan the packing of a text snapshot and draw it to a PNG")
    report.add_argument("snapshot", help="a Puzzle-KD snapshot (save_to_disk folder with train/validation)")
    report.add_argument(
        "--tokenizer", required=True, help="a transformers tokenizer folder with a chat template"
    )
    report.add_argument("--pack-size", type=int, required=True, help="row length in tokens")
    report.add_argument("--out", required=True, help="where to write the PNG")
    report.add_argument("--split", default="train", help="split of the snapshot (default: train)")
    report.add_argument("--seed", type=int, default=0)
    report.add_argument("--num-proc", type=int, default=1, help="tokenisation processes")
    report.set_defaults(handler=_run_pack_report)
