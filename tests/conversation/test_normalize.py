"""Normalisers turn real-schema rows into AutoModel conversations and name row and field on bad input."""

from __future__ import annotations

import copy

import pytest

from _conversation_samples import jpeg_bytes, multi_row, nemotron_row, single_row
from puzzletron.dataset import (
    normalize_intersyn_multi,
    normalize_intersyn_single,
    normalize_nemotron_vlm_sample,
)
from puzzletron.dataset.conversation import validate_conversation
from puzzletron.dataset.errors import ConversationError

IMG = {"bytes": b"<image bytes>", "path": None}


def test_intersyn_single_golden():
    row = {
        "id": "r7",
        "topic": "cats",
        "human": "  What is this? ",
        "gpt": " A cat. ",
        "caption": "a cat",
        "image": IMG,
    }
    assert normalize_intersyn_single(row) == {
        "conversation": [
            {
                "role": "user",
                "content": [{"type": "image", "image": IMG}, {"type": "text", "text": "What is this?"}],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
        ],
        "image_count": 1,
        "source": {
            "dataset": "finyorko/single_turn",
            "revision": "59acf6773cd2bf5b485f37296e862216aa99516b",
            "row_id": "r7",
            "topic": "cats",
        },
        "captions": ["a cat"],
    }


def test_intersyn_multi_golden_skips_empty_groups_and_keeps_order():
    a, b = {"bytes": b"A", "path": None}, {"bytes": b"B", "path": None}
    row = {"id": 3, "topic": "t"}
    for g in range(1, 6):
        row |= {f"human{g}": None, f"gpt{g}": None, f"image{g}": None, f"caption{g}": None}
    row |= {"human1": "q1", "gpt1": "a1", "image1": a, "caption1": "c1"}
    row |= {"human2": "  ", "gpt2": "", "image2": {"bytes": None, "path": None}}  # all empty: skipped
    row |= {"human3": "q3", "gpt3": "a3", "image3": b, "caption3": None}
    assert normalize_intersyn_multi(row) == {
        "conversation": [
            {"role": "user", "content": [{"type": "image", "image": a}, {"type": "text", "text": "q1"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "a1"}]},
            {"role": "user", "content": [{"type": "image", "image": b}, {"type": "text", "text": "q3"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "a3"}]},
        ],
        "image_count": 2,
        "source": {
            "dataset": "finyorko/multi-turn",
            "revision": "728987eff962e9df6f3da5ad5824a4accdd62bd2",
            "row_id": 3,
            "topic": "t",
        },
        "captions": ["c1", None],
    }


def test_nemotron_golden_attaches_matched_image_and_drops_references():
    row = {
        "id": "n1",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    "Look:",
                    {
                        "type": "image",
                        "image": "292180.png",
                        "path": "x",
                        "url": "u",
                        "metadata": {"width": 4},
                    },
                    {"type": "text", "text": "What is the total?"},
                ],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "<think>add</think> 42"}]},
        ],
        "image": IMG,
    }
    original = copy.deepcopy(row)
    out = normalize_nemotron_vlm_sample(row, subset="sparsetables", revision="abc123")
    assert out == {
        "conversation": [
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Look:"},
                    {"type": "image", "image": IMG, "metadata": {"width": 4}},
                    {"type": "text", "text": "What is the total?"},
                ],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "<think>add</think> 42"}]},
        ],
        "image_count": 1,
        "source": {
            "dataset": "nvidia/Nemotron-VLM-Dataset-v2",
            "revision": "abc123",
            "subset": "sparsetables",
            "row_id": "n1",
        },
    }
    assert row == original  # the input row is not mutated


def test_nemotron_dataset_name_comes_from_the_source_argument():
    out = normalize_nemotron_vlm_sample(nemotron_row(0), subset="s", revision="r", source="mirror/VLM-fork")
    assert out["source"]["dataset"] == "mirror/VLM-fork"


BAD_SINGLE = [
    ("missing human", {"human": None}, "'human'"),
    ("empty human", {"human": "   "}, "'human'"),
    ("non-string gpt", {"gpt": 42}, "'gpt'"),
    ("empty gpt", {"gpt": ""}, "'gpt'"),
    ("missing image", {"image": None}, "'image'"),
    ("empty image struct", {"image": {"bytes": None, "path": None}}, "'image'"),
    ("missing id", {"id": None}, "'id'"),
]


@pytest.mark.parametrize(("case", "override", "field"), BAD_SINGLE, ids=[c[0] for c in BAD_SINGLE])
def test_intersyn_single_bad_input_names_row_and_field(case, override, field):
    with pytest.raises(ConversationError, match=rf"finyorko/single_turn row .*field {field}"):
        normalize_intersyn_single(single_row(5, **override))


def test_intersyn_multi_with_one_image_needs_at_least_two():
    with pytest.raises(ConversationError, match=r"row 'm1'.*at least two images"):
        normalize_intersyn_multi(multi_row(1, groups=1))


def test_intersyn_multi_group_with_text_but_no_image_names_the_image_column():
    with pytest.raises(ConversationError, match=r"row 'm1': field 'image2'"):
        normalize_intersyn_multi(multi_row(1, groups=3, image2=None))


def test_intersyn_multi_group_with_image_but_empty_text_names_the_text_column():
    with pytest.raises(ConversationError, match=r"row 'm1': field 'gpt3'"):
        normalize_intersyn_multi(multi_row(1, groups=3, gpt3="  "))


def _messages_with(*user_items):
    return [{"role": "user", "content": list(user_items)}, {"role": "assistant", "content": "ok"}]


IMAGE_ITEM = {"type": "image", "image": "a.png"}
BAD_NEMOTRON = [
    (
        "video item",
        {"messages": _messages_with(IMAGE_ITEM, {"type": "video", "video": "x.mp4"})},
        r"messages\[0\]\.content\[1\]'.*video",
    ),
    (
        "zero images",
        {"messages": _messages_with({"type": "text", "text": "hi"})},
        r"'messages'.*exactly one image.*0",
    ),
    ("two images", {"messages": _messages_with(IMAGE_ITEM, IMAGE_ITEM)}, r"'messages'.*exactly one image.*2"),
    ("wrong role", {"messages": [{"role": "bot", "content": "x"}]}, r"messages\[0\]\.role'.*'bot'"),
    (
        "non-string text",
        {"messages": _messages_with(IMAGE_ITEM, {"type": "text", "text": 7})},
        r"content\[1\]\.text'",
    ),
    ("no assistant", {"messages": [{"role": "user", "content": [IMAGE_ITEM]}]}, "assistant"),
    ("no messages", {"messages": None}, "'messages'"),
    ("no matched image", {"image": None}, "'image'"),
]


@pytest.mark.parametrize(("case", "override", "pattern"), BAD_NEMOTRON, ids=[c[0] for c in BAD_NEMOTRON])
def test_nemotron_bad_input_names_row_and_field(case, override, pattern):
    with pytest.raises(ConversationError, match=r"nvidia/Nemotron-VLM-Dataset-v2 row 'n2'.*" + pattern):
        normalize_nemotron_vlm_sample(nemotron_row(2, **override), subset="s", revision="r")


def test_validate_conversation_rejects_wrong_image_count_and_roles():
    sample = {
        "conversation": [
            {"role": "user", "content": [{"type": "image", "image": jpeg_bytes(0)}]},
            {"role": "assistant", "content": [{"type": "text", "text": "x"}]},
        ],
        "image_count": 2,
        "source": {"dataset": "d", "revision": "r", "row_id": "x1"},
    }
    with pytest.raises(ConversationError, match=r"d row 'x1': field 'image_count'.*declared 2.*1 image"):
        validate_conversation(sample)
    sample["image_count"] = 1
    validate_conversation(sample)
    sample["conversation"][1]["role"] = "model"
    with pytest.raises(ConversationError, match=r"field 'conversation\[1\]\.role'"):
        validate_conversation(sample)
    with pytest.raises(ConversationError, match=r"field 'source\.revision'"):
        validate_conversation({**sample, "source": {"dataset": "d", "row_id": 1}})
