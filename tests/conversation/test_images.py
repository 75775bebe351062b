"""Image values decode once, keep their encoded bytes, and every defect is an error naming its origin."""

from __future__ import annotations

import hashlib
import io
import os
import random
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps

from _conversation_samples import jpeg_bytes, pil_image, png_bytes
from puzzletron.dataset.conversation.images import DECODED_FORMATS, decode_rgb, encode_image, extension_for
from puzzletron.dataset.errors import ConversationError, ImageError
from puzzletron.fixtures.hostile import eps_bytes, exif_rotated_jpeg


def test_jpeg_bytes_are_kept_exactly_with_recorded_metadata():
    data = jpeg_bytes(1, (40, 30))
    out = encode_image(data)
    assert out.data == data
    assert (out.format, out.width, out.height, out.reencoded) == ("JPEG", 40, 30, False)
    assert out.sha256 == hashlib.sha256(data).hexdigest()
    assert out.size == len(data)
    assert out.extension == ".jpg"


def test_hf_struct_bytes_win_over_path(tmp_path):
    other = tmp_path / "other.png"
    other.write_bytes(png_bytes(9))
    data = jpeg_bytes(2)
    assert encode_image({"bytes": data, "path": str(other)}).data == data


def test_hf_struct_path_only_and_local_paths_read_the_file(tmp_path):
    file = tmp_path / "a.png"
    file.write_bytes(png_bytes(3))
    assert encode_image({"bytes": None, "path": str(file)}).data == png_bytes(3)
    assert encode_image(file).data == png_bytes(3)
    assert encode_image(str(file)).format == "PNG"


def test_webp_is_kept_as_webp():
    buffer = io.BytesIO()
    pil_image(4).save(buffer, format="WEBP")
    out = encode_image(buffer.getvalue())
    assert (out.format, out.extension, out.data) == ("WEBP", ".webp", buffer.getvalue())


def test_pil_image_opened_from_a_file_keeps_the_file_bytes(tmp_path):
    file = tmp_path / "photo.jpg"
    file.write_bytes(jpeg_bytes(5))
    with Image.open(file) as img:
        out = encode_image(img)
    assert out.data == jpeg_bytes(5) and not out.reencoded


def test_pil_image_without_a_file_and_arrays_are_encoded_as_png():
    img = pil_image(6, (10, 8))
    out = encode_image(img)
    assert out.format == "PNG" and out.reencoded and (out.width, out.height) == (10, 8)
    with Image.open(io.BytesIO(out.data)) as back:
        assert np.array_equal(np.asarray(back), np.asarray(img))  # lossless
    arr = np.arange(12, dtype=np.uint8).reshape(3, 4)
    from_array = encode_image(arr)
    assert (from_array.format, from_array.width, from_array.height) == ("PNG", 4, 3)


def test_png_encoding_is_deterministic():
    assert encode_image(pil_image(7)).data == encode_image(pil_image(7)).data


@pytest.mark.parametrize(
    "value",
    [
        "https://example.com/a.png",
        "hf://datasets/x/y.png",
        {"src": "https://datasets-server/x.jpg"},
        {"bytes": None, "path": "http://host/a.png"},
    ],
)
def test_urls_are_rejected_without_downloading(value):
    with pytest.raises(ImageError, match=r"row 'r1' image 0: .*(URL|never downloads)"):
        encode_image(value, where="row 'r1' image 0")


def test_truncated_and_garbage_bytes_are_errors_naming_the_field():
    data = jpeg_bytes(8, (64, 64))
    with pytest.raises(ImageError, match=r"row 'r2' image 0: undecodable or truncated"):
        encode_image(data[: len(data) // 2], where="row 'r2' image 0")
    with pytest.raises(ImageError, match=r"row 'r2' image 1: not an image in a decoded format"):
        encode_image(b"this is not an image", where="row 'r2' image 1")
    with pytest.raises(ImageError, match=r"row 'r2' image 2: empty image bytes"):
        encode_image(b"", where="row 'r2' image 2")
    assert issubclass(ImageError, ConversationError)


def test_missing_local_file_is_an_error(tmp_path):
    with pytest.raises(ImageError, match="does not exist"):
        encode_image(tmp_path / "nope.png", where="row 'r3' image 0")


@pytest.mark.parametrize("factor", [1.5, 3])  # above the limit: Pillow warns (1x..2x) or refuses (>2x)
def test_decompression_bombs_are_errors(monkeypatch, factor):
    data = png_bytes(9, (40, 30))  # 1200 pixels
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", int(1200 / factor))
    with pytest.raises(ImageError, match=r"row 'r4' image 0: decompression bomb"):
        encode_image(data, where="row 'r4' image 0")
    with pytest.raises(ImageError, match="decompression bomb"):
        encode_image(pil_image(9, (40, 30)), where="row 'r4' image 1")


def test_unsupported_value_type_is_an_error():
    with pytest.raises(ImageError, match=r"row 'r5' image 0: unsupported image value of type int"):
        encode_image(12, where="row 'r5' image 0")


def test_extension_for_known_formats():
    assert [extension_for(f) for f in ("JPEG", "PNG", "WEBP", "BMP")] == [".jpg", ".png", ".webp", ".bmp"]


def test_an_encoded_image_passes_through_without_decoding_again(monkeypatch):
    encoded = encode_image(jpeg_bytes(4, (40, 30)))

    def no_decoding(*args, **kwargs):
        raise AssertionError("an EncodedImage must not be decoded again")

    monkeypatch.setattr(Image, "open", no_decoding)
    assert encode_image(encoded, where="row 'r6' image 0") is encoded
    assert (encoded.format, encoded.width, encoded.height) == ("JPEG", 40, 30)


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        ({"sha256": "0" * 64}, r"EncodedImage\.sha256 does not match its data"),
        ({"data": b""}, r"EncodedImage\.data must be non-empty bytes"),
        ({"width": 0}, r"EncodedImage\.width must be a positive integer, got 0"),
        ({"height": True}, r"EncodedImage\.height must be a positive integer, got True"),
        ({"format": ""}, r"EncodedImage\.format must be a Pillow format name"),
    ],
)
def test_an_inconsistent_encoded_image_is_an_error_naming_the_field(change, pattern):
    import dataclasses

    encoded = encode_image(png_bytes(4))
    if "data" in change:  # keep the hash consistent so that only the emptiness is wrong
        change = {**change, "sha256": hashlib.sha256(change["data"]).hexdigest()}
    with pytest.raises(ImageError, match=rf"row 'r7' image 0: {pattern}"):
        encode_image(dataclasses.replace(encoded, **change), where="row 'r7' image 0")


def test_only_the_decoded_raster_formats_are_opened_and_eps_never_reaches_ghostscript(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "gs").write_text(f"#!/bin/sh\ntouch {tmp_path / 'gs-ran'}\nexit 1\n")
    (tools / "gs").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(ImageError) as exc:
        encode_image(eps_bytes(), where="row 3 image 0")
    assert str(exc.value).startswith("row 3 image 0: not an image in a decoded format (PNG, JPEG, MPO, WEBP")
    assert "starting b'%!PS-Ado'" in str(exc.value) and not (tmp_path / "gs-ran").exists()
    buffer = io.BytesIO()
    pil_image(4).save(buffer, format="ICO")  # a format Pillow reads, but not one decoded here
    with pytest.raises(ImageError, match="not an image in a decoded format"):
        encode_image(buffer.getvalue())
    assert set(DECODED_FORMATS) == {"PNG", "JPEG", "MPO", "WEBP", "GIF", "BMP", "TIFF"}


@pytest.mark.parametrize(
    ("orientation", "shown"), [(1, (40, 24)), (3, (40, 24)), (6, (24, 40)), (8, (24, 40))]
)
def test_an_exif_turned_jpeg_is_recorded_with_the_size_it_is_shown_at(
    orientation: int, shown: tuple[int, int]
) -> None:
    data = exif_rotated_jpeg(random.Random(0), (40, 24), orientation)
    out = encode_image(data)
    assert (out.width, out.height) == shown and out.data == data  # bytes kept, tag and all
    with Image.open(io.BytesIO(data)) as img:  # the independent reference: Pillow's own transpose
        assert ImageOps.exif_transpose(img).size == shown


@pytest.mark.parametrize(
    ("size", "target", "decoded"),
    [
        ((400, 300), (100, 75), (100, 75)),  # a quarter fits: the decoder scales by 1/4
        ((640, 480), (280, 196), (320, 240)),  # 1/2 is the smallest that keeps the target
        ((400, 300), (201, 150), (400, 300)),  # more than half the width: decoded whole
        ((401, 301), (196, 140), (201, 151)),
    ],
)
def test_draft_decodes_a_jpeg_at_a_reduced_size_only_at_half_the_source_or_less(size, target, decoded):
    data = jpeg_bytes(3, size)
    full = decode_rgb(data)
    reduced = decode_rgb(data, draft=target)
    assert full.size == size and reduced.size == decoded and reduced.mode == "RGB"
    a = np.asarray(full.resize(target, Image.Resampling.BICUBIC, reducing_gap=None)).astype(np.int16)
    b = np.asarray(reduced.resize(target, Image.Resampling.BICUBIC, reducing_gap=None)).astype(np.int16)
    diff = np.abs(a - b)
    assert (diff.max(), diff.mean()) <= (32, 3.0) if decoded != size else diff.max() == 0


def test_draft_leaves_other_formats_whole_and_follows_the_exif_orientation():
    png = png_bytes(4)
    assert decode_rgb(png, draft=(2, 2)).size == decode_rgb(png).size
    turned = exif_rotated_jpeg(random.Random(0), (400, 200))  # stored 400x200, shown 200x400
    assert decode_rgb(turned).size == (200, 400)
    assert decode_rgb(turned, draft=(50, 100)).size == (50, 100)  # 1/4 of the stored 400x200, turned
    assert decode_rgb(turned, draft=(150, 100)).size == (200, 400)  # wider than half what is shown: whole


@pytest.mark.parametrize("kind", ["jpeg", "png", "grey"])
def test_decode_rgb_gives_the_decoded_rgb_values_with_the_data_closed(kind):
    rgb = pil_image(5, (37, 23))
    buffer = io.BytesIO()
    (rgb.convert("L") if kind == "grey" else rgb).save(buffer, format="PNG" if kind == "png" else "JPEG")
    data = buffer.getvalue()
    with Image.open(io.BytesIO(data)) as opened:
        want = np.asarray(opened.convert("RGB"))
    image = decode_rgb(data)
    del data, buffer  # the image holds its own pixels, decoded before its source closed
    assert image.mode == "RGB" and image.size == (37, 23)
    assert np.array_equal(np.asarray(image), want)
    assert np.array_equal(
        np.asarray(image.resize((20, 10))), np.asarray(Image.fromarray(want).resize((20, 10)))
    )
