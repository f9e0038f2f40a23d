"""What `[readiness] drain` prevents: a real HAProxy in front of two real CPU vLLM engines,
clients on it all along, through three rolling updates and one checkpoint whose canary fails,
once with drain on and once with it off (same engines, same run), side by side.

Counted: failed requests; requests answered by an engine while it was paused (they waited
through the pause); moments an engine was paused while HAProxy still sent it traffic;
answers from the failing checkpoint (greedy answers no good version gives); and the latency
tail through the updates next to a quiet stretch with no reload.

    .venv/bin/python bench/drain.py [--hidden 768 --layers 4]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from _common import emit


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768)  # 16 heads of 48
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args(argv)

    from tests.support.rolling_updates import drain_counts, roll, side_by_side, two_engines

    from vllm_reloader.tools.publish import publish
    from vllm_reloader.tools.tinymodel import write_checkpoint

    with tempfile.TemporaryDirectory(prefix="vllm-reloader-bench-") as scratch:
        base = Path(scratch)
        root = base / "root"
        seeds = [
            write_checkpoint(base / f"seed-{i}", seed=i, hidden_size=args.hidden, layers=args.layers)
            for i in range(1, 5)
        ]
        publish(seeds[0], root, step=1)
        engines = two_engines(root / "step-1", base)
        try:
            on = roll(base / "on", engines, root, seeds[1:], seeds[0], first_step=2, drain=True)
            shutil.rmtree(root / "step-5")  # rejected by the first daemon: not the second's to find
            off = roll(base / "off", engines, root, seeds[1:], seeds[0], first_step=6, drain=False)
        finally:
            for engine in engines:
                engine.stop()
    result = {"on": drain_counts(on), "off": drain_counts(off)}
    print(side_by_side(result["on"], result["off"]), file=sys.stderr)
    return emit({"benchmark": "drain", "hidden": args.hidden, "layers": args.layers, **result})


if __name__ == "__main__":
    main()
