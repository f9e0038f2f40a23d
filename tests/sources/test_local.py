import queue
import shlex
import subprocess
import sys
import time
from pathlib import Path

from vllm_reloader.sources import local

MOUNTINFO = """\
22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
40 22 0:51 / /mnt/ckpt rw,relatime shared:20 - nfs4 server:/export rw,vers=4.2
41 22 0:52 / /mnt/bucket rw,nosuid master:3 - fuse.s3fs s3fs rw
42 22 0:53 / /mnt/run\\040dir rw - nfs server:/runs rw
43 22 0:54 / /mnt/odd rw shared:9 propagate_from:2 - tmpfs tmpfs rw
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
    assert local.needs_polling(Path("/mnt/ckpt/run1"), MOUNTINFO)
    assert local.needs_polling(Path("/mnt/bucket"), MOUNTINFO)
    assert not local.needs_polling(Path("/srv/checkpoints"), MOUNTINFO)
    assert not local.needs_polling(Path("/mnt/ckpt2"), MOUNTINFO)


def test_source_reads_escaped_mount_points_and_optional_fields():
    assert local.filesystem_type(Path("/mnt/run dir/step-1"), MOUNTINFO) == "nfs"
    assert local.filesystem_type(Path("/mnt/odd/x"), MOUNTINFO) == "tmpfs"
    assert local.filesystem_type(Path("/mnt/ckpt"), "garbage line\n\n1 2 3 - \n") == ""


def test_source_sees_filesystem_type_under_systemd_proc_subset_pid(tmp_path):
    """The unit's `ProcSubset=pid` mounts /proc with subset=pid: /proc/mounts is gone there,
    /proc/self/mountinfo is not. Detection runs in such a /proc and finds a tmpfs mounted for it."""
    mount_point = tmp_path / "root"
    mount_point.mkdir()
    script = (
        "import os, sys;"
        "from pathlib import Path;"
        "from vllm_reloader.sources import local;"
        "assert not os.path.exists('/proc/mounts'), 'proc is not subset=pid';"
        f"print(local.filesystem_type(Path({str(mount_point)!r})))"
    )
    shell = (
        "mount -t proc -o subset=pid proc /proc && "
        f"mount -t tmpfs tmpfs {shlex.quote(str(mount_point))} && "
        f"exec {shlex.quote(sys.executable)} -c {shlex.quote(script)}"
    )
    done = subprocess.run(
        ["unshare", "--mount", "--pid", "--fork", "sh", "-c", shell],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "tmpfs"


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
