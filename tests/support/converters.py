"""Converter commands for `[source] converter`, as small Python scripts (no torch): each
takes `{input}` and `{output}` like a real one and does one thing a real one may do."""

from __future__ import annotations

import sys
from pathlib import Path

COPYING = """
import shutil, sys
shutil.copytree(sys.argv[3], sys.argv[2], ignore=shutil.ignore_patterns("manifest.json"))
print("converted", sys.argv[1])
"""
"""Writes the checkpoint in argv[3] (made beforehand) as the output: the conversion's result."""

FAILING = """
import sys
for n in range(20):
    print(f"line {n}")
print("RuntimeError: the optimizer state is not a model", file=sys.stderr)
sys.exit(3)
"""

HANGING = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[3], "w").write(f"{os.getpid()} {child.pid}")
print("working", flush=True)
time.sleep(600)
"""
"""Never ends; its own child neither. Writes both pids to argv[3]."""

LINKING = """
import os, sys
os.symlink(sys.argv[3], sys.argv[2])
"""
"""Makes `{output}` a symlink to the checkpoint in argv[3]."""

OWN_MANIFEST = (
    COPYING
    + """
open(sys.argv[2] + "/manifest.json", "w").write('{"format_version": 1, "files": []}')
"""
)
"""Writes a manifest of its own into the output, besides the checkpoint in argv[3]."""

KILLED = """
import os, signal
print("loading 80 GB", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
"""Dies as the OOM killer kills it."""

REWRITING = (
    COPYING
    + """
open(sys.argv[1] + "/__1_0.distcp", "ab").write(b"more")
"""
)
"""Succeeds, but the trainer wrote the input again while it ran (argv[3]: the checkpoint)."""

EMPTY = """
import os, sys
os.makedirs(sys.argv[2])
open(os.path.join(sys.argv[2], "model.bin"), "wb").write(b"pickle")
"""

ECHOING = """
import os, sys
os.makedirs(sys.argv[3])
open(os.path.join(sys.argv[3], "argv"), "w").write("\\n".join(sys.argv[1:3]))
sys.exit(1)
"""
"""Writes what it was given (input, output) into argv[3], then fails."""


def converter(directory: Path, name: str, body: str, *extra: object) -> tuple[str, ...]:
    """argv running `body` as a script: `{input} {output}` then `extra`."""
    script = directory / f"{name}.py"
    script.write_text(body)
    return (sys.executable, str(script), "{input}", "{output}", *map(str, extra))
