"""One checkpoint's objects in a bucket, read the way `completeness.describe` reads a local
checkpoint directory, and judged from the listing alone before anything is downloaded."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

from ..checkpoint import completeness
from ..checkpoint.completeness import Entry, Incomplete, Listed
from ..checkpoint.manifest import path_problem
from .objstore import Object


class BucketListing:
    """One checkpoint's objects, as `completeness.describe` reads a checkpoint."""

    def __init__(
        self,
        objects: Mapping[str, Object],
        completing: Mapping[str, bytes],
        header_size: Callable[[str, Object], int | None],
    ) -> None:
        self.objects, self.completing, self.header_size = objects, completing, header_size

    def top(self) -> Mapping[str, Entry]:
        return {k: Entry(o.size, o.modified) for k, o in self.objects.items() if "/" not in k}

    def entry(self, path: str) -> Entry | None:
        found = self.objects.get(path)
        return None if found is None else Entry(found.size, found.modified)

    def whole(self, name: str) -> bytes:
        return self.completing[name]

    def shard_size(self, name: str) -> int | None:
        return self.header_size(name, self.objects[name])

    def last_change(self) -> float:
        return max((o.modified for k, o in self.objects.items() if "/" not in k), default=0.0)


def judge(listed: Listed, listing: BucketListing) -> Incomplete | None:
    """pending / rejected from the manifest and the listing alone; None: download it."""
    if problem := path_problem(listed.manifest):
        return Incomplete("rejected", problem, listed.fingerprint, "paths")
    found = completeness.check_files(listing, listed.manifest)
    return None if found is None else replace(found, fingerprint=listed.fingerprint)
