"""The benchmark suite runs (`--quick`): it must not rot. Its numbers are read, not asserted."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parent.parent / "bench"


def test_bench_quick_run_writes_every_benchmark_with_its_ratio(tmp_path):
    out = tmp_path / "results.json"
    command = [sys.executable, str(BENCH / "run.py"), "--quick", "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    by_name: dict[str, list[dict]] = {}
    for row in report["results"]:
        by_name.setdefault(row["benchmark"], []).append(row)
    assert set(by_name) == {"detection", "gate", "responsive", "staged", "download", "footprint"}
    assert {r["mode"] for r in by_name["detection"]} == {"inotify", "polling"}
    assert all(r["ratio_p50"] > 0 for r in by_name["detection"])
    assert all(r["ratio"] > 0 for r in by_name["gate"] + by_name["download"])
    assert by_name["footprint"][0]["rss_ratio"] > 0
    (responsive,) = by_name["responsive"]
    assert responsive["status_answers_during_gate"] > 0 and responsive["watchdog_pings_during_gate"] > 0
    assert all(r["ratio_vs_blake3"] > 0 and r["one_pass_speedup"] > 0 for r in by_name["gate"])
    (staged,) = by_name["staged"]
    assert staged["ratio"] > 0 and staged["ratio_whole"] > 0 and staged["cached_bytes"] is not None
    assert "detection  mode=inotify" in result.stdout


@pytest.mark.engine
def test_bench_e2e_on_a_real_engine_splits_publish_to_serving_into_phases():
    command = [sys.executable, str(BENCH / "e2e.py"), "--hidden", "64", "--layers", "2", "--rounds", "1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["benchmark"] == "e2e" and report["bytes"] > 0
    assert all(report[k] is not None for k in ("detect_ms", "gate_ms", "pause_ms", "reload_ms", "resume_ms"))
    assert report["ratio_vs_restart"] > 0 and report["engine_restart_s"] > 0
    assert report["loader"] == "extension" and report["extension_speedup"] > 0
    assert report["extension_allocations_after_first"] == 0


@pytest.mark.engine
def test_bench_rolling_update_of_two_real_engines_reports_its_ratio_to_one():
    command = [sys.executable, str(BENCH / "rolling.py"), "--hidden", "64", "--layers", "2", "--rounds", "1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["benchmark"] == "rolling" and report["engines"] == 2
    assert report["ratio"] > 1 and report["ideal"] > 1 and report["follower_reload_ms"] > 0


def test_bench_gpu_datapath_script_runs_on_cpu_until_a_gpu_is_lent():
    command = [
        sys.executable,
        str(BENCH / "gpu_datapath.py"),
        "--device",
        "cpu",
        "--gb",
        "0.02",
        "--tensors",
        "4",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["device"] == "cpu" and report["bytes"] > 0 and report["ratio"] > 0
    assert report["extension_speedup"] > 0 and report["pinned_buffer_bytes"] > 0
