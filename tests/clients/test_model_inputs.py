"""`model_inputs` feeds real Hugging Face models: packed logits and losses equal per-document ones.

Tiny random float64 models on the CPU: Qwen2 (text, packed batches from `build_batches`) and Qwen2.5-VL
(mRoPE, a neat-packed batch from AutoModel's own VLM packer and collator through `batch_from_automodel`).
Every document of a packed batch is compared with the same document run alone (``tests/_tiny_models.py``),
for the whole batch, per DP rank after `dp_slice`, per microbatch after `pp_microbatches`, and per CP rank
after `cp_partition` (each rank's share of each document alone; gathered back into the row's token order,
the tokens whose context is all on their rank equal the full row's). The VLM row is embedded before
`cp_partition` (its images stay whole).

Bounds: per-token logits within 1e-10 of the per-document ones (measured: 0.0). HF computes the loss in
float32 (``transformers/loss/loss_utils.py:59`` ``logits.float()``): the loss equals HF's own loss of the
per-document logits within 1e-9 (measured: 0.0) and the float64 per-document loss within 1e-6 (measured up to
7e-7, float32 rounding of a mean near 6.5); a label shifted twice moves it by more than 1e-3.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import datasets
import pytest
import torch
from nemo_automodel.components.datasets.vlm.collate_fns import neat_packed_vlm_collater
from nemo_automodel.components.datasets.vlm.datasets import PreTokenizedDatasetWrapper
from nemo_automodel.components.datasets.vlm.neat_packing_vlm import neat_pack_dataset_vlm
from PIL import Image
from transformers.loss.loss_utils import ForCausalLMLoss

from _tiny_models import (
    conversations,
    document_logits,
    hf_loss,
    qwen2_5_vl_config,
    randomize,
    reference_loss,
    tiny_qwen2,
)
from puzzletron.dataset import (
    PuzzletronBatch,
    batch_from_automodel,
    load_materialized_conversation_dataset,
    materialize_normalized_conversation_samples,
)
from puzzletron.dataset.batch.cp import batch_cp_indices, inverse_cp_permutation
from puzzletron.dataset.clients.attention import model_inputs
from puzzletron.dataset.config import PackingSpec, PuzzletronDataSpec
from puzzletron.dataset.errors import BatchValidationError, ConfigError
from puzzletron.dataset.pipelines.text import build_batches
from puzzletron.fixtures.tokenizer import (
    build_chat_tokenizer,
    build_qwen2_5_vl_processor,
    load_qwen2_5_vl_processor,
)

pytestmark = pytest.mark.slow  # real models, per-document references: seconds, not milliseconds

LOGIT_TOL = 1e-10
LOSS_TOL = 1e-6


@pytest.fixture(scope="module")
def text_batches(tmp_path_factory: pytest.TempPathFactory) -> list[PuzzletronBatch]:
    """Packed rows of 128 tokens, 4 per batch, 2-5 chats per row: every batch of one epoch."""
    tokenizer = build_chat_tokenizer(tmp_path_factory.mktemp("tokenizer"))
    spec = PuzzletronDataSpec("text", "packed_varlen", 128, packing=PackingSpec(pack_size=128))
    rows = datasets.Dataset.from_list(conversations(36, seed=1, longest=6))
    batches = list(build_batches(rows, tokenizer=tokenizer, spec=spec, batch_size=4, seed=0))
    documents = [[len(row[row >= 0].unique()) for row in b.sequence.seq_ids] for b in batches[:2]]
    assert documents[0][0] >= 3 and min(max(rows) for rows in documents) >= 3, documents  # several per row
    return batches


@pytest.fixture(scope="module")
def qwen2() -> dict[str, torch.nn.Module]:
    """The same weights under sdpa and eager attention; ``use_cache`` left at Qwen2's default (True)."""
    return {attn: tiny_qwen2(attn, vocab_size=800) for attn in ("sdpa", "eager")}


def _check(model: torch.nn.Module, batch: PuzzletronBatch, **options: Any) -> tuple[torch.Tensor, float, int]:
    """Packed logits and loss through `model_inputs` against the per-document reference; returns the
    logits, the HF loss and the number of supervised tokens."""
    inputs = model_inputs(batch, **options)
    with torch.no_grad():
        out = model(**inputs)
    valid = batch.sequence.seq_ids >= 0
    aligned = options["backend"] == "eager"  # eager's float32 softmax: see tests/_tiny_models.py
    want = document_logits(model, inputs, batch.sequence.seq_ids, aligned=aligned)
    diff = (out.logits.double() - want)[valid].abs().max().item()
    assert diff <= LOGIT_TOL, diff
    loss, count = reference_loss(want, inputs["shift_labels"])
    assert abs(out.loss.item() - loss) <= LOSS_TOL, (out.loss.item(), loss)
    assert abs(out.loss.item() - hf_loss(want, inputs["shift_labels"])) <= 1e-9
    return out.logits.double(), out.loss.item(), count


OPTIONS = {
    "sdpa": {"backend": "sdpa"},
    "sdpa-bool-mask": {"backend": "sdpa", "mask": "block_causal"},
    "eager": {"backend": "eager"},
    "eager-additive-mask": {"backend": "eager", "mask": "block_causal", "dtype": torch.float64},
}


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_packed_text_batches_give_per_document_logits_and_loss(
    qwen2: dict[str, torch.nn.Module], text_batches: list[PuzzletronBatch], name: str
) -> None:
    options = OPTIONS[name]
    for batch in text_batches[:2]:
        _check(qwen2[options["backend"]], batch, **options)


def test_documents_alone_in_shorter_rows_match_to_float32_softmax_precision_under_eager(
    qwen2: dict[str, torch.nn.Module], text_batches: list[PuzzletronBatch]
) -> None:
    # The documents alone in rows of their own length: sdpa is exact, eager's float32 softmax
    # (modeling_qwen2.py:167) rounds differently. Measured here: 0 for chats of 16+ tokens, up to ~1e-7.
    batch = text_batches[0]
    valid = batch.sequence.seq_ids >= 0
    for attn, bound in (("sdpa", LOGIT_TOL), ("eager", 1e-6)):
        inputs = model_inputs(batch, backend=attn)
        with torch.no_grad():
            logits = qwen2[attn](**inputs).logits.double()
        alone = document_logits(qwen2[attn], inputs, batch.sequence.seq_ids)
        assert (logits - alone)[valid].abs().max().item() <= bound


def test_the_use_cache_trap_and_a_double_shift_are_caught(
    qwen2: dict[str, torch.nn.Module], text_batches: list[PuzzletronBatch]
) -> None:
    batch = text_batches[0]
    model = qwen2["sdpa"]
    assert model.config.use_cache  # Qwen2's default: HF then builds a cache and ignores packed positions
    inputs = model_inputs(batch, backend="sdpa")
    logits, loss, _ = _check(model, batch, backend="sdpa")
    with torch.no_grad():
        trapped = model(**{**inputs, "use_cache": None}).logits.double()  # as `model(**batch.model_kwargs)`
        plain = {k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}
        twice = model(**plain, labels=inputs["shift_labels"])  # shifted labels as HF `labels`
    assert (trapped - logits)[batch.hidden_mask].abs().max().item() > 1e-3
    assert abs(twice.loss.item() - loss) > 1e-3


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_every_dp_rank_and_pp_microbatch_gets_per_document_logits(
    qwen2: dict[str, torch.nn.Module], text_batches: list[PuzzletronBatch], backend: str
) -> None:
    batch = text_batches[0]  # checked whole in test_packed_text_batches_give_per_document_logits_and_loss
    model = qwen2[backend]
    options = {"backend": backend}
    ranks = [_check(model, batch.dp_slice(dp_rank=r, dp_size=2), **options) for r in range(2)]
    for part in batch.pp_microbatches(3):  # rows 2 + 1 + 1
        _check(model, part, **options)
    one_row = batch.pp_microbatches(4)[0]
    for rank in range(2):  # one packed row split by whole samples
        _check(model, one_row.dp_slice(dp_rank=rank, dp_size=2), **options)
    # DP ranks together are the whole batch: the same logits row for row, the same token-mean loss.
    inputs = model_inputs(batch, **options)
    with torch.no_grad():
        whole = model(**inputs)
    gathered = torch.cat([logits for logits, _, _ in ranks])
    assert (gathered - whole.logits.double()).abs().max().item() <= LOGIT_TOL
    count = int((inputs["shift_labels"] != -100).sum())
    assert abs(sum(loss * n for _, loss, n in ranks) / count - whole.loss.item()) <= LOSS_TOL


def _whole_context(row: PuzzletronBatch, indices: list[torch.Tensor]) -> torch.Tensor:
    """``[T]`` bool: tokens of the one-row batch whose earlier document tokens all sit on their own CP rank
    (``indices[r]`` = rank r's tokens). Such a token sees its whole context there, so its local logits are
    the full row's; every document's first token qualifies."""
    owner = torch.empty(row.sequence_length, dtype=torch.long)
    for rank, idx in enumerate(indices):
        owner[idx] = rank
    seq = row.sequence.seq_ids[0]
    whole = torch.tensor(
        [
            int(s) >= 0 and bool((owner[: p + 1][seq[: p + 1] == s] == owner[p]).all())
            for p, s in enumerate(seq)
        ]
    )
    assert int(whole.sum()) >= len(row.sequence.sample_offsets)
    return whole


@pytest.mark.parametrize("cp_size", [2, 3])
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_every_cp_rank_attends_within_its_share_of_each_document(
    qwen2: dict[str, torch.nn.Module], text_batches: list[PuzzletronBatch], backend: str, cp_size: int
) -> None:
    # A CP rank runs its own block of causal attention: every document's tokens this rank holds, at their
    # global RoPE positions. The reference is each such share run alone; gathered over the ranks it covers
    # every token of the row exactly once.
    row = text_batches[0].pp_microbatches(4)[0]
    model = qwen2[backend]
    options: dict[str, Any] = {"backend": backend}
    if backend == "eager":
        options["dtype"] = torch.float64  # the load-balanced positions jump: an explicit additive mask
    indices, logits, losses = [], [], []
    for rank in range(cp_size):
        idx = batch_cp_indices(row, cp_rank=rank, cp_size=cp_size)
        local = row.cp_partition(idx, cp_rank=rank, cp_size=cp_size)
        if rank == 0:  # chunks 0 and 2*cp-1 of each document: the positions jump, HF would split there
            assert "attention_mask" in model_inputs(local, **options)
        local_logits, loss, count = _check(model, local, **options)
        indices.append(idx)
        logits.append(local_logits)
        losses.append((loss, count))
    inverse = inverse_cp_permutation(indices)
    gathered = torch.cat(logits, dim=1)[:, inverse]
    assert gathered.shape[1] == row.sequence_length
    assert sum(count for _, count in losses) == int((row.labels != -100).sum())  # every label, once
    whole = _whole_context(row, indices)
    full, _, _ = _check(model, row, **options)
    bound = LOGIT_TOL if backend == "sdpa" else 1e-6  # eager: float32 softmax over rows of another length
    assert (gathered[0, whole] - full[0, whole]).abs().max().item() <= bound


# --- Qwen2.5-VL, mRoPE, AutoModel's neat VLM packing ----------------------------------------------------


def _vlm_sample(i: int, images: int) -> dict[str, Any]:
    pictures = [
        {"type": "image", "image": Image.new("RGB", (56, 56 + 28 * j), (40 * i % 256, 90 * j, 160))}
        for j in range(images)
    ]
    return {
        "conversation": [
            {"role": "user", "content": [*pictures, {"type": "text", "text": f"Picture {i}: how many?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": f"There are {i + 2} robots."}]},
        ],
        "image_count": images,
        "source": {"dataset": "fixture/vlm", "revision": "r1", "row_id": str(i)},
    }


IMAGES = (1, 2, 0, 1, 1, 2, 1, 0)


class _Contract:
    """AutoModel's structural `PackedSequenceContract`: a 4-D block-causal mask, no metadata."""

    packed_mask_type = "block_causal"
    requires_packed_sequence_metadata = False


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    root = tmp_path_factory.mktemp("vlm")
    processor = load_qwen2_5_vl_processor(build_qwen2_5_vl_processor(root / "processor"))
    samples = [_vlm_sample(i, n) for i, n in enumerate(IMAGES)]
    materialize_normalized_conversation_samples(iter(samples), root / "subset")
    dataset = load_materialized_conversation_dataset(root / "subset", num_samples=len(IMAGES))
    config = Qwen2_5_VLConfig.from_dict(qwen2_5_vl_config(processor.tokenizer))
    models = {}
    for attn in ("sdpa", "eager"):
        own = copy.deepcopy(config)  # _from_config writes attn_implementation into the config it is given
        model = Qwen2_5_VLForConditionalGeneration._from_config(
            own, attn_implementation=attn, dtype=torch.float64
        )
        models[attn] = randomize(model, std=0.1).eval()
    wrapped = PreTokenizedDatasetWrapper(dataset, processor, inject_fake_images=False)
    packs = neat_pack_dataset_vlm(
        wrapped,
        # AutoModel estimates 500 tokens per stored image (it cannot see their size): a large pack_size
        # lets two image documents share a pack; rows are as long as the packs really are (under 100).
        pack_size=1040,
        get_rope_index=models["sdpa"].model.get_rope_index,
        ds_raw=dataset,
        processor=processor,
        balance_media_tokens=False,
    )
    return {"packs": packs, "models": models, "processor": processor}


@pytest.fixture(scope="module")
def vlm_batch(vlm: dict[str, Any]) -> PuzzletronBatch:
    packs = vlm["packs"]
    collated = neat_packed_vlm_collater(
        copy.deepcopy([packs[i] for i in range(len(packs))]), packing=_Contract()
    )
    assert tuple(collated["attention_mask"].shape)[1] == 1  # AutoModel's own 4-D bool mask
    batch = batch_from_automodel(
        collated,
        sample_ids=[f"pack-{i}" for i in range(len(packs))],
        source_metadata={},
        layout="packed_varlen",
    )
    multi = [bin_ for bin_ in packs.bins if len(bin_) >= 2 and sum(IMAGES[i] for i in bin_) >= 2]
    assert multi, packs.bins  # a pack holds several documents and several images
    return batch


def _vlm_media(batch: PuzzletronBatch, inputs: dict[str, Any], model: torch.nn.Module, image_token: int):
    """``media(row, cols)`` for `document_logits`: the document's own images, its mm token types, and the
    model's own mRoPE positions for it alone (``get_rope_index``; 1-D arange without images)."""
    ids = inputs["input_ids"]
    grid = inputs.get("image_grid_thw", torch.zeros(0, 3, dtype=torch.long))  # absent: no image in the part
    patches = grid.prod(dim=1)
    # Image k's tokens: the k-th run of image tokens in row-major order.
    flat = (ids == image_token).reshape(-1).long()
    run = torch.cumsum(torch.diff(flat, prepend=flat.new_zeros(1)) == 1, 0).reshape(ids.shape) - 1

    def media(row: int, cols: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
        tokens = ids[row, cols]
        types = (tokens == image_token).long()
        images = run[row, cols][types.bool()].unique().tolist()
        if not images:
            return {}, torch.arange(cols.numel())
        starts = torch.cat([patches.new_zeros(1), patches.cumsum(0)])
        pixels = torch.cat([inputs["pixel_values"][starts[k] : starts[k + 1]] for k in images])
        grids = grid[images]
        positions, _ = model.model.get_rope_index(tokens[None], types[None], image_grid_thw=grids)
        extra = {"pixel_values": pixels, "image_grid_thw": grids, "mm_token_type_ids": types[None]}
        return extra, positions[:, 0]

    return media


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_packed_vlm_batch_with_mrope_gives_per_document_logits_and_loss(
    vlm: dict[str, Any], vlm_batch: PuzzletronBatch, backend: str
) -> None:
    model = vlm["models"][backend]
    image_token = vlm["processor"].image_token_id
    options: dict[str, Any] = {"backend": backend}
    if backend == "eager":
        options["dtype"] = torch.float64
    parts = [vlm_batch]
    if backend == "sdpa":  # the splits move rows and media the same way under either attention
        parts += list(vlm_batch.pp_microbatches(3))
        parts += [vlm_batch.dp_slice(dp_rank=r, dp_size=2) for r in range(2)]
    for part in parts:
        inputs = model_inputs(part, **options)
        assert inputs["position_ids"].shape[0] == 3  # mRoPE: HF cannot see documents in such positions,
        several = bool((part.sequence.seq_ids[:, 1:] > part.sequence.seq_ids[:, :-1]).any())
        assert ("attention_mask" in inputs) == several  # so a row of several gets the 4-D mask
        assert "attention_mask" not in inputs or inputs["attention_mask"].dim() == 4
        with torch.no_grad():
            out = model(**inputs)
        media = _vlm_media(part, inputs, model, image_token)
        want = document_logits(model, inputs, part.sequence.seq_ids, media=media, aligned=backend == "eager")
        valid = part.sequence.seq_ids >= 0
        diff = (out.logits.double() - want)[valid].abs().max().item()
        assert diff <= LOGIT_TOL, diff
        loss, _ = reference_loss(want, inputs["shift_labels"])
        assert abs(out.loss.item() - loss) <= LOSS_TOL
        assert abs(out.loss.item() - hf_loss(want, inputs["shift_labels"])) <= 1e-9


def test_model_inputs_does_not_leak_collator_metadata(vlm_batch: PuzzletronBatch) -> None:
    inputs = model_inputs(vlm_batch, backend="sdpa")
    assert set(inputs) == {
        "input_ids",
        "position_ids",
        "attention_mask",
        "mm_token_type_ids",
        "pixel_values",
        "image_grid_thw",
        "use_cache",
        "labels",
        "shift_labels",
        "num_items_in_batch",
    }
    assert inputs["attention_mask"].dtype == torch.bool


@pytest.mark.parametrize("cp_size", [2, 3])
def test_cp_ranks_of_a_packed_vlm_row_attend_within_their_share_after_embedding(
    vlm: dict[str, Any], vlm_batch: PuzzletronBatch, cp_size: int
) -> None:
    # Images cannot be split across CP ranks, so the full row is embedded first (HF's own embedding and
    # image features); each rank then runs its block of causal attention, as in the text test.
    model = vlm["models"]["sdpa"]
    image_token = vlm["processor"].image_token_id
    row = vlm_batch.pp_microbatches(vlm_batch.batch_size)[0]
    assert len(row.sequence.sample_offsets) >= 2 and int(row.sequence.media_counts.sum()) >= 2
    kwargs = {k: v for k, v in row.model_kwargs.items() if k != "attention_mask"}  # 4-D: not splittable
    row = dataclasses.replace(row, model_kwargs=kwargs)
    with pytest.raises(BatchValidationError, match="inputs_embeds"):  # pixel_values would stay whole
        model_inputs(row.cp_partition(batch_cp_indices(row, cp_rank=0, cp_size=2), cp_rank=0, cp_size=2))
    with torch.no_grad():
        embeds = model.model.get_input_embeddings()(row.input_ids)
        images = model.model.get_image_features(
            kwargs["pixel_values"], kwargs["image_grid_thw"], return_dict=True
        )
        where = (row.input_ids == image_token)[..., None].expand_as(embeds)
        embeds = embeds.masked_scatter(where, torch.cat(images.pooler_output).to(embeds.dtype))
        full = model(**model_inputs(row, backend="sdpa")).logits.double()  # the ordinary path, pixels in
    row = row.replace_model_kwargs(inputs_embeds=embeds)
    gathered = torch.empty_like(full)
    for rank in range(cp_size):
        idx = batch_cp_indices(row, cp_rank=rank, cp_size=cp_size)
        local = row.cp_partition(idx, cp_rank=rank, cp_size=cp_size)
        inputs = model_inputs(local, backend="sdpa")
        assert "input_ids" not in inputs and "pixel_values" not in inputs
        with torch.no_grad():
            out = model(**inputs)
        want = torch.zeros_like(out.logits, dtype=torch.float64)
        seq = local.sequence.seq_ids
        for doc in seq[seq >= 0].unique().tolist():  # each document's share alone, at its global positions
            cols = torch.nonzero(seq[0] == doc).reshape(-1)
            with torch.no_grad():
                hidden = model.model.language_model(
                    inputs_embeds=inputs["inputs_embeds"][:, cols],
                    position_ids=inputs["position_ids"][:, :, cols],
                    attention_mask=torch.ones(1, cols.numel(), dtype=torch.long),
                    use_cache=False,
                ).last_hidden_state
                want[0, cols] = model.lm_head(hidden)[0].double()
        valid = seq >= 0
        assert (out.logits.double() - want)[valid].abs().max().item() <= LOGIT_TOL
        assert abs(out.loss.item() - hf_loss(want, inputs["shift_labels"])) <= 1e-9
        gathered[:, idx] = out.logits.double()
    whole = _whole_context(row, [batch_cp_indices(row, cp_rank=r, cp_size=cp_size) for r in range(cp_size)])
    assert (gathered[0, whole] - full[0, whole]).abs().max().item() <= LOGIT_TOL


# ---------------------------------------------------------------- padding rows, PP steps, the model's config


def _loss_and_grads(
    model: torch.nn.Module, inputs: dict[str, Any]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=False)
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), [p.grad.detach().clone() for p in model.parameters()]


def test_padding_rows_give_zero_loss_and_gradient_and_a_pp_step_equals_the_unpadded_batch(
    text_batches: list[PuzzletronBatch],
) -> None:
    """The README's PP recipe: 4 rows padded to 6 for 3 microbatches, the last one all padding."""
    model = tiny_qwen2("sdpa", vocab_size=800, seed=1).train()
    batch = text_batches[0]
    micros = batch.pad_batch_to_multiple(3).pp_microbatches(3)
    assert [m.batch_size for m in micros] == [2, 2, 2] and not bool(micros[2].hidden_mask.any())
    loss, grads = _loss_and_grads(model, model_inputs(micros[2], model=model))
    assert loss.item() == 0.0  # HF's token mean over no token was 0/0 = NaN
    assert all(not bool(g.any()) for g in grads)
    # A step: each microbatch's summed loss over the whole batch's supervised tokens; they add up.
    whole, whole_grads = _loss_and_grads(model, model_inputs(batch, model=model))
    n = (batch.labels.masked_fill(~batch.ce_mask, -100) != -100).sum()
    parts = [_loss_and_grads(model, model_inputs(m, model=model, num_items_in_batch=n)) for m in micros]
    assert abs(sum(loss.item() for loss, _ in parts) - whole.item()) <= LOSS_TOL
    for k, g in enumerate(whole_grads):
        step = sum(grads[k] for _, grads in parts)
        assert (step - g).abs().max().item() <= 1e-6 * max(g.abs().max().item(), 1.0)


def test_given_the_model_its_backend_and_dtype_are_used_and_disagreements_refused(
    qwen2: dict[str, torch.nn.Module], text_batches: list[PuzzletronBatch]
) -> None:
    eager = qwen2["eager"]
    row = text_batches[0].pp_microbatches(4)[0]
    indices = batch_cp_indices(row, cp_rank=0, cp_size=2)
    local = row.cp_partition(indices, cp_rank=0, cp_size=2)  # needs an explicit mask
    inputs = model_inputs(local, model=eager)
    assert inputs["attention_mask"].dtype == torch.float64  # additive, in the model's dtype
    with pytest.raises(ConfigError, match=r"backend='sdpa'.*run 'eager' attention"):
        model_inputs(local, backend="sdpa", model=eager)  # a bool mask, added to eager's scores
    with pytest.raises(ConfigError, match=r"dtype=torch.float32.*model is torch.float64"):
        model_inputs(local, dtype=torch.float32, model=qwen2["sdpa"])
    with pytest.raises(ConfigError, match="num_items_in_batch must be an int >= 1"):
        model_inputs(local, model=eager, num_items_in_batch=0)
    assert "attention_mask" not in model_inputs(
        text_batches[0], model=qwen2["sdpa"]
    )  # HF finds the documents


def test_the_traps_the_readme_shows_are_real_and_model_inputs_avoids_them(
    qwen2: dict[str, torch.nn.Module], text_batches: list[PuzzletronBatch]
) -> None:
    """README "Feeding a model" numbers (measured on this batch: 0.50, 0.50, 59.3 vs 0.0, 0.40, 0.39)."""
    sdpa, eager = qwen2["sdpa"], qwen2["eager"]
    batch, valid = text_batches[0], text_batches[0].hidden_mask
    inputs = model_inputs(batch, model=sdpa)
    with torch.no_grad():
        right = sdpa(**inputs).logits
        cached = sdpa(**batch.model_kwargs).logits  # use_cache at Qwen2's default: documents see each other
        masked = sdpa(**{**inputs, "attention_mask": batch.hidden_mask}).logits  # a 2-D mask hides them
    assert (cached - right)[valid].abs().max().item() > 0.1
    assert (masked - right)[valid].abs().max().item() > 0.1
    targets = inputs["shift_labels"]
    oracle = torch.full((*targets.shape, 800), -30.0, dtype=torch.float64)
    oracle.scatter_(2, targets.clamp_min(0)[..., None], 30.0)  # logits that predict every target
    assert ForCausalLMLoss(oracle, inputs["labels"], 800, shift_labels=targets).item() == 0.0
    assert ForCausalLMLoss(oracle, targets, 800).item() > 10  # batch.labels as HF labels: shifted twice
    row = batch.pp_microbatches(4)[0]
    local = row.cp_partition(batch_cp_indices(row, cp_rank=0, cp_size=2), cp_rank=0, cp_size=2)
    with torch.no_grad():
        for model, wrong in (
            (eager, {"backend": "sdpa"}),  # a bool mask, added to eager's scores
            (sdpa, {"backend": "sdpa", "mask": "block_causal", "dtype": torch.float32}),  # float32 on float64
        ):
            good = model(**model_inputs(local, model=model)).logits
            bad = model(**model_inputs(local, **wrong)).logits
            assert (bad - good)[local.hidden_mask].abs().max().item() > 0.1
            with pytest.raises(ConfigError):
                model_inputs(local, model=model, **wrong)
