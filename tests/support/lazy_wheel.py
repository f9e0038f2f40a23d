"""Read a few files out of a remote wheel without downloading it (as pip's lazy wheel does):
the zip's central directory and the wanted members come by HTTP range requests, in blocks;
what was read is kept in a cache keyed by the wheel's sha256, so a second run asks nothing.

vLLM's wheels are 240-340 MB; the compatibility contract needs ~3 MB of Python source out of
each (`tests/contract`)."""

from __future__ import annotations

import io
import json
import os
import time
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import httpx

BLOCK = 1 << 18
"""Bytes per range block: members a few KB apart share one request."""


@dataclass
class Fetched:
    requests: int = 0
    bytes: int = 0
    seconds: float = 0.0
    cached: bool = False


class RangeFile(io.RawIOBase):
    """A read-only, seekable view of a remote file of known size, fetched by block on demand
    (adjacent missing blocks in one request)."""

    def __init__(self, http: httpx.Client, url: str, size: int, fetched: Fetched) -> None:
        self.http, self.url, self.size, self.fetched = http, url, size, fetched
        self.position = 0
        self.blocks: dict[int, bytes] = {}

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence]
        self.position = max(0, base + offset)
        return self.position

    def readinto(self, buffer: memoryview | bytearray) -> int:  # type: ignore[override]
        end = min(self.size, self.position + len(buffer))
        if end <= self.position:
            return 0
        self._have(self.position // BLOCK, (end - 1) // BLOCK)
        view, at, written = memoryview(buffer), self.position, 0
        while at < end:
            block = self.blocks[at // BLOCK]
            offset = at % BLOCK
            take = min(end - at, len(block) - offset)
            view[written : written + take] = block[offset : offset + take]
            at, written = at + take, written + take
        self.position = end
        return written

    def _have(self, first: int, last: int) -> None:
        missing = [b for b in range(first, last + 1) if b not in self.blocks]
        if not missing:
            return
        low, high = missing[0] * BLOCK, min(self.size, (missing[-1] + 1) * BLOCK) - 1
        response = self.http.get(self.url, headers={"Range": f"bytes={low}-{high}"})
        response.raise_for_status()
        if response.status_code != 206:
            raise OSError(f"{self.url}: the server ignored the range request (HTTP {response.status_code})")
        if len(response.content) != high - low + 1:
            raise OSError(
                f"{self.url}: asked for {high - low + 1} bytes at {low}, got {len(response.content)}"
            )
        self.fetched.requests += 1
        self.fetched.bytes += len(response.content)
        for block in range(missing[0], missing[-1] + 1):
            start = (block - missing[0]) * BLOCK
            self.blocks[block] = response.content[start : start + BLOCK]


def read_members(
    http: httpx.Client,
    url: str,
    size: int,
    sha256: str,
    wanted: Callable[[str], bool],
    cache: Path,
    selection: str,
) -> tuple[dict[str, str], Fetched]:
    """The text of every member whose name `wanted` accepts; from `cache` when this wheel
    (by its sha256) was read before for the same `selection` (a name for `wanted`)."""
    fetched = Fetched()
    started = time.perf_counter()
    stored = cache / f"{sha256}-{selection}.json"
    if stored.exists():
        fetched.cached, fetched.seconds = True, time.perf_counter() - started
        return dict(json.loads(stored.read_text())), fetched
    with zipfile.ZipFile(io.BufferedReader(RangeFile(http, url, size, fetched), BLOCK)) as wheel:
        names = sorted((i for i in wheel.infolist() if wanted(i.filename)), key=lambda i: i.header_offset)
        members: dict[str, str] = {info.filename: wheel.read(info).decode() for info in names}
    cache.mkdir(parents=True, exist_ok=True)
    partial = stored.with_suffix(f".part-{os.getpid()}")  # test workers may read one wheel at once
    partial.write_text(json.dumps(members))
    partial.replace(stored)
    fetched.seconds = time.perf_counter() - started
    return members, fetched


def under(prefixes: Iterable[str], exact: Iterable[str] = ()) -> Callable[[str], bool]:
    """Python files under any of `prefixes`, and the files named in `exact`."""
    starts, names = tuple(prefixes), frozenset(exact)
    return lambda name: name in names or (name.endswith(".py") and name.startswith(starts))
