"""The bench run (tiny sizes): they must not rot. Their numbers are read, not asserted."""

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).parent.parent / "bench"


def test_download_benchmark_reports_a_ratio_against_boto3():
    tiny = ["--mb", "2", "--files", "2", "--rounds", "2", "--part-mb", "1"]
    command = [sys.executable, str(BENCHMARKS / "download.py"), *tiny]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["bytes"] == 2_000_000 and report["ratio"] > 0
    assert report["ours_mb_per_s"] > 0 and report["boto3_mb_per_s"] > 0
