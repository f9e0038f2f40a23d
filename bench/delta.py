"""How much of a bf16 model one optimizer step changes, and what a delta version weighs.

A stack of linear layers (about `--params-m` million parameters) is trained on the CPU with
AdamW on fp32 master weights, as trainers do; after each step its bf16 weights are saved and
published into a local root: the first whole, the next ones as deltas of the one before
(`tools.delta.publish_delta`), then materialized again. Printed per step: the fraction of
elements that changed (measured, not assumed), delta bytes ÷ full bytes, and the times of a
full publish, a delta publish and a materialize, measured in the same run. Not a timed test.

    .venv/bin/python bench/delta.py [--params-m 500] [--steps 3] [--lr 1e-6]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-m", type=int, default=500, help="millions of parameters (bf16: 2 MB each)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--shards", type=int, default=4)
    args = parser.parse_args(argv)

    import torch
    from safetensors.torch import save_file

    from vllm_reloader.checkpoint.manifest import MANIFEST_NAME, parse
    from vllm_reloader.checkpoint.materialize import materialize
    from vllm_reloader.tools.delta import publish_delta
    from vllm_reloader.tools.publish import publish

    torch.manual_seed(0)
    layers = max(1, args.params_m * 1_000_000 // (args.width * args.width))
    model = torch.nn.ModuleList(torch.nn.Linear(args.width, args.width, bias=False) for _ in range(layers))

    def forward(x: torch.Tensor) -> torch.Tensor:  # residual: every layer gets a gradient
        for layer in model:
            x = x + torch.tanh(layer(x))
        return x

    for layer in model:
        torch.nn.init.normal_(layer.weight, std=0.02)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    work = Path(tempfile.mkdtemp(prefix="delta-bench-"))
    root = work / "root"

    def save(step: int) -> Path:
        out = work / f"w{step}"
        out.mkdir()
        names = [f"layers.{i}.weight" for i in range(layers)]
        per = -(-layers // args.shards)
        for part in range(args.shards):
            chunk = names[part * per : (part + 1) * per]
            if chunk:
                tensors = {n: model[int(n.split(".")[1])].weight.detach().to(torch.bfloat16) for n in chunk}
                save_file(tensors, str(out / f"model-{part + 1:05d}-of-{args.shards:05d}.safetensors"))
        (out / "config.json").write_text(json.dumps({"architectures": ["Bench"], "layers": layers}))
        return out

    def bf16_words(directory: Path) -> torch.Tensor:
        from safetensors.torch import load_file

        found = []
        for shard in sorted(directory.glob("*.safetensors")):
            found += [t.view(torch.int16).reshape(-1) for t in load_file(str(shard)).values()]
        return torch.cat(found)

    results: list[dict[str, object]] = []
    try:
        previous = save(0)
        started = time.perf_counter()
        publish(previous, root, step=0)
        full_seconds = time.perf_counter() - started
        full_bytes = sum(p.stat().st_size for p in previous.glob("*.safetensors"))
        print(f"{layers} layers of {args.width}x{args.width}: {full_bytes / 1e9:.2f} GB bf16; "
              f"full publish {full_seconds:.2f} s")  # fmt: skip
        batch, target = torch.randn(8, args.width), torch.randn(8, args.width)
        base = root / "step-0"
        for step in range(1, args.steps + 1):
            optimizer.zero_grad()
            loss = (forward(batch) - target).pow(2).mean()
            loss.backward()
            optimizer.step()
            current = save(step)
            changed = (bf16_words(previous) != bf16_words(current)).float().mean().item()
            started = time.perf_counter()
            published = publish_delta(
                current, root, delta_from=f"step-{step - 1}", step=step, base_weights=previous
            )
            delta_seconds = time.perf_counter() - started
            moved = sum(p.stat().st_size for p in published.path.rglob("*") if p.is_file())
            started = time.perf_counter()
            manifest = parse((published.path / MANIFEST_NAME).read_bytes())
            full = published.path
            if manifest.delta is not None:
                full = work / f"m{step}"
                materialize(base, published.path, manifest, full)
            materialize_seconds = time.perf_counter() - started
            for shard in current.glob("*.safetensors"):  # what it produced is the trainer's, exactly
                assert (full / shard.name).read_bytes() == shard.read_bytes(), shard.name
            base = full
            row = {
                "step": step,
                "changed_fraction": round(changed, 5),
                "delta": published.delta,
                "why_full": published.why_full,
                "delta_bytes": moved,
                "full_bytes": full_bytes,
                "ratio": round(moved / full_bytes, 4),
                "full_publish_s": round(full_seconds, 2),
                "delta_publish_s": round(delta_seconds, 2),
                "materialize_s": round(materialize_seconds, 2),
            }
            print(json.dumps(row))
            results.append(row)
            shutil.rmtree(previous)
            previous = current
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return results


if __name__ == "__main__":
    main()
