"""A prefix holds one store: the claim object a build at an URL writes once before any of its objects.

    take_claim("s3://b/stores/pk", digest, owner)        # before the first shard is uploaded
    ...                                                  # build, publish the manifest
    release_claim("s3://b/stores/pk", digest)            # after the manifest (or a clean failure)

Object storage has no lock, so the claim is a create-once object (``If-None-Match: *``, `Objects.create_once`,
as the manifest is) beside the store: ``<parent>/.<name>.claim.json``, holding the identity hash of the
build that took it. A build of the same identity finds its own identity there and goes on (it resumes or
races the other to the same bytes; the manifest is written once); a build of another identity is refused
before it writes anything, with what to do: wait for the other build, or, when that build was killed (its
claim and staged shards stay; nothing tells a killed build from a slow one), remove the claim and the
staged objects with the command the error names. A build that fails cleanly releases the claim it took
(its ``owner`` token; one it joined stays with the live build that took it: a fixed tokenizer is another
identity, and its rerun to the same output must not be refused); the build that published releases the
claim of its identity once the manifest is there (from then on the manifest says which store the prefix
holds).
"""

from __future__ import annotations

import datetime
import json

from puzzletron.dataset.errors import ConfigError, SnapshotError
from puzzletron.dataset.storage.objects import Objects, join_url, url_name, url_parent

__all__ = ["CLAIM_FORMAT", "claim_url", "release_claim", "staging_url", "take_claim"]

CLAIM_FORMAT = "puzzletron-store-claim"
_MAX_CLAIM_BYTES = 1 << 16
_ATTEMPTS = 8


def _place(dest: str) -> tuple[Objects, str]:
    """The objects of `dest`'s parent and the claim's name there."""
    parent = url_parent(dest)
    if "/" not in dest.partition("://")[2].strip("/"):
        raise ConfigError(f"{dest}: name a prefix inside the bucket (s3://bucket/stores/NAME), not a bucket")
    return Objects(parent), f".{url_name(dest)}.claim.json"


def claim_url(dest: str) -> str:
    """Where the claim on `dest` lives (``<parent>/.<name>.claim.json``)."""
    objects, rel = _place(dest)
    return objects.url_of(rel)


def _holder(objects: Objects, rel: str) -> dict[str, object] | None:
    """The claim's content, None when it is gone; ``{}`` when it is not a claim this code wrote."""
    info = objects.info(rel)
    if info is None:
        return None
    data = objects.get(rel) if info.size <= _MAX_CLAIM_BYTES else b""
    if data is None:
        return None
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) and value.get("format") == CLAIM_FORMAT else {}


def _clear_command(url: str, staged: str | None) -> str:
    if url.startswith(("s3://", "s3a://")):
        command = f"`aws s3 rm {url}`"
        return command + (f" and `aws s3 rm --recursive {staged}/`" if staged else "")
    return f"remove the object {url}" + (f" and every object under {staged}/" if staged else "")


def take_claim(dest: str, digest: str, owner: str, *, what: str = "store") -> None:
    """Claim `dest` for the build `owner` (a token of this build) of identity hash `digest`, or join a
    claim of the same identity; `SnapshotError` when a build of another identity holds it, naming the
    command that clears a killed build's claim and staged objects (`staging_url`)."""
    objects, rel = _place(dest)
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    body = {"format": CLAIM_FORMAT, "identity_sha256": digest, "owner": owner, "store": dest}
    body["claimed_at"] = when
    for _ in range(_ATTEMPTS):
        if objects.create_once(rel, json.dumps(body, sort_keys=True).encode()):
            return
        holder = _holder(objects, rel)
        if holder is None:
            continue  # released between the write and the read: claim it again
        other = holder.get("identity_sha256")
        if other == digest:
            return
        url = objects.url_of(rel)
        staged = staging_url(dest, other) if isinstance(other, str) and len(other) == 64 else None
        whose = f"identity {other[:16]}..., claimed {holder.get('claimed_at')}" if staged else "unreadable"
        raise SnapshotError(
            f"{dest}: a build of another {what} holds this prefix ({url}: {whose}); a prefix holds one "
            f"{what}. Wait for that build to finish, choose another output, or, if it was killed, clear its "
            f"claim: {_clear_command(url, staged)}"
        )
    raise SnapshotError(f"{objects.url_of(rel)}: claimed and released {_ATTEMPTS} times while this build "
                        "tried to claim it; try again")  # fmt: skip


def release_claim(dest: str, digest: str, *, owner: str | None = None) -> None:
    """Remove the claim on `dest` when it is this identity's; with `owner`, only when that build took it (a
    build that failed leaves the claim of another live build of its identity alone). Best effort."""
    objects, rel = _place(dest)
    holder = _holder(objects, rel)
    if holder is None or holder.get("identity_sha256") != digest:
        return
    if owner is None or holder.get("owner") == owner:
        objects.delete([rel])


def staging_url(dest: str, digest: str) -> str:
    """The staging prefix of a build of `dest` (beside it, like a local build directory)."""
    return join_url(url_parent(dest), f".{url_name(dest)}.build-{digest[:16]}")
