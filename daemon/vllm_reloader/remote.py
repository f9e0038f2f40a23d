"""An object-store prefix as a checkpoint source: list, judge, download into the local root.

An object store can only be polled. Each poll LISTs the prefix once and GETs a manifest
only when its ETag changed. A listed manifest is whole (a multipart upload is invisible
until it completes), but shards may still be uploading, so the verdicts are the local
gate's: pending (a shard not listed yet, or short), rejected (an unsafe path, a shard
longer than listed, bytes that fail their digest while downloading), or ready, which here
means: download the newest such checkpoint newer than the one serving. It lands in the
checkpoint root, where the local watcher and gate take over as for any local writer.

This runs on its own thread, because a download takes minutes; rejections, which the
state must keep, and finished downloads go to the main loop's inbox like any other event.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import gate, log, policy, source
from .completeness import Incomplete, fingerprint_of
from .config import Config
from .download import Cancelled, Fetched, Plan, fetch
from .errors import DownloadError, SourceError
from .manifest import MANIFEST_NAME, Manifest, ManifestInvalid, ManifestNotJSON
from .manifest import parse as parse_manifest
from .objstore import Object, Store


@dataclass(frozen=True)
class Remote:
    """One checkpoint's manifest as last fetched, and the objects listed under its name."""

    etag: str | None
    data: bytes
    manifest: Manifest | None
    problem: str = ""


def judge(remote: Remote, objects: Mapping[str, Object]) -> Incomplete | None:
    """pending / rejected from the manifest and the listing alone; None: download it."""
    fp = fingerprint_of(remote.data)
    if remote.manifest is None:
        return Incomplete("rejected", remote.problem, fp)
    manifest = remote.manifest
    for entry in manifest.files:
        if problem := gate.unsafe_path(entry.path):
            return Incomplete("rejected", f"path {entry.path!r} {problem}", fp, "paths")
    if not any(gate.is_weight(e.path) for e in manifest.files):
        return Incomplete("rejected", "manifest lists no .safetensors file", fp, "paths")
    for entry in manifest.files:
        listed = objects.get(entry.path)
        if listed is None:
            return Incomplete("pending", f"{entry.path} is not uploaded yet", fp)
        if listed.size < entry.size:
            return Incomplete("pending", f"{entry.path} has {listed.size} of {entry.size} bytes", fp)
        if listed.size > entry.size:
            return Incomplete(
                "rejected", f"{entry.path} has {listed.size} bytes, manifest says {entry.size}", fp, "sizes"
            )
    return None


def _read(etag: str | None, data: bytes) -> Remote:
    try:
        return Remote(etag, data, parse_manifest(data))
    except ManifestNotJSON as exc:  # a listed object is whole: it will not become JSON
        return Remote(etag, data, None, str(exc))
    except ManifestInvalid as exc:
        return Remote(etag, data, None, f"manifest: {exc}")


class RemoteSource:
    """Polls `[source] path` and downloads into `config.checkpoint_root`."""

    def __init__(
        self,
        config: Config,
        *,
        serving: Callable[[], policy.OrderKey | None],
        rejected: Callable[[], Mapping[str, str]],
        post: Callable[[tuple[str, Any]], None],
        store: Store | None = None,
    ) -> None:
        self.config, self.serving, self.rejected, self.post = config, serving, rejected, post
        self.store = store or Store(config.source.path, endpoint_url=config.source.endpoint_url)
        self.log = log.get()
        self.stop = threading.Event()
        self.seen: dict[str, Remote] = {}
        self.pending: dict[str, str] = {}
        self.rejected_here: dict[str, str] = {}
        self.problems: dict[str, str] = {}
        """What is failing now, by kind ("source", "download"): each is logged once, not per poll."""
        self._thread = threading.Thread(target=self._run, name="remote-source", daemon=True)

    @property
    def staging_root(self) -> Path:
        return self.config.cache_dir / "staging"

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: float = 10.0) -> None:
        self.stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self.stop.is_set():
            self.poll()
            self.stop.wait(self.config.source.interval)

    def _report(self, kind: str, reason: str, **fields: Any) -> None:
        if self.problems.get(kind) != reason:
            self.problems[kind] = reason
            self.log.error(f"{kind}.failed", source=self.config.source.path, reason=reason, **fields)

    def _clear(self, kind: str) -> None:
        if self.problems.pop(kind, None) is not None:
            self.log.info(f"{kind}.recovered", source=self.config.source.path)

    def poll(self) -> None:
        """One round: LIST, refresh changed manifests, judge, download the newest ready one."""
        try:
            listing = self.store.list()
        except SourceError as exc:
            self._report("source", str(exc), retry_in_s=self.config.source.interval)
            return
        by_name: dict[str, dict[str, Object]] = {}
        for key, listed in listing.items():
            name, _, rest = key.partition("/")
            if rest and not source.is_ignored(name, self.config.source.ignore):
                by_name.setdefault(name, {})[rest] = listed
        try:
            self._refresh({n: o[MANIFEST_NAME] for n, o in by_name.items() if MANIFEST_NAME in o})
        except SourceError as exc:
            self._report("source", str(exc), retry_in_s=self.config.source.interval)
            return
        self._clear("source")
        local = source.list_candidates(self.config.checkpoint_root, ())
        self._clean_staging(set(self.seen) - local)
        candidates = {
            name: policy.Candidate(name, r.manifest.step if r.manifest else None, fingerprint_of(r.data))
            for name, r in self.seen.items()
            if name not in local
        }
        rejected = {**self.rejected(), **self.rejected_here}
        waiting = {}
        for candidate in policy.to_try(candidates, serving=self.serving(), rejected=rejected):
            remote = self.seen[candidate.name]
            verdict = judge(remote, by_name[candidate.name])
            if verdict is None:
                self._download(candidate.name, remote, by_name[candidate.name])
                break
            if verdict.status == "pending":
                waiting[candidate.name] = verdict.reason
                if self.pending.get(candidate.name) != verdict.reason:
                    self.log.info(
                        "checkpoint.pending", name=candidate.name, reason=verdict.reason, remote=True
                    )
            else:
                self._reject(candidate.name, remote, verdict.reason, verdict.check)
        self.pending = waiting

    def _refresh(self, manifests: Mapping[str, Object]) -> None:
        for name in set(self.seen) - set(manifests):
            del self.seen[name]
        for name, listed in manifests.items():
            known = self.seen.get(name)
            if known is None or known.etag != listed.etag or listed.etag is None:
                data, etag = self.store.get(f"{name}/{MANIFEST_NAME}")
                if known is None or known.data != data:
                    self.log.info("checkpoint.seen", name=name, path=f"{self.config.source.path}/{name}")
                self.seen[name] = _read(etag, data)

    def _reject(self, name: str, remote: Remote, reason: str, check: str) -> None:
        fp = fingerprint_of(remote.data)
        self.rejected_here[name] = fp
        version = (remote.manifest.version if remote.manifest else None) or name
        self.post(
            (
                "rejected",
                {"name": name, "version": version, "reason": reason, "fingerprint": fp, "check": check},
            )
        )

    def _download(self, name: str, remote: Remote, objects: Mapping[str, Object]) -> None:
        assert remote.manifest is not None
        manifest = remote.manifest
        plan = Plan(
            self.config.source.download_concurrency,
            self.config.source.part_size,
            self.config.state.min_free_bytes,
        )
        self.log.info("download.started", name=name, bytes=manifest.total_bytes, files=len(manifest.files))
        try:
            fetched: Fetched = fetch(
                self.store,
                name,
                remote.data,
                manifest,
                {e.path: objects[e.path] for e in manifest.files},
                staging_root=self.staging_root,
                root=self.config.checkpoint_root,
                plan=plan,
                stop=self.stop,
            )
        except Cancelled:
            return
        except (SourceError, DownloadError) as exc:
            self._report("download", str(exc), name=name, retry_in_s=self.config.source.interval)
            return
        self._clear("download")
        if fetched.rejected:
            self._reject(name, remote, fetched.rejected, "digests")
            return
        self.log.info(
            "download.finished",
            name=name,
            bytes=fetched.fetched_bytes,
            reused_bytes=fetched.reused_bytes,
            seconds=round(fetched.seconds, 3),
            mb_per_s=round(fetched.fetched_bytes / fetched.seconds / 1e6, 1) if fetched.seconds else None,
        )
        self.post(("fetched", name))

    def _clean_staging(self, keep: set[str]) -> None:
        """Partial downloads of checkpoints that are gone from the store, or already placed."""
        try:
            leftovers = [p for p in self.staging_root.iterdir() if p.name not in keep]
        except FileNotFoundError:
            return
        for path in leftovers:
            shutil.rmtree(path, ignore_errors=True)


def prune(root: Path, names: list[str]) -> list[str]:
    """Delete downloaded checkpoints; each is renamed to a dot-name first, so no watcher or
    gate ever sees one half-deleted. Returns the names deleted."""
    done = []
    for name in names:
        doomed = root / f".deleting-{name}"
        try:
            os.rename(root / name, doomed)
        except OSError:
            continue
        shutil.rmtree(doomed, ignore_errors=True)
        done.append(name)
    return done
