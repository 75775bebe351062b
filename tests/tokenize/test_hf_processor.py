"""`load_hf_processor`: transformers' own Qwen2-VL-family processor object of a folder, built with the PIL
image processor and without torchvision, usable wherever ``processor=`` is taken; a tokenizer given as the
processor is said to be one."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer

from puzzletron.dataset.config import PuzzletronDataSpec
from puzzletron.dataset.errors import ConfigError
from puzzletron.dataset.pipelines.vlm import build_vlm_batches
from puzzletron.dataset.tokenize import load_hf_processor, vlm_processor
from puzzletron.fixtures.tokenizer import load_qwen2_5_vl_processor

MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}]


def test_it_is_transformers_processor_class_with_the_pil_image_processor(processor_dirs) -> None:
    qwen25, qwen3 = (
        load_hf_processor(processor_dirs["qwen2_5_vl"]),
        load_hf_processor(processor_dirs["qwen3_vl"]),
    )
    assert (type(qwen25).__name__, type(qwen3).__name__) == ("Qwen2_5_VLProcessor", "Qwen3VLProcessor")
    assert type(qwen25.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    assert "torchvision" not in sys.modules
    image = Image.new("RGB", (90, 60), (200, 10, 30))
    text = qwen25.apply_chat_template(MESSAGES, tokenize=False)
    ours = qwen25(text=[text], images=[image], return_tensors="pt")
    reference = load_qwen2_5_vl_processor(processor_dirs["qwen2_5_vl"])(
        text=[text], images=[image], return_tensors="pt"
    )
    assert set(ours) == set(reference) and all(torch.equal(ours[k], reference[k]) for k in ours)
    with pytest.raises(ConfigError, match="images and text only, no videos"):
        qwen25(text=["<|video_pad|>"], videos=[[image, image]])


def test_the_object_gives_the_batches_the_folder_gives(vlm_stores, vlm_subset, processor_dirs) -> None:
    raw = {"modality": "multimodal", "layout": "packed_varlen", "max_sample_length": 300}
    spec = PuzzletronDataSpec.from_mapping({**raw, "packing": {"pack_size": 300}})
    folder = processor_dirs["qwen2_5_vl"]
    by_object = build_vlm_batches(
        vlm_stores["qwen2_5_vl"],
        processor=load_hf_processor(folder),
        subset=vlm_subset,
        spec=spec,
        batch_size=2,
    )
    by_folder = build_vlm_batches(
        vlm_stores["qwen2_5_vl"], processor=folder, subset=vlm_subset, spec=spec, batch_size=2
    )
    assert [b.fingerprint for b in by_object] == [b.fingerprint for b in by_folder]


def test_the_class_a_folder_names_is_used_and_others_refused(processor_dirs, tmp_path: Path) -> None:
    folder = shutil.copytree(processor_dirs["qwen3_vl"], tmp_path / "p")
    config = json.loads((folder / "preprocessor_config.json").read_text())
    (folder / "preprocessor_config.json").write_text(
        json.dumps({**config, "processor_class": "Qwen2VLProcessor"})
    )
    assert type(load_hf_processor(folder)).__name__ == "Qwen2VLProcessor"
    (folder / "preprocessor_config.json").write_text(
        json.dumps({**config, "processor_class": "LlavaProcessor"})
    )
    with pytest.raises(ConfigError, match="processor class 'LlavaProcessor'; load_hf_processor builds"):
        load_hf_processor(folder)
    with pytest.raises(ConfigError, match=r"no preprocessor_config\.json: not a processor folder"):
        load_hf_processor(tmp_path)


def test_a_tokenizer_given_as_the_processor_is_said_to_be_one(processor_dirs) -> None:
    """Before: "it has no tokenizer", of a tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(processor_dirs["qwen2_5_vl"])
    with pytest.raises(ConfigError, match=r"is a tokenizer, not a processor \(no image processor\)"):
        vlm_processor(tokenizer)


def test_it_pickles_into_a_fresh_process(processor_dirs) -> None:
    """DataLoader workers under spawn get the processor pickled: its video stand-in is found by name."""
    import pickle
    import subprocess

    blob = pickle.dumps(load_hf_processor(processor_dirs["qwen2_5_vl"]))
    code = (
        "import pickle, sys; p = pickle.loads(sys.stdin.buffer.read()); "
        "print(type(p).__name__, type(p.video_processor).__name__, p.video_processor.patch_size)"
    )
    child = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, timeout=300)
    assert child.stdout.decode().split() == ["Qwen2_5_VLProcessor", "_ImagesOnlyVideoProcessor", "14"]
