"""LoRA adapters on a real CPU vLLM engine: publish → serving through the daemon, for adapters
of about 10, 100 and 1000 MB, against the engine's own load call for the same files.

A random Llama (`--hidden`, `--layers`; bf16) is served with `--enable-lora`; each adapter
targets every linear layer (F32, PEFT's layout), its rank chosen for its size. Baseline, same
run: `POST /v1/load_lora_adapter` of the same files under a fresh name, median of `--rounds`.
The daemon's run: the version folder renamed into `[adapters] root` → `adapter.loaded` seen
(copy + hash, gate, the canary of the base model before the load, the load, the canaries
after). The daemon's share is that minus its own load call, as a ratio of the baseline.

    .venv/bin/python bench/adapters.py [--sizes-mb 10,100,1000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path

from _common import emit

MODULES = {
    "self_attn.q_proj": (1, 1), "self_attn.k_proj": (1, 1), "self_attn.v_proj": (1, 1),
    "self_attn.o_proj": (1, 1), "mlp.gate_proj": (1, 2), "mlp.up_proj": (1, 2), "mlp.down_proj": (2, 1),
}  # fmt: skip
"""Module → (in, out) in units of the hidden size (the test model's MLP is twice as wide)."""
MAX_RANK = 512


def write_adapter(out: Path, *, hidden: int, layers: int, size_mb: int, seed: int) -> tuple[Path, int]:
    """A PEFT-shaped adapter of about `size_mb` MB (F32), and its rank."""
    import numpy as np
    from safetensors.numpy import save_file

    per_rank = sum((i + o) * hidden for i, o in MODULES.values()) * layers * 4
    rank = max(1, min(MAX_RANK, round(size_mb * 1e6 / per_rank)))
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(layers):
        for module, (i, o) in MODULES.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (
                rng.standard_normal((rank, i * hidden), dtype=np.float32) * 1e-3
            )
            tensors[f"{prefix}.lora_B.weight"] = (
                rng.standard_normal((o * hidden, rank), dtype=np.float32) * 1e-3
            )
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    targets = sorted({m.rsplit(".", 1)[1] for m in MODULES})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": targets}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out, rank


def _at(event: dict[str, object]) -> float:
    return datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2016)
    parser.add_argument("--layers", type=int, default=14)
    parser.add_argument("--sizes-mb", default="10,100,1000")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes_mb.split(",")]

    from tests.support.engine_fixtures import DaemonProcess, daemon_config, start_engine

    from vllm_reloader.config import EngineConfig
    from vllm_reloader.engine.client import EngineClient
    from vllm_reloader.tools.tinymodel import write_checkpoint

    rows = []
    with tempfile.TemporaryDirectory(prefix="vllm-reloader-bench-") as scratch:
        base = Path(scratch)
        model = write_checkpoint(base / "model", seed=1, hidden_size=args.hidden, layers=args.layers)
        made = {
            size: write_adapter(
                base / "staged" / f"a{size}", hidden=args.hidden, layers=args.layers, size_mb=size, seed=size
            )
            for size in sizes
        }
        lora = ("--enable-lora", "--max-lora-rank", str(MAX_RANK), "--max-loras", "1", "--max-cpu-loras", "2")
        engine = start_engine(
            model,
            base / "engine.log",
            api_key=None,
            env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
            args=lora,
        )
        client = EngineClient(EngineConfig(url=engine.url, reload_timeout=600))
        try:
            engine.complete()
            engine.http.post("/v1/completions", json={"prompt": "w1", "max_tokens": 1, "logprobs": 1})
            direct: dict[int, list[float]] = {size: [] for size in sizes}
            answer: dict[int, list[float]] = {size: [] for size in sizes}
            for n in range(args.rounds):
                for size, (path, _) in made.items():
                    started = time.perf_counter()
                    client.load_adapter(f"direct-{size}-{n}", str(path))
                    direct[size].append(time.perf_counter() - started)
                    started = time.perf_counter()
                    client.token_logprobs(
                        "The capital of France is", max_tokens=4, timeout=300, model=f"direct-{size}-{n}"
                    )
                    answer[size].append(time.perf_counter() - started)  # one canary request, as the daemon's
                    client.unload_adapter(f"direct-{size}-{n}")
            root = base / "adapters"
            root.mkdir()
            config = daemon_config(
                base / "d.toml", root=base / "root", engine_url=engine.url, state_dir=base / "s"
            )
            config.write_text(
                config.read_text() + f'[adapters]\nroot = "{root}"\nmax_rank = {MAX_RANK}\ninterval = 0.05\n'
            )
            daemon = DaemonProcess(config)
            try:
                daemon.wait_for("engine.reconciled", timeout=300)
                for size, (path, rank) in made.items():
                    (root / f"a{size}").mkdir()
                    begun, renamed_at = time.perf_counter(), time.time()
                    path.rename(root / f"a{size}" / "step-1")
                    loaded = daemon.wait_for("adapter.loaded", adapter=f"a{size}", timeout=900)
                    total = time.perf_counter() - begun
                    verified = daemon.wait_for("adapter.verified", adapter=f"a{size}")
                    load = float(loaded["load_ms"]) / 1000  # type: ignore[arg-type]
                    swap = float(loaded["duration_ms"]) / 1000  # type: ignore[arg-type]
                    found = _at(verified) - renamed_at  # detect + copy + hash + gate
                    baseline = statistics.median(direct[size])
                    nbytes = sum(f.stat().st_size for f in (root / f"a{size}" / "step-1").iterdir())
                    rows.append({
                        "adapter_mb": round(nbytes / 1e6, 1), "rank": rank,
                        "publish_to_serving_s": round(total, 3),
                        "found_copied_gated_s": round(found, 3),
                        "daemon_load_call_s": round(load, 3), "canaries_s": round(swap - load, 3),
                        "models_canaried": 2 + sum(1 for other in made if other < size),
                        "engine_load_call_s": round(baseline, 3),
                        "one_completion_s": round(statistics.median(answer[size]), 3),
                        "found_over_load_call": round(found / baseline, 3),
                        "total_over_load_call": round(total / baseline, 3),
                    })  # fmt: skip
            finally:
                daemon.stop()
        finally:
            engine.stop()
    return emit({"benchmark": "adapters", "rows": rows})


if __name__ == "__main__":
    main()
