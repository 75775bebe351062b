"""The processor parts the VLM path uses: the image grid computed from an image's size equals the
processor's on real images, objects and directories give the same parts, and a processor of another family
is a `ConfigError` naming what it lacks."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from _conversation_samples import pil_image
from _vlm_reference import LOADERS
from puzzletron.dataset.errors import ConfigError
from puzzletron.dataset.tokenize import build_vlm_store, vlm_processor
from puzzletron.fixtures.tokenizer import CHAT_TEMPLATE


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_grids_equal_the_processor_on_real_images(kind: str, processor_dirs: dict[str, Path]) -> None:
    processor = LOADERS[kind](processor_dirs[kind])
    parts = vlm_processor(processor)
    sizes = [(20, 20), (56, 56), (57, 300), (300, 57), (448, 448), (1000, 30), (640, 480), (3, 90)]
    images = [pil_image(i, size) for i, size in enumerate(sizes)]
    want = processor.image_processor(images=images, return_tensors="np")["image_grid_thw"]
    got, refused = parts.grid.grids(*np.array(sizes).T)
    assert np.array_equal(got, want) and not refused.any()
    assert np.array_equal(
        parts.grid.tokens(got), processor.image_processor(images=images)["image_grid_thw"].prod(-1) // 4
    )


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_a_directory_and_its_processor_object_give_the_same_parts(
    kind: str, processor_dirs: dict[str, Path]
) -> None:
    from_dir, from_object = (
        vlm_processor(processor_dirs[kind]),
        vlm_processor(LOADERS[kind](processor_dirs[kind])),
    )
    assert from_dir.grid == from_object.grid and from_dir.image_token_id == from_object.image_token_id == 5
    assert from_dir.tokenizer.chat_template == from_object.tokenizer.chat_template == CHAT_TEMPLATE
    assert vlm_processor(from_dir) is from_dir and vlm_processor(processor_dirs[kind]) is from_dir  # cached


def test_the_processor_chat_template_is_used_and_the_callers_tokenizer_is_left_alone(
    processor_dirs: dict[str, Path],
) -> None:
    processor = LOADERS["qwen2_5_vl"](processor_dirs["qwen2_5_vl"])
    processor.tokenizer.chat_template = "{{ 'tokenizer template' }}"
    parts = vlm_processor(processor)
    assert parts.tokenizer.chat_template == processor.chat_template == CHAT_TEMPLATE
    assert processor.tokenizer.chat_template == "{{ 'tokenizer template' }}"


def test_another_family_is_a_config_error_naming_what_is_missing(
    processor_dirs: dict[str, Path], tokenizer_dir: Path
) -> None:
    processor = LOADERS["qwen2_5_vl"](processor_dirs["qwen2_5_vl"])
    with pytest.raises(ConfigError, match="TokenizersBackend is a tokenizer, not a processor"):
        vlm_processor(AutoTokenizer.from_pretrained(tokenizer_dir))
    from transformers import CLIPImageProcessor

    class Clip:  # a processor object whose image processor is not of the Qwen2-VL family
        tokenizer = processor.tokenizer
        image_processor = CLIPImageProcessor()
        chat_template = CHAT_TEMPLATE

    with pytest.raises(
        ConfigError, match=r"processor Clip is not supported: .*got CLIPImageProcessor\w* without"
    ):
        vlm_processor(Clip())
    processor.image_processor.size = {"shortest_edge": 3136}
    with pytest.raises(ConfigError, match="without max_pixels"):
        vlm_processor(processor)
    with pytest.raises(ConfigError, match="is not a directory"):
        vlm_processor(tokenizer_dir / "missing")


def _edited(processor_dir: Path, out: Path, **config: object) -> Path:
    """A copy of the processor directory with ``preprocessor_config.json`` keys set (None: removed)."""
    out = Path(shutil.copytree(processor_dir, out))
    path = out / "preprocessor_config.json"
    raw = json.loads(path.read_text()) | config
    path.write_text(json.dumps({k: v for k, v in raw.items() if v is not None}))
    return out


@pytest.mark.parametrize(
    ("config", "says"),
    [
        (
            {"image_mean": [float("nan"), 0.5, 0.5]},
            "image_mean is [nan, 0.5, 0.5]; expected 3 finite numbers",
        ),
        ({"image_std": [0.5, 0.0, 0.5]}, "image_std is [0.5, 0.0, 0.5]; expected 3 finite numbers above 0"),
        ({"image_std": [-0.5, 0.5, 0.5]}, "image_std is [-0.5, 0.5, 0.5]; expected 3 finite numbers above 0"),
        (
            {"image_std": [float("inf")] * 3},
            "image_std is [inf, inf, inf]; expected 3 finite numbers above 0",
        ),
        ({"image_mean": [0.5, 0.5]}, "image_mean is [0.5, 0.5]; expected 3 finite numbers"),
        ({"rescale_factor": 0}, "rescale_factor is 0.0; expected a finite number above 0"),
        ({"patch_size": 4096}, "patch_size 4096 (at most 64)"),
        ({"min_pixels": 2**20, "max_pixels": 2**16}, "min_pixels 1048576 (at most max_pixels 65536)"),
    ],
)
def test_an_unsound_pixel_setting_is_one_config_error_when_the_processor_is_loaded(
    processor_dirs: dict[str, Path], vlm_subset: Path, tmp_path: Path, config: dict, says: str
) -> None:
    bad = _edited(processor_dirs["qwen3_vl"], tmp_path / "proc", **config)
    with pytest.raises(ConfigError) as exc:
        vlm_processor(bad)
    assert says in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(ConfigError, match=re.escape(says)):  # at tokenize time, before anything is made
        build_vlm_store(vlm_subset, processor=bad, output=tmp_path / "store")
    assert not (tmp_path / "store").exists()


def test_a_processor_directory_with_a_truncated_tokenizer_is_one_config_error(
    processor_dirs: dict[str, Path], tmp_path: Path
) -> None:
    bad = Path(shutil.copytree(processor_dirs["qwen3_vl"], tmp_path / "proc"))
    data = (bad / "tokenizer.json").read_bytes()
    (bad / "tokenizer.json").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match=r"processor \S+ cannot be loaded \(JSONDecodeError: ") as exc:
        vlm_processor(bad)
    assert "\n" not in str(exc.value)


def test_a_template_edited_between_two_loads_in_one_process_is_loaded_again(
    processor_dirs: dict[str, Path], tmp_path: Path
) -> None:
    proc = Path(shutil.copytree(processor_dirs["qwen3_vl"], tmp_path / "proc"))
    assert vlm_processor(proc).tokenizer.chat_template == CHAT_TEMPLATE
    (proc / "chat_template.jinja").write_text("{{ 'edited' }}" + CHAT_TEMPLATE)
    assert vlm_processor(proc).tokenizer.chat_template == "{{ 'edited' }}" + CHAT_TEMPLATE
    twin = Path(shutil.copytree(processor_dirs["qwen3_vl"], tmp_path / "twin"))
    assert vlm_processor(twin) is vlm_processor(processor_dirs["qwen3_vl"])  # one content, one load
