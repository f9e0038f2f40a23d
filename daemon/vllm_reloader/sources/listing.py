"""One checkpoint's objects in a bucket, read the way `completeness.describe` reads a local
checkpoint directory (its shards' sizes from their headers, or its files by HEAD when the
listing failed), and judged from the listing alone before anything is downloaded."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

from ..checkpoint import completeness
from ..checkpoint.completeness import MAX_LISTING_BYTES, Entry, Incomplete, Listed
from ..checkpoint.conventions import Convention
from ..checkpoint.files import size_from_header
from ..checkpoint.manifest import DELTA_REFUSED, MANIFEST_NAME, path_problem
from ..checkpoint.manifest import parse as parse_manifest
from ..config import SourceConfig
from ..errors import KeyUnreadable, ManifestInvalid, NotJSONYet
from .filestore import SCHEME
from .objstore import Bucket, Object


class BucketListing:
    """One checkpoint's objects, as `completeness.describe` reads a checkpoint."""

    def __init__(
        self,
        objects: Mapping[str, Object],
        completing: Mapping[str, bytes],
        header_size: Callable[[str, Object], int | None],
        fetch: Callable[[str], bytes] | None = None,
    ) -> None:
        self.objects, self.completing, self.header_size = objects, dict(completing), header_size
        self.fetch = fetch

    def top(self) -> Mapping[str, Entry]:
        return {k: Entry(o.size, o.modified) for k, o in self.objects.items() if "/" not in k}

    def entry(self, path: str) -> Entry | None:
        found = self.objects.get(path)
        return None if found is None else Entry(found.size, found.modified)

    def whole(self, name: str) -> bytes:
        """The completing object's bytes, or another small one's (an index beside a marker),
        fetched once; one over MAX_LISTING_BYTES reads as empty, which is not JSON."""
        if name not in self.completing and self.fetch is not None:
            found = self.objects.get(name)
            small = found is not None and found.size <= MAX_LISTING_BYTES
            self.completing[name] = self.fetch(name) if small else b""
        return self.completing[name]

    def shard_size(self, name: str) -> int | None:
        return self.header_size(name, self.objects[name])

    def last_change(self) -> float:
        return max((o.modified for k, o in self.objects.items() if "/" not in k), default=0.0)


def convention_of(source: SourceConfig) -> Convention:
    """How a store's checkpoints say they are whole. A listed object is whole (a multipart
    upload is invisible until it completes): no grace for a manifest or index that is not JSON.
    A file on a shared root may be listed while its writer is still at it: grace, as locally."""
    return Convention(
        mode=source.completeness,
        markers=source.markers,
        settle_seconds=source.settle_seconds,
        manifest_grace=source.manifest_grace if source.path.startswith(SCHEME) else 0.0,
    )


def judge(listed: Listed, listing: BucketListing) -> Incomplete | None:
    """pending / rejected from the manifest and the listing alone; None: download it."""
    if listed.manifest.delta is not None:
        return Incomplete("rejected", DELTA_REFUSED, listed.fingerprint, "manifest")
    if problem := path_problem(listed.manifest):
        return Incomplete("rejected", problem, listed.fingerprint, "paths")
    found = completeness.check_files(listing, listed.manifest)
    return None if found is None else replace(found, fingerprint=listed.fingerprint)


class HeaderSizes:
    """Each shard's whole size from its header: two small ranged GETs per shard, once per ETag.
    A header listing more than `max_tensors` is refused before it is all parsed (`[gate]`)."""

    def __init__(self, store: Bucket, max_tensors: int | None = None) -> None:
        self.store, self.max_tensors = store, max_tensors
        self.known: dict[tuple[str, str | None], int] = {}

    def listing(
        self, name: str, objects: Mapping[str, Object], completing: Mapping[str, bytes]
    ) -> BucketListing:
        """`name`'s objects as `completeness.describe` reads them (`completing`: the completing
        object's bytes, when it has any worth reading)."""

        def header_size(shard: str, listed: Object) -> int | None:
            key = (f"{name}/{shard}", listed.etag)
            if key not in self.known:

                def read(start: int, end: int) -> bytes:
                    return bytes(self.store.get_range(key[0], start, end, listed.etag))

                size = size_from_header(shard, read, listed.size, self.max_tensors)
                if size is None:
                    return None
                self.known[key] = size
            return self.known[key]

        return BucketListing(objects, completing, header_size, lambda key: self.store.get(f"{name}/{key}")[0])


def by_head(store: Bucket, name: str) -> dict[str, Object]:
    """A checkpoint with our manifest whose listing failed on an odd key: what its manifest lists
    is found by HEAD, and the odd key is never looked at (a manifest over the size a completing
    file may have is returned alone, to be rejected by its size, never read)."""
    head = store.head(f"{name}/{MANIFEST_NAME}")
    if head is None:
        return {}
    objects = {MANIFEST_NAME: head}
    if head.size > MAX_LISTING_BYTES:
        return objects
    try:
        manifest = parse_manifest(store.get(f"{name}/{MANIFEST_NAME}")[0])
    except (NotJSONYet, ManifestInvalid, KeyUnreadable):
        return objects  # judged like any bad manifest; one unreadable here waits
    if path_problem(manifest) is None:
        for item in manifest.files:
            if (found := store.head(f"{name}/{item.path}")) is not None:
                objects[item.path] = found
    return objects
