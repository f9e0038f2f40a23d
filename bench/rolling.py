"""A rolling update on one host: two real CPU vLLM engines (each bound to its own core) and
one daemon, against one engine and one daemon, in the same run.

Baseline: publish → serving with the daemon driving engine A alone. Then the same daemon
config with `urls = [A, B]`: publish → both serving (A first, its canary, then B). A rolling
update is sequential by design (no engine moves before the canary engine passed), so the
ideal for two engines is the baseline plus B's own reload: `ideal = 1 + B's reload ÷ baseline`.

    .venv/bin/python bench/rolling.py [--hidden 2016 --layers 12 --rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _common import emit


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2016)  # 42 heads of 48
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)

    from tests.support.engine_fixtures import DaemonProcess, daemon_config, start_engine

    from vllm_reloader.tools.publish import publish
    from vllm_reloader.tools.tinymodel import write_checkpoint

    with tempfile.TemporaryDirectory(prefix="vllm-reloader-bench-") as scratch:
        base = Path(scratch)
        root = base / "root"
        seeds = [
            write_checkpoint(base / f"w{i}", seed=i + 1, hidden_size=args.hidden, layers=args.layers)
            for i in range(2)
        ]
        publish(seeds[0], root, step=1)
        nbytes = sum(p.stat().st_size for p in (root / "step-1").glob("*.safetensors"))
        with ThreadPoolExecutor(2) as pool:
            starting = [
                pool.submit(
                    start_engine, root / "step-1", base / f"{n}.log", env={"VLLM_CPU_OMP_THREADS_BIND": core}
                )
                for n, core in (("a", "0"), ("b", "1"))
            ]
            first, second = (f.result() for f in starting)
        step = 1
        one: list[float] = []
        rolled: list[float] = []
        canary_ms: list[float] = []
        follower_ms: list[float] = []
        try:
            for engine in (first, second):  # warm the logprobs path the canary takes (seconds, once)
                engine.http.post("/v1/completions", json={"prompt": "w1", "max_tokens": 1, "logprobs": 1})
            for urls, times in (([first.url], one), ([first.url, second.url], rolled)):
                config = daemon_config(
                    base / f"d{len(urls)}.toml",
                    root=root,
                    engine_url=urls,
                    state_dir=base / f"state{len(urls)}",
                )
                daemon = DaemonProcess(config)
                try:
                    for url in urls:
                        daemon.wait_for("engine.reconciled", engine=url, timeout=120)
                    for _ in range(args.rounds):
                        step += 1
                        version = f"step-{step}"
                        begun = time.perf_counter()
                        publish(seeds[step % 2], root, step=step)
                        done = daemon.wait_for(
                            "reload.succeeded", engine=urls[-1], version=version, timeout=600
                        )
                        times.append(time.perf_counter() - begun)
                        if len(urls) == 2:
                            canary = daemon.wait_for("reload.succeeded", engine=urls[0], version=version)
                            canary_ms.append(float(canary.get("canary_ms") or 0))
                            follower_ms.append(float(done["duration_ms"]))
                finally:
                    daemon.stop()
        finally:
            first.stop()
            second.stop()
    baseline, rolling = statistics.median(one), statistics.median(rolled)
    follower_s = statistics.median(follower_ms) / 1000
    ideal = 1 + follower_s / baseline
    return emit({
        "benchmark": "rolling", "engines": 2, "bytes": nbytes, "rounds": args.rounds,
        "one_engine_s": round(baseline, 3), "two_engines_s": round(rolling, 3),
        "ratio": round(rolling / baseline, 3), "ideal": round(ideal, 3),
        "ratio_vs_ideal": round(rolling / baseline / ideal, 3),
        "canary_ms": round(statistics.median(canary_ms), 1),
        "follower_reload_ms": round(follower_s * 1000, 1),
    })  # fmt: skip


if __name__ == "__main__":
    main()
