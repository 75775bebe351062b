"""Everything that talks to the Hugging Face Hub (or a mirror of it): the only module importing
`huggingface_hub`. What it relies on of the Hub and of mirrors: ``docs/sources.md``.

Files are fetched whole with `hf_hub_download` (cached under ``$HF_HOME/hub``, resumable) and read
locally: mirrors and proxies often ignore HTTP ``Range`` and answer with the whole file, which breaks any
reader that seeks inside a remote parquet file. Callers fetch one shard at a time, in a seeded order, and
stop as soon as they have enough rows, so a bounded snapshot downloads a bounded number of shards.

The endpoint (``HF_ENDPOINT``), cache (``HF_HUB_CACHE`` / ``HF_HOME``) and token are read from the
environment at every call, not at import time, and passed explicitly. Credentials (``docs/trust-model.md``,
"Credentials"): the user's Hub token (``HF_TOKEN``, else the one ``hf auth login`` stored) goes only to the
official Hub (`OFFICIAL_ENDPOINT`) or to the one endpoint ``PUZZLETRON_HUB_TOKEN_ENDPOINT`` names; any other
endpoint (a mirror, a proxy, the demo's loopback server) gets no token, and the token file is not even read.
While talking to such an endpoint, huggingface_hub's telemetry is off, so it fetches nothing on its own
(its agent-harness registry, from the endpoint it read at import).

Nothing from the Hub is trusted (``docs/trust-model.md``): every downloaded file is checked against the size
and hash the Hub lists for it before it is used (`_integrity`; one that differs is fetched again, then an
error), and a dataset card's ``configs:`` block of any other shape than documented is an `AcquisitionError`.
"""

from __future__ import annotations

import errno
import fnmatch
import logging
import os
import random
import re
import tarfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.parquet as pq
from huggingface_hub import HfApi, hf_hub_download
from huggingface_hub import constants as hf_constants
from huggingface_hub import errors as hf_errors
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils import close_session

from puzzletron.dataset.errors import AcquisitionError
from puzzletron.dataset.sources import _integrity

__all__ = [
    "OFFICIAL_ENDPOINT",
    "TOKEN_ENDPOINT_ENV",
    "cache_dir",
    "download",
    "endpoint",
    "hub_errors",
    "is_commit_sha",
    "iter_parquet_tables",
    "list_files",
    "log_through_application",
    "read_member",
    "resolve_revision",
    "set_progress_bars",
    "split_patterns",
    "tar_members",
    "token_for_endpoint",
]

logger = logging.getLogger(__name__)

_SHA = re.compile(r"[0-9a-f]{40}")
_T = TypeVar("_T")
OFFICIAL_ENDPOINT = "https://huggingface.co"
TOKEN_ENDPOINT_ENV = "PUZZLETRON_HUB_TOKEN_ENDPOINT"  # the one other endpoint the user's token may go to
# Repository listings by (source, commit sha): a commit names its files for good, on any endpoint.
_LISTINGS: dict[tuple[str, str], dict[str, Any]] = {}
# Failures of the local disk, not of the connection: said as such, with the cache folder.
_DISK_ERRORS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG})


def endpoint() -> str:
    """The Hub endpoint in effect now: ``HF_ENDPOINT`` or huggingface.co."""
    return os.environ.get("HF_ENDPOINT", "").rstrip("/") or OFFICIAL_ENDPOINT


def cache_dir() -> Path:
    """The Hub file cache in effect now: ``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else the default."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "huggingface"
    )
    return Path(home) / "hub"


def log_through_application() -> None:
    """Let `huggingface_hub`'s records (its retry warnings) reach stderr once, through the application's
    handlers: it gives its library logger a stderr handler of its own at import *and* lets records
    propagate, so under an application that configured logging (the command line) each one printed twice,
    bare and prefixed. Its handler is removed; its level (``HF_HUB_VERBOSITY``) stays."""
    library = logging.getLogger("huggingface_hub")
    for handler in list(library.handlers):
        if type(handler) is logging.StreamHandler:
            library.removeHandler(handler)


def set_progress_bars(enabled: bool) -> None:
    """Show or hide `huggingface_hub`'s download progress bars (stderr)."""
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    (enable_progress_bars if enabled else disable_progress_bars)()


def _same_endpoint(a: str, b: str) -> bool:
    """Whether two endpoint URLs name the same server and path (scheme and host case-insensitive, default
    ports and a trailing slash ignored).

    >>> _same_endpoint("https://HuggingFace.co/", "https://huggingface.co:443")
    True
    >>> _same_endpoint("http://127.0.0.1:8080", "http://127.0.0.1:8081")
    False
    """

    def key(url: str) -> tuple[str, str, int | None, str]:
        parts = urlsplit(url.strip())
        scheme = parts.scheme.lower()
        try:
            port = parts.port or {"https": 443, "http": 80}.get(scheme)
        except ValueError:  # a port that is not a number names no endpoint
            return ("", url, None, "")
        return (scheme, (parts.hostname or "").lower(), port, parts.path.rstrip("/"))

    return key(a) == key(b)


def token_for_endpoint(url: str | None = None) -> bool | None:
    """What the Hub client may send as the token to `url` (the endpoint in effect when None): ``None``, the
    user's token (``HF_TOKEN``, else the stored login), for the official Hub and for the endpoint named by
    ``PUZZLETRON_HUB_TOKEN_ENDPOINT``; ``False``, no token (and no token file read), for any other."""
    url = endpoint() if url is None else url
    named = os.environ.get(TOKEN_ENDPOINT_ENV, "")
    if _same_endpoint(url, OFFICIAL_ENDPOINT) or (named and _same_endpoint(url, named)):
        return None
    return False


def _token() -> bool | None:
    """The token argument of every Hub call now; a mirror also gets no telemetry (see the module doc)."""
    token = token_for_endpoint()
    if token is False:
        hf_constants.HF_HUB_DISABLE_TELEMETRY = True
    return token


def is_commit_sha(revision: str | None) -> bool:
    """Whether `revision` is a full 40-hex commit sha (used as given, never resolved)."""
    return bool(revision) and _SHA.fullmatch(revision) is not None  # type: ignore[arg-type]


def _status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def _api(call: Callable[[HfApi], _T]) -> _T:
    """Run one Hub API call (metadata only, idempotent); on a connection-level failure (no HTTP answer),
    retry it once on fresh connections.

    Why: a server may drop a kept-alive connection after answering an error (olah resets it after a
    500), and the next request on that pooled connection fails with "connection reset by peer" although
    the server is healthy. File downloads have their own retries in `hf_hub_download`.
    """
    api = HfApi(endpoint=endpoint(), token=_token())
    try:
        return call(api)
    except hf_errors.HTTPError as exc:
        if getattr(exc, "response", None) is not None:
            raise  # an HTTP answer: retrying would get the same one
        logger.debug("Hub API call failed without an answer (%s); retrying on fresh connections", exc)
        close_session()
        return call(HfApi(endpoint=endpoint(), token=_token()))


@contextmanager
def hub_errors(source: str, revision: str | None, action: str) -> Iterator[None]:
    """Turn any Hub, HTTP or connection failure inside the block into an `AcquisitionError` naming
    `source`, `revision`, the endpoint and what to do about it."""
    where = f"{source}@{revision or 'main'} on {endpoint()}"
    try:
        yield
    except AcquisitionError:
        raise
    except hf_errors.HFValidationError as exc:
        raise AcquisitionError(f"{action} {where}: invalid repository id or revision: {exc}") from exc
    except hf_errors.GatedRepoError as exc:
        raise AcquisitionError(
            f"{action} {where}: access denied (gated or private repository, HTTP {_status(exc)}); accept "
            "its conditions on the Hub and set HF_TOKEN to a token that may read it"
        ) from exc
    except hf_errors.RevisionNotFoundError as exc:
        raise AcquisitionError(
            f"{action} {where}: revision not found; check the revision (a commit sha, or None for main)"
        ) from exc
    except hf_errors.RepositoryNotFoundError as exc:
        raise AcquisitionError(
            f"{action} {where}: repository not found or not accessible (HTTP {_status(exc)}); check the "
            "source name and revision (some mirrors answer this for an unknown branch), set HF_ENDPOINT to "
            "your mirror, or set HF_TOKEN for a private repository"
        ) from exc
    except hf_errors.HfHubHTTPError as exc:
        status = _status(exc)
        if status in (401, 403):
            fix = "set HF_TOKEN to a token that may read it (gated or private repository)"
        elif status is not None and status >= 500:
            fix = (
                "check the revision and that the server at HF_ENDPOINT is healthy "
                "(some mirrors answer 500 for an unknown revision)"
            )
        else:
            fix = "check the source, revision and HF_ENDPOINT"
        raise AcquisitionError(f"{action} {where}: HTTP {status}; {fix}") from exc
    except OSError as exc:
        if exc.errno not in _DISK_ERRORS:
            raise _connection_failed(action, where, exc) from exc
        raise AcquisitionError(
            f"{action} {where}: cannot write the Hub cache at {cache_dir()} ({exc.strerror or exc}); free "
            "space there or point HF_HOME (or HF_HUB_CACHE) at a writable file system with room, then rerun"
        ) from exc
    except (hf_errors.HTTPError, hf_errors.EntryNotFoundError) as exc:
        raise _connection_failed(action, where, exc) from exc


def _connection_failed(action: str, where: str, exc: BaseException) -> AcquisitionError:
    return AcquisitionError(
        f"{action} {where}: {type(exc).__name__}: {exc}; the connection failed or the file is missing "
        "at this revision. Check that HF_ENDPOINT is reachable and the revision has the file, then "
        "rerun (completed downloads are cached and reused)"
    )


def resolve_revision(source: str, revision: str | None) -> str:
    """A commit sha for `revision`: a sha as given; ``None``/``"main"``/``"latest"`` -> current ``main``
    (always passing an explicit revision to the API: some mirrors reject a missing one); any other name
    (branch or tag) -> its commit."""
    if is_commit_sha(revision):
        return revision  # type: ignore[return-value]
    ref = "main" if revision in (None, "", "main", "latest") else revision
    with hub_errors(source, ref, "resolving the revision of"):
        info = _api(lambda api: api.dataset_info(source, revision=ref))
    if not is_commit_sha(info.sha):
        raise AcquisitionError(
            f"{source}@{ref} on {endpoint()}: the Hub returned no commit sha ({info.sha!r})"
        )
    logger.info("resolved %s@%s to %s", source, ref, info.sha)
    return info.sha  # type: ignore[return-value]


def _card_error(source: str, revision: str, problem: str) -> AcquisitionError:
    return AcquisitionError(
        f"{source}@{revision} on {endpoint()}: the dataset card's configs: block {problem}; expected "
        "configs: [{config_name, data_files: [{split, path}]}] (docs/sources.md)"
    )


def _card_entries(source: str, revision: str, configs: Any) -> Iterator[tuple[str, list[str]]]:
    """``(split, [glob, ...])`` of each ``data_files`` entry of the default config; any other shape than
    the documented one is an `AcquisitionError` (a card is data from the Hub, not trusted)."""
    if not isinstance(configs, list):
        raise _card_error(source, revision, f"is a {type(configs).__name__}, not a list of configs")
    for config in configs:
        if not isinstance(config, dict):
            raise _card_error(source, revision, f"has a config that is not a mapping: {config!r}")
        if config.get("config_name", "default") != "default":
            continue
        entries = config.get("data_files") or []
        for entry in [entries] if isinstance(entries, str | dict) else entries:
            fields = entry if isinstance(entry, dict) else {}
            split, paths = fields.get("split"), fields.get("path")
            if not isinstance(split, str) or paths is None:
                raise _card_error(
                    source, revision, f"has a data_files entry without a split and path(s): {entry!r}"
                )
            paths = [paths] if isinstance(paths, str) else paths
            if not isinstance(paths, list) or not paths or not all(isinstance(p, str) and p for p in paths):
                raise _card_error(source, revision, f"has a data_files path that is not a string: {entry!r}")
            yield split, paths


def split_patterns(source: str, revision: str) -> dict[str, list[str]]:
    """``{split: [glob, ...]}`` of the default config (the README ``configs:`` block) at `revision`."""
    with hub_errors(source, revision, "reading the dataset card of"):
        info = _api(lambda api: api.dataset_info(source, revision=revision))
    card = info.card_data.to_dict() if hasattr(info.card_data, "to_dict") else info.card_data
    if card is None:
        return {}
    if not isinstance(card, dict):
        raise _card_error(source, revision, f"cannot be read: the card's metadata is a {type(card).__name__}")
    return dict(_card_entries(source, revision, card.get("configs") or []))


def _listing(source: str, revision: str) -> dict[str, Any]:
    """``{path: RepoFile}`` of every file at `revision` (sizes, blob ids, LFS hashes); cached per commit."""
    key = (source, revision)
    if key not in _LISTINGS:
        with hub_errors(source, revision, "listing files of"):
            entries = _api(
                lambda api: list(
                    api.list_repo_tree(source, repo_type="dataset", revision=revision, recursive=True)
                )
            )
        files = {entry.path: entry for entry in entries if isinstance(entry, RepoFile)}
        if not is_commit_sha(revision):
            return files
        _LISTINGS[key] = files
    return _LISTINGS[key]


def list_files(source: str, revision: str, pattern: str = "*") -> list[str]:
    """Sorted repository paths at `revision` matching the glob `pattern` (``*`` crosses ``/``)."""
    return sorted(f for f in _listing(source, revision) if fnmatch.fnmatchcase(f, pattern))


def _fetch(source: str, path: str, revision: str, *, force: bool) -> Path:
    with hub_errors(source, revision, f"downloading {path} of"):
        return Path(
            hf_hub_download(
                source,
                path,
                repo_type="dataset",
                revision=revision,
                endpoint=endpoint(),
                cache_dir=cache_dir(),
                token=_token(),
                force_download=force,
            )
        )


def _expected(source: str, path: str, revision: str, local: Path) -> _integrity.Digest | None:
    """What the Hub says `path` is: its listing at `revision`, else (no listing reachable) the ETag the
    cached file was downloaded under; None when neither says."""
    try:
        entry = _listing(source, revision).get(path)
    except AcquisitionError as exc:
        logger.info(
            "no listing of %s@%s (%s); checking %s against its cache entry", source, revision, exc, path
        )
        entry = None
    digest = _integrity.from_listing(entry) if entry is not None else None
    return digest or _integrity.from_cache_blob(local)


def download(source: str, path: str, revision: str) -> Path:
    """The local path of the whole file `path` at `revision` (downloaded once into the Hub cache), checked
    against the size and hash the Hub gives for it: a cached file that differs (truncated, replaced) is
    fetched again, and one that still differs is an `AcquisitionError`."""
    local = _fetch(source, path, revision, force=False)
    expected = _expected(source, path, revision, local)
    if expected is None:
        logger.warning("%s/%s@%s: the Hub gives no size or hash to check it against", source, path, revision)
        return local
    problem = _integrity.mismatch(local, expected)
    if problem is not None:
        logger.warning("%s/%s@%s in the Hub cache: %s; fetching it again", source, path, revision, problem)
        local = _fetch(source, path, revision, force=True)
        problem = _integrity.mismatch(local, expected)
        if problem is not None:
            raise AcquisitionError(
                f"{source}@{revision} on {endpoint()}: {path} as downloaded does not match the Hub: "
                f"{problem}; check that HF_ENDPOINT serves this repository unchanged, then rerun"
            )
    logger.debug("fetched %s/%s@%s -> %s", source, path, revision, local)
    return local


def _unreadable(path: Path, kind: str, exc: BaseException) -> AcquisitionError:
    """A downloaded file that cannot be read: name it (its cache path names repository and revision)."""
    return AcquisitionError(
        f"{path}: the downloaded {kind} cannot be read ({type(exc).__name__}: {exc}); it is damaged or not "
        f"a {kind}: delete it from the Hub cache ({cache_dir()}) and rerun"
    )


def iter_parquet_tables(path: Path, *, rng: random.Random | None = None) -> Iterator[pa.Table]:
    """One table per row group of a local parquet file; with `rng`, row groups in a random order and
    rows shuffled within each (memory: one row group). A damaged file is an `AcquisitionError` naming it."""
    try:
        reader = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise _unreadable(path, "parquet file", exc) from exc
    groups = list(range(reader.num_row_groups))
    if rng is not None:
        rng.shuffle(groups)
    for group in groups:
        try:
            table = reader.read_row_group(group)
        except (pa.ArrowException, OSError) as exc:
            raise _unreadable(path, "parquet file", exc) from exc
        if rng is not None and table.num_rows > 1:
            order = list(range(table.num_rows))
            rng.shuffle(order)
            table = table.take(pa.array(order, type=pa.int64()))
        yield table


def tar_members(path: Path) -> dict[str, tuple[int, int]]:
    """``{member name: (offset, size)}`` of the regular files of a local tar shard (a damaged shard is an
    `AcquisitionError` naming it)."""
    try:
        with tarfile.open(path, mode="r:") as tar:
            return {m.name: (m.offset_data, m.size) for m in tar.getmembers() if m.isfile()}
    except (tarfile.TarError, OSError) as exc:
        raise _unreadable(path, "tar shard", exc) from exc


def read_member(path: Path, span: tuple[int, int]) -> bytes:
    """The bytes of one tar member given its ``(offset, size)`` from `tar_members`."""
    offset, size = span
    with open(path, "rb") as handle:
        handle.seek(offset)
        data = handle.read(size)
    if len(data) != size:
        raise AcquisitionError(f"tar shard {path} is truncated at member offset {offset}")
    return data
