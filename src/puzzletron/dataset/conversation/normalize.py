"""Normalise source rows (InterSyn, Nemotron-VLM) into the AutoModel conversation form, and validate it.

The normalised record::

    {"conversation": [{"role": "user" | "assistant" | "system",
                       "content": [{"type": "image", "image": <image value>},
                                   {"type": "text", "text": str}]}],
     "image_count": int,                       # number of image items, in order
     "source": {"dataset": str, "revision": str, "row_id": ..., ...},
     "captions": [...]}                        # InterSyn only

Image values are passed through untouched (a PIL image, an HF `{"bytes", "path"}` struct, bytes or a local
path); decoding is the materialiser's job. Every error is a `ConversationError` naming the dataset, the row
id and the field. The source schemas (and the pinned InterSyn revisions defined here): ``docs/sources.md``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from puzzletron.dataset.errors import ConversationError

__all__ = [
    "INTERSYN_MULTI_DATASET",
    "INTERSYN_MULTI_REVISION",
    "INTERSYN_SINGLE_DATASET",
    "INTERSYN_SINGLE_REVISION",
    "NEMOTRON_VLM_DATASET",
    "ROLES",
    "normalize_intersyn_multi",
    "normalize_intersyn_single",
    "normalize_nemotron_vlm_sample",
    "validate_conversation",
]

INTERSYN_SINGLE_DATASET = "finyorko/single_turn"
INTERSYN_SINGLE_REVISION = "59acf6773cd2bf5b485f37296e862216aa99516b"
INTERSYN_MULTI_DATASET = "finyorko/multi-turn"
INTERSYN_MULTI_REVISION = "728987eff962e9df6f3da5ad5824a4accdd62bd2"
NEMOTRON_VLM_DATASET = "nvidia/Nemotron-VLM-Dataset-v2"
INTERSYN_MULTI_GROUPS = 5
ROLES = ("user", "assistant", "system")
# Keys by which a Nemotron image item refers to its media; all are replaced by the matched `image`.
_IMAGE_REFERENCE_KEYS = ("images", "path", "image_url", "url", "value", "data", "image")


def _where(dataset: str, row_id: Any) -> str:
    return f"{dataset} row {row_id!r}"


def _fail(dataset: str, row_id: Any, field: str, problem: str) -> ConversationError:
    return ConversationError(f"{_where(dataset, row_id)}: field {field!r}: {problem}")


def _row_id(row: Mapping[str, Any], dataset: str) -> Any:
    if not isinstance(row, Mapping):
        raise ConversationError(f"{dataset} row: expected a mapping, got {type(row).__name__}")
    row_id = row.get("id")
    if row_id is None or isinstance(row_id, bool) or not isinstance(row_id, str | int):
        raise _fail(dataset, row_id, "id", f"expected a string or integer row id, got {row_id!r}")
    return row_id


def _is_empty_image(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, str | bytes | bytearray):
        return len(value) == 0
    if isinstance(value, Mapping) and not any(k in value for k in ("src", "url")):
        return not value.get("bytes") and not value.get("path")
    return False


def _is_empty_text(value: Any) -> bool:
    return value is None or (isinstance(value, str) and not value.strip())


def _text(row: Mapping[str, Any], key: str, dataset: str, row_id: Any) -> str:
    value = row.get(key)
    if not isinstance(value, str):
        raise _fail(dataset, row_id, key, f"expected a non-empty string, got {type(value).__name__}")
    text = value.strip()
    if not text:
        raise _fail(dataset, row_id, key, "expected a non-empty string, got an empty one")
    return text


def _caption(row: Mapping[str, Any], key: str, dataset: str, row_id: Any) -> str | None:
    value = row.get(key)
    if value is not None and not isinstance(value, str):
        raise _fail(dataset, row_id, key, f"expected a string or null caption, got {type(value).__name__}")
    return value


def _image(row: Mapping[str, Any], key: str, dataset: str, row_id: Any) -> Any:
    value = row.get(key)
    if _is_empty_image(value):
        raise _fail(dataset, row_id, key, "missing image; expected an image value (PIL, bytes, struct, path)")
    return value


def _exchange(image: Any, human: str, gpt: str) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": human}]},
        {"role": "assistant", "content": [{"type": "text", "text": gpt}]},
    ]


def normalize_intersyn_single(row: Mapping[str, Any]) -> dict[str, Any]:
    """Convert one real InterSyn single-turn row to AutoModel conversation form.

    Columns `id, topic, human, gpt, caption, image`: the user turn is the image then `human` (stripped), the
    assistant turn is `gpt` (stripped); both texts must be non-empty.
    """
    dataset = INTERSYN_SINGLE_DATASET
    row_id = _row_id(row, dataset)
    image = _image(row, "image", dataset, row_id)
    human = _text(row, "human", dataset, row_id)
    gpt = _text(row, "gpt", dataset, row_id)
    return {
        "conversation": _exchange(image, human, gpt),
        "image_count": 1,
        "source": {
            "dataset": dataset,
            "revision": INTERSYN_SINGLE_REVISION,
            "row_id": row_id,
            "topic": row.get("topic"),
        },
        "captions": [_caption(row, "caption", dataset, row_id)],
    }


def normalize_intersyn_multi(row: Mapping[str, Any]) -> dict[str, Any]:
    """Convert the five-column-group InterSyn multi-turn schema without reordering turns.

    Group `i` (1..5) is `human{i}, gpt{i}, image{i}, caption{i}`. A group whose human, gpt and image are all
    empty is skipped; every other group needs an image and two non-empty texts. At least two images.
    """
    dataset = INTERSYN_MULTI_DATASET
    row_id = _row_id(row, dataset)
    conversation: list[dict[str, Any]] = []
    captions: list[str | None] = []
    for i in range(1, INTERSYN_MULTI_GROUPS + 1):
        human, gpt, image = f"human{i}", f"gpt{i}", f"image{i}"
        texts_empty = _is_empty_text(row.get(human)) and _is_empty_text(row.get(gpt))
        if texts_empty and _is_empty_image(row.get(image)):
            continue
        conversation += _exchange(
            _image(row, image, dataset, row_id),
            _text(row, human, dataset, row_id),
            _text(row, gpt, dataset, row_id),
        )
        captions.append(_caption(row, f"caption{i}", dataset, row_id))
    if len(captions) < 2:
        raise _fail(
            dataset, row_id, "image1..image5", f"expected at least two images, found {len(captions)} groups"
        )
    return {
        "conversation": conversation,
        "image_count": len(captions),
        "source": {
            "dataset": dataset,
            "revision": INTERSYN_MULTI_REVISION,
            "row_id": row_id,
            "topic": row.get("topic"),
        },
        "captions": captions,
    }


def _nemotron_item(item: Any, field: str, dataset: str, row_id: Any, image: Any) -> dict[str, Any]:
    if isinstance(item, str):
        return {"type": "text", "text": item}
    if not isinstance(item, Mapping):
        raise _fail(dataset, row_id, field, f"expected a content item mapping or string, got {item!r}")
    kind = item.get("type")
    if kind == "text":
        if not isinstance(item.get("text"), str):
            raise _fail(dataset, row_id, f"{field}.text", f"expected a string, got {item.get('text')!r}")
        return copy.deepcopy(dict(item))
    if kind == "image":
        out = {k: copy.deepcopy(v) for k, v in item.items() if k not in _IMAGE_REFERENCE_KEYS}
        out["image"] = image
        return out
    if kind == "video":
        raise _fail(dataset, row_id, field, "video items are not supported; expected text or image items")
    raise _fail(dataset, row_id, f"{field}.type", f"expected 'text' or 'image', got {kind!r}")


def normalize_nemotron_vlm_sample(
    row: Mapping[str, Any],
    *,
    subset: str,
    revision: str,
    source: str = NEMOTRON_VLM_DATASET,
) -> dict[str, Any]:
    """Preserve a complete Nemotron conversation while attaching its matched image.

    `row` has `id`, `messages` and the matched `image` (the media the acquisition joined by reference).
    String content becomes one text item and string items text items; video items are rejected; there must
    be exactly one image item (its reference keys are replaced by `image`) and at least one assistant turn.
    `source` is the dataset name the acquisition read from (recorded as `source.dataset`).
    """
    dataset = source
    row_id = _row_id(row, dataset)
    messages = row.get("messages")
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes) or not messages:
        raise _fail(dataset, row_id, "messages", f"expected a non-empty list of turns, got {messages!r}")
    image = _image(row, "image", dataset, row_id)
    conversation = []
    for t, turn in enumerate(messages):
        field = f"messages[{t}]"
        if not isinstance(turn, Mapping):
            raise _fail(dataset, row_id, field, f"expected a mapping with role and content, got {turn!r}")
        role = turn.get("role")
        if role not in ROLES:
            raise _fail(dataset, row_id, f"{field}.role", f"expected one of {ROLES}, got {role!r}")
        content = turn.get("content")
        if isinstance(content, str):
            items = [{"type": "text", "text": content}]
        elif isinstance(content, Sequence) and not isinstance(content, bytes):
            items = [
                _nemotron_item(item, f"{field}.content[{c}]", dataset, row_id, image)
                for c, item in enumerate(content)
            ]
        else:
            raise _fail(dataset, row_id, f"{field}.content", f"expected a string or a list, got {content!r}")
        conversation.append({"role": role, "content": items})
    sample = {
        "conversation": conversation,
        "image_count": sum(it["type"] == "image" for turn in conversation for it in turn["content"]),
        "source": {"dataset": dataset, "revision": revision, "subset": subset, "row_id": row_id},
    }
    if sample["image_count"] != 1:
        found = sample["image_count"]
        raise _fail(dataset, row_id, "messages", f"expected exactly one image item, found {found}")
    validate_conversation(sample)
    return sample


def validate_conversation(sample: Mapping[str, Any], *, where: str | None = None) -> None:
    """Check a normalised sample: roles, content items, string texts, image items and `image_count`.

    Raises `ConversationError` naming `where` (default: the sample's dataset and row id) and the field.
    Requires `source.dataset` and `source.revision` strings (subsets group by them) and an assistant turn.
    """
    if not isinstance(sample, Mapping):
        raise ConversationError(f"{where or 'sample'}: expected a mapping, got {type(sample).__name__}")
    source = sample.get("source")
    row_id = source.get("row_id") if isinstance(source, Mapping) else None
    label = where or (
        _where(source.get("dataset"), row_id) if isinstance(source, Mapping) else f"sample row {row_id!r}"
    )

    def fail(field: str, problem: str) -> ConversationError:
        return ConversationError(f"{label}: field {field!r}: {problem}")

    if not isinstance(source, Mapping):
        raise fail("source", f"expected a mapping with dataset, revision and row_id, got {source!r}")
    for key in ("dataset", "revision"):
        if not isinstance(source.get(key), str) or not source.get(key):
            raise fail(f"source.{key}", f"expected a non-empty string, got {source.get(key)!r}")
    if "row_id" not in source:
        raise fail("source.row_id", "missing")
    conversation = sample.get("conversation")
    if not isinstance(conversation, Sequence) or isinstance(conversation, str | bytes) or not conversation:
        raise fail("conversation", f"expected a non-empty list of turns, got {conversation!r}")
    images = 0
    for t, turn in enumerate(conversation):
        field = f"conversation[{t}]"
        if not isinstance(turn, Mapping):
            raise fail(field, f"expected a mapping with role and content, got {turn!r}")
        if turn.get("role") not in ROLES:
            raise fail(f"{field}.role", f"expected one of {ROLES}, got {turn.get('role')!r}")
        content = turn.get("content")
        if not isinstance(content, Sequence) or isinstance(content, str | bytes):
            raise fail(f"{field}.content", f"expected a list of content items, got {content!r}")
        for c, item in enumerate(content):
            item_field = f"{field}.content[{c}]"
            if not isinstance(item, Mapping):
                raise fail(item_field, f"expected a mapping, got {item!r}")
            kind = item.get("type")
            if kind == "text":
                if not isinstance(item.get("text"), str):
                    raise fail(f"{item_field}.text", f"expected a string, got {item.get('text')!r}")
            elif kind == "image":
                if _is_empty_image(item.get("image")):
                    raise fail(f"{item_field}.image", "missing image value")
                images += 1
            else:
                raise fail(f"{item_field}.type", f"expected 'text' or 'image', got {kind!r}")
    if not any(turn["role"] == "assistant" for turn in conversation):
        raise fail("conversation", "expected at least one assistant turn, found none")
    declared = sample.get("image_count")
    if isinstance(declared, bool) or not isinstance(declared, int) or declared != images:
        raise fail("image_count", f"declared {declared!r} but the conversation has {images} image items")
