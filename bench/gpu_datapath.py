"""GPU data path, for when a GPU machine is lent: the worker extension's reader (threads →
reused pinned host buffers) and vLLM's default one (safetensors mmap, tensor by tensor), each
feeding `copy_` into tensors already on the device (what an in-place reload does), vs the
measured pinned host-to-device bandwidth of the same machine.

Needs only torch and safetensors (vLLM does not travel to the GPU machine), and the
extension's module from this tree. `--device cpu` runs the same code without a GPU (no
pinning), to check the script itself.

    python bench/gpu_datapath.py [--gb 4] [--tensors 64] [--device cuda] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=4.0)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="best of, alternating the two readers")
    args = parser.parse_args(argv)

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from vllm_reloader.extension import readers as worker

    device = torch.device(args.device)
    on_gpu = device.type != "cpu"
    numel = int(args.gb * 1e9 / 2 / args.tensors)  # bf16

    def sync() -> None:
        if on_gpu:
            torch.accelerator.synchronize()

    with tempfile.TemporaryDirectory(prefix="vllm-reloader-gpu-") as scratch:
        directory = Path(scratch)
        expected = {
            f"model.layers.{i}.w": torch.randn(numel, dtype=torch.bfloat16) for i in range(args.tensors)
        }
        save_file(expected, str(directory / "model.safetensors"))
        nbytes = (directory / "model.safetensors").stat().st_size
        (directory / "model.safetensors").read_bytes()  # page cache warm, as after the gate's digests
        params = {name: torch.empty(numel, dtype=torch.bfloat16, device=device) for name in expected}
        modules = [f"model.layers.{i}" for i in range(args.tensors)]
        checkpoint = worker.Checkpoint(directory)
        reads = worker.runs(worker.layer_order(worker.plan(checkpoint), modules))
        pool = worker.BufferPool(pin=on_gpu)

        def timed(load) -> float:  # type: ignore[no-untyped-def]
            sync()
            started = time.perf_counter()
            load()
            sync()
            return time.perf_counter() - started

        pinned = torch.empty(numel, dtype=torch.bfloat16, pin_memory=on_gpu)

        def h2d() -> None:  # the bound: pinned → device only
            for param in params.values():
                param.copy_(pinned, non_blocking=True)

        def builtin() -> None:  # vLLM's default iterator + default_weight_loader
            with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118
                    params[name].copy_(f.get_tensor(name))

        def extension() -> None:
            for name, tensor in worker.read_weights(reads, pool, args.threads, worker.LoadStats()):
                params[name].copy_(tensor)

        h2d_s = min(timed(h2d) for _ in range(args.rounds))
        times: dict[str, list[float]] = {"builtin": [], "extension": []}
        for i in range(args.rounds):
            for name, load in [("builtin", builtin), ("extension", extension)][:: 1 if i % 2 == 0 else -1]:
                times[name].append(timed(load))
        assert all(torch.equal(params[n].cpu(), t) for n, t in expected.items()), "copied bytes differ"
        if on_gpu:
            torch.accelerator.reset_peak_memory_stats()
        before = torch.accelerator.memory_allocated() if on_gpu else None
        timed(extension)
        peak = torch.accelerator.max_memory_allocated() if on_gpu else None
        checkpoint.close()
    builtin_s, extension_s = min(times["builtin"]), min(times["extension"])
    result = {
        "benchmark": "gpu_datapath", "device": str(device),
        "name": torch.cuda.get_device_name() if device.type == "cuda" else device.type, "bytes": nbytes,
        "h2d_gb_per_s": round(nbytes / h2d_s / 1e9, 2),
        "builtin_gb_per_s": round(nbytes / builtin_s / 1e9, 2),
        "extension_gb_per_s": round(nbytes / extension_s / 1e9, 2),
        "ratio": round(h2d_s / extension_s, 3), "extension_speedup": round(builtin_s / extension_s, 3),
        "device_growth_bytes": None if peak is None or before is None else peak - before,
        "pinned_buffer_bytes": pool.nbytes,
    }  # fmt: skip
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
