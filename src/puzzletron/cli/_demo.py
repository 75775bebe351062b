"""`puzzletron-data demo`: the data stage end to end on the built-in fixture Hub, offline.

In a temporary folder (or ``--workdir``): check the batch contract on synthetic tensors, generate the fixture
repositories and serve them on loopback (olah), materialise and verify the Puzzle-KD, Nemotron-VLM and
InterSyn snapshots, turn the text split into packed batches (`build_batches`) dealt to two DP ranks, shard one
over DP x CP x PP (`puzzletron.dataset.distributed.sharding.check_sharding`), write the README's "try it"
files (`puzzletron.cli._try_it`), run the VLM path on the subset (`puzzletron.cli._demo_vlm`), and print a
report (rows, tokens, efficiency, fingerprints, time per stage). ``--json``: stages to stderr, one JSON line
to stdout (`puzzletron.cli._output`). The demo stops at the first stage that fails (reported ``FAIL`` with its
error; the stages after it are counted, not run; exit code 1). A ``--workdir`` of an earlier run is reused
(its Hub and snapshots) only for the same ``--seed``; any other ``hub/`` there fails stage 2. Ctrl-C or
SIGTERM stops the Hub server on the way out.
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

from puzzletron.cli._args import seed_type
from puzzletron.cli._demo_vlm import vlm_stage
from puzzletron.cli._output import add_json, emit

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
    batches: Any = None  # TextBatches of DP rank 0 (its tokenised samples and packing plan fill the report)
    first_batches: list[Any] = field(default_factory=list)  # each DP rank's first batch of epoch 0
    assets: dict[str, Any] = field(default_factory=dict)  # the try-it files: tokenizer, processor, model


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
# Stages


def _synthetic(demo: _Demo, st: _Stage) -> None:
    """The batch contract on synthetic samples: pack, shard over DP x CP x PP, reassemble."""
    import numpy as np

    from puzzletron.dataset.config import PackingSpec, PuzzletronDataSpec
    from puzzletron.dataset.distributed.sharding import check_sharding
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
    from puzzletron.dataset.sources import TextAcquisitionSpec, materialize_puzzle_kd_dataset

    text_dir = demo.workdir / "snapshots" / "puzzle-kd"
    spec = TextAcquisitionSpec(output_dir=text_dir, train_samples=512, validation_samples=64)
    manifest = materialize_puzzle_kd_dataset(spec)
    st.lines.append(_manifest_line("puzzle-kd", manifest))
    st.lines.append(_verify_text_snapshot(text_dir, manifest))
    demo.text_dir = text_dir


def _nemotron_vlm(demo: _Demo, st: _Stage) -> None:
    from puzzletron.dataset.sources import VlmAcquisitionSpec, materialize_nemotron_vlm_dataset

    vlm_dir = demo.workdir / "snapshots" / "nemotron-vlm"
    spec = VlmAcquisitionSpec(output_dir=vlm_dir, num_samples=24)
    st.lines.append(_manifest_line("nemotron-vlm", materialize_nemotron_vlm_dataset(spec)))
    st.lines.append(_verify(vlm_dir))


def _intersyn(demo: _Demo, st: _Stage) -> None:
    from puzzletron.dataset.sources import materialize_intersyn_subset
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
    from puzzletron.dataset.pipelines.text import build_batches
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
    demo.first_batches = firsts


def _try_it(demo: _Demo, st: _Stage) -> None:
    """The README's "try it" inputs (`puzzletron.cli._try_it`) beside the demo's snapshots."""
    from puzzletron.cli._try_it import write_try_it_files

    demo.assets = files = write_try_it_files(demo.workdir, seed=demo.seed)
    st.lines.append(f"tokenizer {files['tokenizer']}, processor {files['processor']}")
    st.lines.append(f"model {files['model']}: a tiny random Qwen2 ({files['parameters']:,} parameters)")


def _shard(demo: _Demo, st: _Stage) -> None:
    from puzzletron.dataset.distributed.sharding import check_sharding

    st.lines.extend(check_sharding(demo.first_batches[0], dp=DP, cp=CP, pp=PP))


def _vlm(demo: _Demo, st: _Stage) -> None:
    st.lines.extend(vlm_stage(demo.workdir, demo.assets["processor"], seed=demo.seed, dp=DP, cp=CP, pp=PP))


STAGES: tuple[tuple[str, Callable[[_Demo, _Stage], None]], ...] = (
    ("batch contract on synthetic tensors (pack, shard over DP/CP/PP, reassemble)", _synthetic),
    ("fixture Hub: generate and serve on loopback", _serve_hub),
    ("materialise + verify Puzzle-KD (text)", _puzzle_kd),
    ("materialise + verify Nemotron-VLM (images)", _nemotron_vlm),
    ("materialise + verify InterSyn (images)", _intersyn),
    ("tokenise (chat template) and pack the text split (build_batches)", _tokenize_and_pack),
    (f"deal the packs to DP={DP} ranks and build every batch of epoch 0", _deal),
    (f"shard a packed text batch over DP={DP} x CP={CP} x PP={PP} and reassemble", _shard),
    ("write the README's try-it files: tokenizer, processor, tiny model", _try_it),
    (f"VLM store from the Nemotron-VLM subset, packs dealt to DP={DP}, sharded (build_vlm_batches)", _vlm),
)


def _print_report(demo: _Demo, stages: list[_Stage], total: float) -> None:
    print("\nreport")
    if demo.batches is not None:
        tokenized, plan = demo.batches.tokenized, demo.batches.plan
        tokens = int(tokenized.samples.lengths.sum())
        print(
            f"  text split    {len(tokenized.samples)} samples, {tokens:,} tokens "
            f"({tokenized.skipped} rows skipped: no supervised token)"
        )
        print(
            f"  packing       {plan.num_rows} rows of {PACK_SIZE} (lower bound {plan.lower_bound_rows}), "
            f"efficiency {plan.efficiency:.2%}; {plan.total_tokens:,} tokens packed, {len(plan.dropped)} "
            f"samples ({plan.dropped_tokens:,} tokens) dropped as longer than pack_size"
        )
    if demo.first_batches:
        print(f"  sampler       {len(demo.batches)} steps per epoch on each of {DP} DP ranks")
        print("  first batch per DP rank: " + "  ".join(_fp(b) for b in demo.first_batches))
    print("  time per stage")
    for number, s in enumerate(stages, 1):
        print(f"  {s.status:>4}  {s.seconds:7.2f} s  [{number}] {s.name}")
    not_run = len(STAGES) - len(stages)
    failed = any(s.status == "FAIL" for s in stages)
    tail = f"FAILED at stage [{len(stages)}], {not_run} stage(s) after it not run" if failed else "ok"
    print(f"  total {total:.1f} s; {tail}")


def _run_demo(args: argparse.Namespace) -> int:
    if not args.json:
        return _demo(args)
    with contextlib.redirect_stdout(sys.stderr):  # the stages and the report; stdout gets the JSON line
        code, demo, stages = _demo(args, keep=True)
    facts: dict[str, Any] = {"path": str(Path(args.workdir).absolute()) if args.workdir else None}
    if demo is not None and demo.batches is not None:
        samples, plan = demo.batches.tokenized.samples, demo.batches.plan
        facts |= {
            "sample_count": len(samples),
            "token_count": int(samples.lengths.sum()),
            "packs": plan.num_rows,
            "efficiency": plan.efficiency,
            "dropped_samples": len(plan.dropped),
            "dropped_tokens": plan.dropped_tokens,
        }
    if demo is not None:  # without --workdir the try-it files went with the temporary folder: not named
        facts["fingerprints"] = [str(b.fingerprint) for b in demo.first_batches]
        facts |= demo.assets if args.workdir else {}
    facts["stages"] = [{"name": s.name, "status": s.status, "seconds": round(s.seconds, 3)} for s in stages]
    emit("demo", "ok" if code == 0 else "failed", **facts)
    return code


def _demo(args: argparse.Namespace, *, keep: bool = False) -> Any:
    """Run the stages and print the report; the exit code (with ``keep``: also the demo and its stages)."""
    import datasets

    if args.workdir is not None:
        try:
            Path(args.workdir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            print(f"puzzletron-data demo: --workdir {args.workdir}: {exc.strerror or exc}", file=sys.stderr)
            return (2, None, []) if keep else 2
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
    code = 1 if stages[-1].status == "FAIL" else 0
    return (code, demo, stages) if keep else code


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


@contextlib.contextmanager
def _hf_env(workdir: Path, endpoint: str) -> Iterator[None]:
    """While open, the Hub client talks to ``endpoint`` and caches under ``workdir/hf-home``."""
    names = ("HF_ENDPOINT", "HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE")
    saved = {k: os.environ.get(k) for k in names}
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


def _manifest_line(name: str, manifest: Any) -> str:
    if isinstance(manifest, dict):
        keys = {k: manifest[k] for k in ("splits", "sample_count", "image_count") if k in manifest}
        return f"{name}: {keys}"
    return f"{name}: {manifest!r}"[:200]


def _verify(path: Path) -> str:
    from puzzletron.dataset.formats.subset import verify_subset

    result = verify_subset(path)
    if result.problems:
        raise AssertionError(f"verify {path.name}: {'; '.join(result.problems[:3])}")
    return (
        f"verified {path.name}: {result.sample_count} samples, {result.image_count} images, every SHA-256 ok"
    )


def _verify_text_snapshot(path: Path, manifest: Any) -> str:
    """Every byte checks out, and every split the manifest lists loads offline with its row count and a
    ``messages`` column."""
    from puzzletron.dataset import formats
    from puzzletron.dataset.formats.text_snapshot import open_split

    result = formats.verify(path)
    if result.problems:
        raise AssertionError(f"verify {path.name}: {'; '.join(result.problems[:3])}")
    splits = dict(manifest["splits"])
    for split, expected in splits.items():
        rows = open_split(path, split).load()
        if len(rows) != expected or "messages" not in rows.column_names:
            raise AssertionError(f"{path.name}/{split}: {len(rows)} rows, columns {rows.column_names}")
    return f"verified {path.name}: splits {splits} load offline with a messages column"


def _git_head(repo: Path) -> str:
    import subprocess

    return subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``demo`` to the `puzzletron-data` parser."""
    demo = sub.add_parser("demo", help="run the data stage end to end on the built-in fixture Hub, offline")
    demo.add_argument("--workdir", type=Path, default=None, help="keep everything here (default: a temp dir)")
    demo.add_argument("--seed", type=seed_type, default=0, help="seed of the fixtures, plans and samplers")
    add_json(demo)
    demo.set_defaults(handler=_run_demo)
