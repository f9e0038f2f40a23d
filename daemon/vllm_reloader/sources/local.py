"""Where candidates come from: a local checkpoint root, watched and rescanned.

watchdog (inotify, or polling on network filesystems where inotify sees nothing) runs its
callbacks on its own thread, so they only map a path to a candidate name and enqueue it;
the daemon's main loop does the work. A full rescan backs the watcher up, because an
inotify queue can overflow and a poll can miss a rename.
"""

from __future__ import annotations

import errno
import fnmatch
import os
import re
import unicodedata
from collections.abc import Callable, Iterable
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver
from watchdog.observers.polling import PollingObserver

from ..checkpoint.conventions import UNFINISHED_SUFFIX

# Names trainers write while a checkpoint is not done yet, never candidates themselves
# (dot-directories neither): Orbax's temporary directories, HF Trainer's, partial files, and
# NeMo's `<name>-unfinished` marker (which also holds `<name>` pending; see `gate`).
ALWAYS_IGNORED = (
    "*.orbax-checkpoint-tmp-*",
    "tmp-checkpoint-*",
    "*.tmp",
    "*.partial",
    "*" + UNFINISHED_SUFFIX,
)

# Filesystems on which inotify does not see writes made by other hosts.
NETWORK_FS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "ceph", "glusterfs", "lustre", "gpfs")


def is_ignored(name: str, ignore: Iterable[str] = ()) -> bool:
    patterns = (*ALWAYS_IGNORED, *ignore)
    return name.startswith(".") or any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def unusable_name(name: str) -> str | None:
    """Why a name can never be a checkpoint's: it becomes the weight version, a state file key
    and a log field, so no undecodable bytes (they arrive as surrogates, and the state file
    could not be written) and no control or format characters."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return "name is not valid UTF-8"
    if any(unicodedata.category(char)[0] == "C" for char in name):
        return "name holds control characters"
    return None


def name_too_long(root: Path, directory: str) -> str | None:
    """Why `directory` cannot be made in `root` (an object store allows 1024-byte names)."""
    try:
        limit = os.pathconf(root if root.exists() else root.parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    if len(os.fsencode(directory)) > limit:
        return f"name is too long for {root}: {len(os.fsencode(directory))} bytes, at most {limit}"
    return None


OWN_ERRNOS = {
    errno.ENAMETOOLONG: "local",
    errno.EILSEQ: "local",
    errno.EISDIR: "paths",
    errno.ENOTDIR: "paths",
}
"""A download failing with one of these fails for its own names or paths: no retry fixes it.
The check it is rejected with: `local` (this host's filesystem cannot hold it: not a verdict on
the version for the fleet) or `paths` (its paths clash, on any host)."""


def candidate_name(root: Path, path: str, ignore: Iterable[str]) -> str | None:
    """The top-level directory under `root` that `path` belongs to, if it may be a candidate."""
    try:
        relative = Path(path).relative_to(root)
    except ValueError:
        return None
    if not relative.parts:
        return None
    name = relative.parts[0]
    if name.endswith(UNFINISHED_SUFFIX):  # NeMo's marker coming or going concerns `<name>`
        name = name.removesuffix(UNFINISHED_SUFFIX)
    return None if is_ignored(name, ignore) else name


def list_candidates(root: Path, ignore: Iterable[str]) -> set[str]:
    """Directory names directly under `root` that may be checkpoints."""
    ignore = tuple(ignore)
    try:
        with os.scandir(root) as entries:
            return {
                e.name for e in entries if e.is_dir(follow_symlinks=False) and not is_ignored(e.name, ignore)
            }
    except FileNotFoundError:
        return set()


MOUNTINFO = Path("/proc/self/mountinfo")
"""Per-process, so it stays visible under systemd's `ProcSubset=pid`, which hides /proc/mounts."""


def _unescape(field: str) -> str:
    """The kernel writes space, tab, newline and backslash in mount paths as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def filesystem_type(path: Path, mountinfo: str | None = None) -> str:
    """The fstype of the mount holding `path`, from /proc/self/mountinfo (longest prefix wins)."""
    if mountinfo is None:
        try:
            mountinfo = MOUNTINFO.read_text()
        except OSError:
            return ""
    target = os.path.realpath(path)
    best, fstype = "", ""
    for line in mountinfo.splitlines():
        fields, sep, rest = line.partition(" - ")
        before, after = fields.split(), rest.split()
        if not sep or len(before) < 5 or not after:
            continue
        mount_point = _unescape(before[4])
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):
            best, fstype = mount_point, after[0]
    return fstype


def needs_polling(path: Path, mountinfo: str | None = None) -> bool:
    fstype = filesystem_type(path, mountinfo)
    return fstype in NETWORK_FS or fstype == "fuse" or fstype.startswith("fuse.")


INCOMING_PREFIX = ".incoming-"
"""Where `vllm-reloader publish` puts a checkpoint's files before the rename that publishes it."""


def written_shard(root: Path, path: str, ignore: Iterable[str]) -> bool:
    """A `.safetensors` a writer just closed, in a candidate or a publish's incoming directory:
    worth reading before its manifest lands."""
    try:
        relative = Path(path).relative_to(root)
    except ValueError:
        return False
    if len(relative.parts) != 2 or not relative.name.endswith(".safetensors"):
        return False
    top = relative.parts[0]
    return top.startswith(INCOMING_PREFIX) or not is_ignored(top, ignore)


class _Enqueue(FileSystemEventHandler):
    def __init__(
        self,
        root: Path,
        ignore: tuple[str, ...],
        notify: Callable[[str], None],
        written: Callable[[str], None] | None,
    ) -> None:
        self.root, self.ignore, self.notify, self.written = root, ignore, notify, written

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type in ("opened", "closed_no_write"):
            return
        if event.event_type in ("closed", "moved") and self.written is not None:
            placed = os.fsdecode(event.dest_path or event.src_path)  # `publish --move` renames shards in
            if written_shard(self.root, placed, self.ignore):
                self.written(placed)
        for path in (event.src_path, event.dest_path):
            if path and (name := candidate_name(self.root, os.fsdecode(path), self.ignore)):
                self.notify(name)


def disable_move_pairing_delay() -> None:
    """watchdog holds each IN_MOVED_FROM up to 0.5 s to pair it with its IN_MOVED_TO, and its
    queue can sit out the whole delay even after the pair arrived: a publish (a rename inside
    the root) was then seen ~500 ms late about one time in six (bench/detection.py). Both
    halves map to a candidate name here, so pairing buys nothing. The delay is a class
    attribute read when an inotify observer starts: set it just before."""
    try:  # Linux only
        from watchdog.observers.inotify_move_event_grouper import InotifyMoveEventGrouper
    except ImportError:  # pragma: no cover
        return
    InotifyMoveEventGrouper.delay = 0.0


class Watcher:
    """Calls `notify(name)` from watchdog's thread whenever something under ROOT/name changes."""

    def __init__(
        self,
        root: Path,
        *,
        ignore: Iterable[str],
        notify: Callable[[str], None],
        poll: bool,
        poll_interval: float,
        written: Callable[[str], None] | None = None,
        handler: FileSystemEventHandler | None = None,
    ) -> None:
        """`written(path)`: a shard closed after writing (inotify only; polling cannot tell);
        `handler`: watchdog's events go to it instead (`notify` and `written` unused)."""
        self.root = root
        self.notify = notify
        self.polling = poll or needs_polling(root)
        self._observer: BaseObserver = PollingObserver(timeout=poll_interval) if self.polling else Observer()
        handler = handler or _Enqueue(root, tuple(ignore), lambda name: self.notify(name), written)
        self._observer.schedule(handler, str(root), recursive=True)

    def start(self) -> None:
        if not self.polling:
            disable_move_pairing_delay()
        self._observer.start()

    def is_alive(self) -> bool:
        return self._observer.is_alive()

    def close(self) -> None:
        self._observer.stop()
        if self._observer.is_alive():
            self._observer.join(timeout=5)
