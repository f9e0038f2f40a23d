"""GPU data path, for when a GPU machine is lent: safetensors → reused pinned host buffers →
`copy_` into tensors already on the device (what an in-place reload does), vs the measured
pinned host-to-device bandwidth of the same machine.

Needs only torch and safetensors (vLLM does not travel to the GPU machine). `--device cpu`
runs the same code without a GPU (no pinning), to check the script itself.

    python bench/gpu_datapath.py [--gb 4] [--tensors 64] [--buffers 2] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=4.0)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--buffers", type=int, default=2, help="pinned buffers in rotation")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    numel = int(args.gb * 1e9 / 2 / args.tensors)  # bf16
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    with tempfile.TemporaryDirectory(prefix="vllm-reloader-gpu-") as scratch:
        path = Path(scratch) / "model.safetensors"
        save_file({f"t{i}": torch.randn(numel, dtype=torch.bfloat16) for i in range(args.tensors)}, str(path))
        nbytes = path.stat().st_size
        path.read_bytes()  # page cache warm, as after the gate's digests
        params = [torch.empty(numel, dtype=torch.bfloat16, device=device) for _ in range(args.tensors)]
        pinned = [torch.empty(numel, dtype=torch.bfloat16, pin_memory=on_gpu) for _ in range(args.buffers)]

        sync()
        started = time.perf_counter()
        for i in range(args.tensors):  # baseline: pinned → device only
            params[i].copy_(pinned[i % args.buffers], non_blocking=True)
        sync()
        h2d_s = time.perf_counter() - started

        events = [torch.cuda.Event() if on_gpu else None for _ in range(args.buffers)]
        sync()
        started = time.perf_counter()
        with safe_open(str(path), framework="pt") as f:
            for i in range(args.tensors):
                slot = i % args.buffers
                if events[slot] is not None:
                    events[slot].synchronize()  # the copy that last used this buffer is done
                pinned[slot].copy_(f.get_tensor(f"t{i}"))
                params[i].copy_(pinned[slot], non_blocking=True)
                if events[slot] is not None:
                    events[slot].record()
        sync()
        path_s = time.perf_counter() - started
        assert torch.equal(params[-1].cpu(), f_last(path, args.tensors - 1)), "copied bytes differ"
    result = {
        "benchmark": "gpu_datapath", "device": str(device),
        "name": torch.cuda.get_device_name() if on_gpu else "cpu", "bytes": nbytes,
        "h2d_gb_per_s": round(nbytes / h2d_s / 1e9, 2), "path_gb_per_s": round(nbytes / path_s / 1e9, 2),
        "ratio": round(h2d_s / path_s, 3),
        "peak_device_mb": round(torch.cuda.max_memory_allocated() / 1e6, 1) if on_gpu else None,
    }  # fmt: skip
    print(json.dumps(result))
    return result


def f_last(path: Path, index: int):  # type: ignore[no-untyped-def]
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(f"t{index}")


if __name__ == "__main__":
    main()
