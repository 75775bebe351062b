"""Decode and validate image values, keeping their encoded bytes; the only module that imports Pillow.

Accepted values: a PIL image, an HF `Image` struct `{"bytes", "path"}` (bytes win), raw bytes, a local path
(`str` / `Path`), or an `EncodedImage` that `encode_image` already produced (a caller that validated an image
passes the result on instead of having it decoded twice). URLs and the dataset-viewer `{"src": url}` form are
errors: nothing here downloads.

Local paths are the caller's: a value that came from a Hub repository is encoded with ``local_paths=False``
and then a path (or a struct holding only a path) is refused with `HUB_REFERENCE_REASON` before the file
system is touched, so the reason is the same whether such a file exists or not (``docs/trust-model.md``).

Bytes that decode cleanly are kept exactly as they came (a JPEG photo stays a JPEG: re-encoding photos as PNG
is several times slower and larger). Only values without an encoded form (a PIL image not backed by a file, an
array) are encoded, as PNG. Every image is fully decoded once, so truncated data and decompression bombs
(more than `Image.MAX_IMAGE_PIXELS` pixels) are caught here, not in a training job. The work is bounded over
all frames too: an animation (APNG, GIF, WebP, multi-page TIFF) whose frames x canvas pixels exceed
`Image.MAX_IMAGE_PIXELS` is refused from its header, before any frame is decoded.

Only the raster formats of `DECODED_FORMATS` are decoded (``docs/trust-model.md``, "Image decoders"): Pillow
is never asked to open anything else, so bytes in another format (EPS and PostScript, which Pillow hands to
Ghostscript; PDF, ICNS, FITS, ...) are an `ImageError` naming their first bytes, one rejected row. The width
and height recorded are the image as displayed: a JPEG (or WebP, PNG, TIFF) whose EXIF orientation turns it
by 90 degrees (orientations 5-8) has them swapped, as every loader that honours the tag
(``ImageOps.exif_transpose``, transformers' ``load_image``) shows it.
"""

from __future__ import annotations

import hashlib
import io
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image, ImageOps, UnidentifiedImageError

from puzzletron.dataset.errors import ImageError

__all__ = [
    "DECODED_FORMATS",
    "HUB_REFERENCE_REASON",
    "EncodedImage",
    "decode_rgb",
    "encode_image",
    "extension_for",
    "shown_size",
]

# The one reason a Hub row's image reference that is not inside the downloaded files is refused with: it says
# nothing about the local file system (the file is never looked at). See docs/trust-model.md.
HUB_REFERENCE_REASON = (
    "the image reference does not resolve inside the files downloaded from the repository at this revision "
    "(Hub data may not name local files)"
)

# The raster formats Pillow may decode here (its format names); MPO is a JPEG with extra frames, opened by
# Pillow's JPEG opener (which is why it is not one of the openers named to `Image.open`).
DECODED_FORMATS = ("PNG", "JPEG", "MPO", "WEBP", "GIF", "BMP", "TIFF")
_OPENERS = tuple(f for f in DECODED_FORMATS if f != "MPO")
_EXIF_ORIENTATION = 0x0112
_TURNED = {5, 6, 7, 8}  # EXIF orientations that rotate by 90 or 270 degrees (width and height swap)
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://|^data:", re.ASCII)
_EXTENSIONS = {"JPEG": ".jpg", "MPO": ".jpg", "PNG": ".png", "WEBP": ".webp", "GIF": ".gif", "TIFF": ".tiff"}
# PNG can hold these modes as they are; anything else (CMYK, YCbCr, ...) is converted to RGB(A) first.
_PNG_MODES = {"1", "L", "LA", "I", "I;16", "P", "RGB", "RGBA"}


@dataclass(frozen=True)
class EncodedImage:
    """An image ready to store: its encoded `data` and what we record about it."""

    data: bytes
    format: str  # Pillow's format name: "JPEG", "PNG", "WEBP", ...
    width: int
    height: int
    sha256: str
    reencoded: bool  # True when `data` was produced here (PNG), False when kept as given

    @property
    def size(self) -> int:
        """Encoded size in bytes."""
        return len(self.data)

    @property
    def extension(self) -> str:
        """File extension for `format`, with the dot."""
        return extension_for(self.format)


def extension_for(fmt: str) -> str:
    """The file extension we store a Pillow format under (`JPEG` -> `.jpg`)."""
    return _EXTENSIONS.get(fmt.upper(), f".{fmt.lower()}")


def _check_pixels(width: int, height: int, where: str, frames: int = 1) -> None:
    """Refuse an image of more than ``Image.MAX_IMAGE_PIXELS`` pixels (a decompression bomb), counting every
    frame of an animation: decoding a frame costs a whole canvas, so the bound is frames x pixels."""
    limit = Image.MAX_IMAGE_PIXELS
    if limit is None:
        return
    if width * height > limit:
        raise ImageError(
            f"{where}: decompression bomb: {width}x{height} = {width * height} pixels exceeds "
            f"Image.MAX_IMAGE_PIXELS = {limit}"
        )
    if frames * width * height > limit:
        raise ImageError(
            f"{where}: decompression bomb: {frames} frames of {width}x{height} = {frames * width * height} "
            f"pixels to decode exceeds Image.MAX_IMAGE_PIXELS = {limit}"
        )


def _orientation(img: Image.Image) -> int:
    """The EXIF orientation tag (1 when absent or unreadable)."""
    try:
        value = img.getexif().get(_EXIF_ORIENTATION, 1)
    except Exception:  # a damaged EXIF block is no reason to refuse the pixels
        return 1
    return value if isinstance(value, int) else 1


def _decode(data: bytes, where: str) -> tuple[str, int, int]:
    """Fully decode `data` (format, width and height as displayed); raise `ImageError` naming `where` on any
    defect, and for any format outside `DECODED_FORMATS` without decoding it."""
    if not data:
        raise ImageError(f"{where}: empty image bytes; expected an encoded image (PNG, JPEG, WebP, ...)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=_OPENERS) as img:
                fmt, (width, height) = img.format, img.size
                frames = getattr(img, "n_frames", 1)  # from the header (APNG acTL, WebP, ...): no decoding
                _check_pixels(width, height, where, frames if isinstance(frames, int) else 1)
                img.load()
                for frame in range(1, frames):
                    img.seek(frame)
                    img.load()
                if _orientation(img) in _TURNED:
                    width, height = height, width
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageError(f"{where}: decompression bomb: {exc}") from exc
    except UnidentifiedImageError as exc:
        raise ImageError(
            f"{where}: not an image in a decoded format ({', '.join(DECODED_FORMATS)}): {len(data)} bytes "
            f"starting {data[:8]!r}"
        ) from exc
    except Exception as exc:  # a plugin's own failure (struct.error, IndexError, ...): this image alone
        raise ImageError(
            f"{where}: undecodable or truncated image ({len(data)} bytes): {type(exc).__name__}: {exc}"
        ) from exc
    if not fmt or width <= 0 or height <= 0:
        raise ImageError(f"{where}: image has no format or an empty size ({fmt!r}, {width}x{height})")
    return fmt, width, height


def _kept(data: bytes, where: str) -> EncodedImage:
    fmt, width, height = _decode(data, where)
    return EncodedImage(data, fmt, width, height, hashlib.sha256(data).hexdigest(), reencoded=False)


def _png(img: Image.Image, where: str) -> EncodedImage:
    width, height = img.size
    _check_pixels(width, height, where)
    if img.mode not in _PNG_MODES:
        img = img.convert("RGBA" if "A" in img.getbands() else "RGB")
    buffer = io.BytesIO()
    try:
        img.save(buffer, format="PNG")
    except (OSError, ValueError) as exc:
        raise ImageError(f"{where}: cannot encode the image as PNG: {exc}") from exc
    data = buffer.getvalue()
    return EncodedImage(data, "PNG", width, height, hashlib.sha256(data).hexdigest(), reencoded=True)


def _read_local(path: str | Path, where: str, local_paths: bool) -> bytes:
    if not local_paths:  # Hub data: refused before the file system is looked at (docs/trust-model.md)
        raise ImageError(f"{where}: {HUB_REFERENCE_REASON}")
    text = str(path)
    if _URL.match(text):
        raise ImageError(
            f"{where}: {text!r} is a URL; materialisation never downloads, pass bytes or a local file"
        )
    if "\x00" in text:
        raise ImageError(f"{where}: local image path {text!r} contains a NUL byte")
    file = Path(path)
    if not file.is_file():
        raise ImageError(f"{where}: local image file {text!r} does not exist or is not a regular file")
    return file.read_bytes()


def _already_encoded(value: EncodedImage, where: str) -> EncodedImage:
    """Accept an `EncodedImage` without decoding it again: it was decoded when `encode_image` made it.

    Only the cheap invariants are rechecked (bytes present, SHA-256 of `data`, a positive size), so a value
    assembled by hand or altered after the fact is an error rather than a silently wrong manifest.
    """
    data = value.data
    if not isinstance(data, bytes) or not data:
        raise ImageError(f"{where}: EncodedImage.data must be non-empty bytes, got {type(data).__name__}")
    if hashlib.sha256(data).hexdigest() != value.sha256:
        raise ImageError(
            f"{where}: EncodedImage.sha256 does not match its data; pass what encode_image returned"
        )
    for name in ("width", "height"):
        size = getattr(value, name)
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ImageError(f"{where}: EncodedImage.{name} must be a positive integer, got {size!r}")
    if not isinstance(value.format, str) or not value.format:
        raise ImageError(f"{where}: EncodedImage.format must be a Pillow format name, got {value.format!r}")
    return value


def encode_image(value: Any, *, where: str = "image", local_paths: bool = True) -> EncodedImage:
    """Turn an accepted image value into validated encoded bytes plus its format, size and SHA-256.

    `where` names the row and field in every error message (`ImageError`, a `ConversationError`).
    `local_paths=False` (a value from a Hub repository) refuses a path, or a struct with only a path, with
    `HUB_REFERENCE_REASON` without looking at the file system (``docs/trust-model.md``).
    A PIL image opened from a file keeps that file's bytes when they decode to the same format and size
    (an image changed in place after opening would lose the change: pass a copy, which has no file).
    An `EncodedImage` (this function's own result) is returned as it is, after a hash check, not decoded.
    """
    if isinstance(value, EncodedImage):
        return _already_encoded(value, where)
    if isinstance(value, Image.Image):
        filename = getattr(value, "filename", "") or ""
        if filename and Path(filename).is_file() and value.format:
            data = Path(filename).read_bytes()
            kept = _kept(data, f"{where} (file {filename})")
            shown = {(kept.width, kept.height), (kept.height, kept.width)}  # EXIF may turn what is recorded
            if value.size in shown and kept.format == value.format:
                return kept
        return _png(value, where)
    if isinstance(value, bytes | bytearray | memoryview):
        return _kept(bytes(value), where)
    if isinstance(value, str | Path):
        return _kept(_read_local(value, where, local_paths), where)
    if isinstance(value, Mapping):
        if "src" in value or "url" in value:
            url = value.get("src", value.get("url"))
            raise ImageError(
                f"{where}: {{'src': {url!r}}} is a dataset-viewer URL reference; "
                "materialisation never downloads"
            )
        data, path = value.get("bytes"), value.get("path")
        if data:
            if not isinstance(data, bytes | bytearray | memoryview):
                raise ImageError(f"{where}: struct 'bytes' must be bytes, got {type(data).__name__}")
            return _kept(bytes(data), where)
        if path:
            return _kept(_read_local(path, where, local_paths), where)
        raise ImageError(f"{where}: image struct has neither 'bytes' nor 'path'")
    if hasattr(value, "__array_interface__"):
        try:
            img = Image.fromarray(value)
        except (TypeError, ValueError) as exc:
            raise ImageError(f"{where}: array cannot be read as an image: {exc}") from exc
        return _png(img, where)
    raise ImageError(
        f"{where}: unsupported image value of type {type(value).__name__}; expected a PIL image, "
        "an {'bytes', 'path'} struct, bytes, a local path or an EncodedImage"
    )


def shown_size(data: bytes, *, where: str = "image") -> tuple[int, int]:
    """``(width, height)`` of encoded `data` as displayed (EXIF orientations 5-8 swap them: what a subset's
    manifest records and `decode_rgb` gives), read from its header alone; `ImageError` naming `where` when
    it is not an image in `DECODED_FORMATS`."""
    try:
        with Image.open(io.BytesIO(data), formats=_OPENERS) as image:
            width, height = image.size
            return (height, width) if _orientation(image) in _TURNED else (width, height)
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageError(f"{where}: cannot read the image's header ({type(exc).__name__}: {exc})") from exc


def decode_rgb(data: bytes, *, where: str = "image", draft: tuple[int, int] | None = None) -> Image.Image:
    """The image of encoded `data` as the VLM pipeline feeds processors, and as transformers' ``load_image``
    gives it: decoded (only `DECODED_FORMATS`), turned by its EXIF orientation (so its size is the one a
    subset's manifest records) and converted to RGB. `ImageError` naming `where` when it does not decode.

    ``draft=(width, height)``, the size the caller resizes to (as displayed): a JPEG whose target is at most
    half its size on both sides is decoded at the smallest of 1/2, 1/4, 1/8 of its size that stays at least
    the target (Pillow's ``draft``: the decoder's DCT scaling, a fraction of the work). Not bit-exact with a
    full decode followed by the same resize (``benchmarks/bench_vlm_cpu.py`` measures the difference); any
    other image decodes in full."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=_OPENERS) as image:
                orientation = _orientation(image)
                if draft is not None and image.format in ("JPEG", "MPO"):
                    width, height = draft[::-1] if orientation in _TURNED else draft  # as stored
                    if 2 * width <= image.size[0] and 2 * height <= image.size[1]:
                        image.draft("RGB", (width, height))
                if orientation != 1:
                    return ImageOps.exif_transpose(image).convert("RGB")
                if image.mode == "RGB":
                    image.load()  # decoded while the data is open; already RGB: convert would copy it
                    return image
                return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError, Warning) as exc:
        raise ImageError(f"{where}: cannot decode the image ({type(exc).__name__}: {exc})") from exc
