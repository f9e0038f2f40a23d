import queue
import time
from pathlib import Path

from vllm_reloader.sources import local

MOUNTS = """\
/dev/vda / ext4 rw 0 0
server:/export /mnt/ckpt nfs4 rw 0 0
s3fs /mnt/bucket fuse.s3fs rw 0 0
"""


def test_source_maps_paths_to_top_level_candidate(tmp_path):
    ignore = ("*.tmp",)
    assert local.candidate_name(tmp_path, str(tmp_path / "step-1" / "a" / "b"), ignore) == "step-1"
    assert local.candidate_name(tmp_path, str(tmp_path / ".incoming-step-2" / "x"), ignore) is None
    assert local.candidate_name(tmp_path, str(tmp_path / "x.tmp"), ignore) is None
    assert local.candidate_name(tmp_path, str(tmp_path), ignore) is None
    assert local.candidate_name(tmp_path, "/elsewhere/step-1", ignore) is None


def test_source_lists_directories_only_and_skips_ignored(tmp_path):
    for name in ("step-1", "step-2", ".incoming-step-3", "tmp-checkpoint-4"):
        (tmp_path / name).mkdir()
    (tmp_path / "notes.txt").write_text("x")
    assert local.list_candidates(tmp_path, ("tmp-*",)) == {"step-1", "step-2"}


def test_source_polls_on_network_and_fuse_mounts():
    assert local.needs_polling(Path("/mnt/ckpt/run1"), MOUNTS)
    assert local.needs_polling(Path("/mnt/bucket"), MOUNTS)
    assert not local.needs_polling(Path("/srv/checkpoints"), MOUNTS)
    assert not local.needs_polling(Path("/mnt/ckpt2"), MOUNTS)


def watch(tmp_path: Path, poll: bool) -> tuple[local.Watcher, "queue.SimpleQueue[str]"]:
    seen: queue.SimpleQueue[str] = queue.SimpleQueue()
    watcher = local.Watcher(tmp_path, ignore=("*.tmp",), notify=seen.put, poll=poll, poll_interval=0.1)
    watcher.start()
    return watcher, seen


def wait_for(seen: "queue.SimpleQueue[str]", name: str, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if seen.get(timeout=0.1) == name:
                return True
        except queue.Empty:
            pass
    return False


def test_source_watcher_reports_rename_into_root(tmp_path):
    for poll in (False, True):
        root = tmp_path / ("poll" if poll else "inotify")
        root.mkdir()
        watcher, seen = watch(root, poll)
        try:
            incoming = root / ".incoming-step-1"
            incoming.mkdir()
            (incoming / "manifest.json").write_text("{}")
            incoming.rename(root / "step-1")
            assert wait_for(seen, "step-1"), f"poll={poll}"
            assert watcher.polling is poll
        finally:
            watcher.close()
