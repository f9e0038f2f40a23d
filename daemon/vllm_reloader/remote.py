"""An object-store prefix as a checkpoint source: list, judge, download into the local root.

An object store can only be polled. Each poll LISTs the prefix once and GETs a manifest
only when its ETag changed. A listed manifest is whole (a multipart upload is invisible
until it completes), but shards may still be uploading, so the verdicts are the local
gate's: pending (a shard not listed yet, or short), rejected (an unsafe path, a shard
longer than listed, bytes that fail their digest while downloading), or ready, which here
means: download the newest such checkpoint newer than the one serving. It lands in the
checkpoint root, where the local watcher and gate take over as for any local writer.

Foreign writers (`completeness = "hf-index" | "marker"`) are judged the same way from
their index or marker object, the listing, and each shard's header (two small ranged GETs,
once per ETag); the completing object is downloaded last.

This runs on its own thread, because a download takes minutes; rejections, which the
state must keep, and finished downloads go to the main loop's inbox like any other event.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from . import completeness, gate, layout, log, policy, source
from .completeness import Incomplete, fingerprint_of
from .config import Config
from .download import Cancelled, Fetched, Plan, fetch
from .errors import DownloadError, SourceError
from .manifest import MANIFEST_NAME, Manifest, ManifestFile, ManifestInvalid, ManifestNotJSON
from .manifest import parse as parse_manifest
from .objstore import Object, Store


@dataclass(frozen=True)
class Remote:
    """What one checkpoint's completing object (`signal`: our manifest, an HF index, a
    marker) held when last fetched; for a foreign writer, `manifest` is worked out from
    the listing and headers each time it is judged."""

    signal: str
    etag: str | None
    data: bytes
    manifest: Manifest | None
    problem: str = ""
    fingerprint: str = ""


def judge(remote: Remote, objects: Mapping[str, Object]) -> Incomplete | None:
    """pending / rejected from the manifest and the listing alone; None: download it."""
    fp = remote.fingerprint
    if remote.manifest is None:
        return Incomplete("rejected", remote.problem, fp)
    manifest = remote.manifest
    if problem := gate.listing_problem(manifest):
        return Incomplete("rejected", problem, fp, "paths")
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


def _read(signal: str, etag: str | None, data: bytes) -> Remote:
    if signal != MANIFEST_NAME:  # its fingerprint depends on the listing too: set each poll
        return Remote(signal, etag, data, None)
    fp = fingerprint_of(data)
    try:
        return Remote(signal, etag, data, parse_manifest(data), fingerprint=fp)
    except ManifestNotJSON as exc:  # a listed object is whole: it will not become JSON
        return Remote(signal, etag, data, None, str(exc), fp)
    except ManifestInvalid as exc:
        return Remote(signal, etag, data, None, f"manifest: {exc}", fp)


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
        self.convention = gate.GateOptions.from_config(config).convention
        self.header_sizes: dict[tuple[str, str | None], int] = {}
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
        try:
            while not self.stop.is_set():
                self.poll()
                self.stop.wait(self.config.source.interval)
        except Exception:
            # A bug, not a store failure: say so; the watchdog pings stop and systemd restarts us.
            self.log.exception("source.crashed", source=self.config.source.path)
            raise

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
        signals = {}
        for name, objects in by_name.items():
            if signal := completeness.signal_name([k for k in objects if "/" not in k], self.convention):
                signals[name] = (signal, objects[signal])
        try:
            self._refresh(signals)
        except SourceError as exc:
            self._report("source", str(exc), retry_in_s=self.config.source.interval)
            return
        self._clear("source")
        local = source.list_candidates(self.config.checkpoint_root, ())
        self._clean_staging(set(self.seen) - local)
        for name, remote in self.seen.items():
            if remote.signal != MANIFEST_NAME:
                self.seen[name] = replace(
                    remote, fingerprint=self._foreign_fingerprint(remote, by_name[name])
                )
        candidates = {
            name: policy.Candidate(name, r.manifest.step if r.manifest else None, r.fingerprint)
            for name, r in self.seen.items()
            if name not in local
        }
        rejected = {**self.rejected(), **self.rejected_here}
        waiting = {}
        for candidate in policy.to_try(candidates, serving=self.serving(), rejected=rejected):
            remote, objects = self.seen[candidate.name], by_name[candidate.name]
            try:
                described = self._describe(candidate.name, remote, objects)
            except SourceError as exc:
                self._report("source", str(exc), retry_in_s=self.config.source.interval)
                return
            verdict = described if isinstance(described, Incomplete) else judge(described, objects)
            if verdict is None:
                assert isinstance(described, Remote)
                self._download(candidate.name, described, objects)
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

    # -- foreign writers: what their listing and headers say ---------------------------------

    def _wanted(self, objects: Mapping[str, Object]) -> dict[str, Object]:
        return {k: o for k, o in objects.items() if "/" not in k and completeness.wanted(k, self.convention)}

    def _foreign_fingerprint(self, remote: Remote, objects: Mapping[str, Object]) -> str:
        sizes = {k: o.size for k, o in self._wanted(objects).items()}
        return completeness.listing_fingerprint(sizes, (remote.signal, remote.data))

    def _describe(self, name: str, remote: Remote, objects: Mapping[str, Object]) -> Remote | Incomplete:
        """Ours as fetched; a foreign writer's as the local gate would work it out."""
        if remote.signal == MANIFEST_NAME:
            return remote
        fp, top = remote.fingerprint, self._wanted(objects)
        if remote.signal == completeness.INDEX_NAME:
            try:
                weights: list[str] | str | Incomplete = completeness.weights_from_index(remote.data)
            except ValueError:
                return Incomplete("rejected", f"{completeness.INDEX_NAME} is not valid JSON", fp)
            if isinstance(weights, str):
                return Incomplete("rejected", weights, fp)
        elif remote.signal == completeness.SINGLE_NAME:
            quiet_for = time.time() - max(o.modified for o in top.values())
            if quiet_for < self.convention.settle_seconds:
                return Incomplete("pending", f"changed {quiet_for:.1f} s ago; waiting for it to settle", fp)
            weights = [completeness.SINGLE_NAME]
        else:
            weights = completeness.marked_weights(list(top), fp)
        if isinstance(weights, Incomplete):
            return weights
        files = []
        for weight in weights:
            if not completeness.is_top_level_shard(weight):
                return Incomplete(
                    "rejected", f"shard {weight!r} is not a top-level .safetensors file", fp, "paths"
                )
            if weight not in top:
                return Incomplete("pending", f"{weight} is not uploaded yet", fp)
            try:
                size = self._header_size(name, weight, top[weight])
            except layout.LayoutUnreadable as exc:
                return Incomplete("rejected", str(exc), fp, "headers")
            if size is None:
                return Incomplete("pending", f"{weight}: header not fully uploaded", fp)
            files.append(ManifestFile(path=weight, size=size))
        files += [
            ManifestFile(path=k, size=o.size)
            for k, o in sorted(top.items())
            if k not in weights and k != remote.signal
        ]
        return replace(remote, manifest=Manifest(format_version=1, files=tuple(files)))

    def _header_size(self, name: str, weight: str, listed: Object) -> int | None:
        """Two small ranged GETs per shard, once per ETag."""
        key = (f"{name}/{weight}", listed.etag)
        if key not in self.header_sizes:

            def read(start: int, end: int) -> bytes:
                return bytes(self.store.get_range(key[0], start, end, listed.etag))

            size = layout.size_from_header(weight, read, listed.size)
            if size is None:
                return None
            self.header_sizes[key] = size
        return self.header_sizes[key]

    def _refresh(self, signals: Mapping[str, tuple[str, Object]]) -> None:
        """GET each completing object whose ETag changed (a single model.safetensors: never)."""
        for name in set(self.seen) - set(signals):
            del self.seen[name]
        for name, (signal, listed) in signals.items():
            known = self.seen.get(name)
            if known is not None and known.signal == signal and known.etag == listed.etag is not None:
                continue
            if signal == completeness.SINGLE_NAME:
                data, etag = b"", listed.etag
            else:
                data, etag = self.store.get(f"{name}/{signal}")
            if known is None:
                self.log.info("checkpoint.seen", name=name, path=f"{self.config.source.path}/{name}")
            self.seen[name] = _read(signal, etag, data)

    def _reject(self, name: str, remote: Remote, reason: str, check: str) -> None:
        fp = remote.fingerprint
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
                None if remote.signal == completeness.SINGLE_NAME else (remote.signal, remote.data),
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
        if remote.signal == completeness.SINGLE_NAME and fetched.path is not None:
            _backdate(fetched.path, max(o.modified for o in objects.values()))
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


def _backdate(directory: Path, when: float) -> None:
    """A downloaded single-file checkpoint keeps the store's quiet time, or the local gate
    would wait `settle_seconds` a second time."""
    for path in (*directory.iterdir(), directory):
        os.utime(path, (when, when))
