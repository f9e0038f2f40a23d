"""Every benchmark, one command: a table on stdout, all rows as JSON in `--out`.

Each figure is a ratio against a baseline measured in the same run (these machines are
noisy). `--quick` shrinks sizes and counts to check the suite works, not to measure.

    .venv/bin/python bench/run.py [--quick] [--engine] [--out bench/results.json]

`--engine` adds the end-to-end run on a real CPU vLLM engine (a ~1 GB model; minutes) and the
rolling update over two such engines, and the same behind HAProxy with drain on and off.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import time
from pathlib import Path

import adapters
import detection
import download
import drain
import footprint
import gate
import responsive
import rolling
import staged

import e2e

QUICK = {
    "detection": ["--runs", "5"],
    "gate": ["--sizes-mb", "10", "--shards", "1,8"],
    "responsive": ["--gb", "0.05", "--shards", "2", "--watchdog-ms", "400"],
    "staged": ["--gb", "0.05", "--shards", "4", "--scans", "host,engine"],
    "download": ["--mb", "8", "--files", "2", "--rounds", "2", "--part-mb", "1"],
    "footprint": ["--checkpoints", "20", "--seconds", "2"],
    "e2e": ["--hidden", "64", "--layers", "2", "--rounds", "1"],
    "rolling": ["--hidden", "64", "--layers", "2", "--rounds", "1"],
    "drain": ["--hidden", "96", "--layers", "2"],
    "adapters": ["--hidden", "96", "--layers", "2", "--sizes-mb", "1,2", "--rounds", "1"],
}
FULL = {
    "detection": [],
    "gate": [
        "--sizes-mb",
        "1000,8000,16000",
        "--shards",
        "1,8,64",
        "--dtypes",
        "F64,F32,BF16,F16,F8_E5M2,F8_E4M3",
        "--plot",
        str(Path(__file__).parent / "gate.png"),
        "--plot-dtypes",
        str(Path(__file__).parent.parent / "docs" / "gate-dtypes.png"),
    ],
    "responsive": ["--gb", "16", "--shards", "8"],
    "staged": ["--gb", "1,8,16", "--shards", "8", "--dtypes", "BF16,F32", "--scans", "host,engine"],
    "download": [],
    "footprint": [],
    "e2e": [],
    "rolling": [],
    "drain": [],
    "adapters": [],
}


def _machine() -> dict[str, object]:
    cpu = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")), platform.processor(),
    )  # fmt: skip
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "at": time.strftime("%F %T"),
    }


def _row(result: dict[str, object]) -> str:
    name = result.pop("benchmark")
    return f"{name:<10} " + "  ".join(f"{k}={v}" for k, v in result.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--engine", action="store_true", help="also the end-to-end run on a CPU vLLM engine")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results.json")
    args = parser.parse_args()
    plan = QUICK if args.quick else FULL
    rows: list[dict[str, object]] = []
    for module in (
        detection,
        gate,
        responsive,
        staged,
        download,
        footprint,
        *((e2e, rolling, drain, adapters) if args.engine else ()),
    ):
        name = module.__name__
        with contextlib.redirect_stdout(io.StringIO()):  # each prints its JSON lines; the table is ours
            found = module.main(plan[name])
        rows.extend(found if isinstance(found, list) else [found])
    report = {"machine": _machine(), "quick": args.quick, "results": rows}
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"machine: {report['machine']}")
    for row in rows:
        print(_row(dict(row)))
    print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
