"""A two-rank torch DCP save, as TorchTitan's `last_save_in_hf` does it:
`python -m tests.support.dcp_run SOURCE OUTPUT_DIR` starts two gloo ranks on the CPU, each
holding SOURCE's weights, and saves them with `HuggingFaceStorageWriter(save_distributed=True,
enable_consolidation=True)`: each rank writes its part under `OUTPUT_DIR/sharded/`, then the
coordinator consolidates them into `OUTPUT_DIR/model-0000i-of-00002.safetensors` and writes
`model.safetensors.index.json` last (not atomically). With a third argument `plain`, they save
with DCP's own `FileSystemWriter` instead: `__<rank>_0.distcp` files, then `.metadata` renamed
in last — a format vLLM cannot read, for `[source] converter`."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path


def _rank(rank: int, source: str, output: str, rendezvous: str, plain: bool) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    try:
        state: dict = {}
        for shard in sorted(Path(source).glob("*.safetensors")):
            state.update(load_file(shard))
        if plain:
            dcp.save(state, checkpoint_id=output)
            return
        names = sorted(state)
        mapping = {name: 1 + i * 2 // len(names) for i, name in enumerate(names)}  # two files
        writer = HuggingFaceStorageWriter(
            output, fqn_to_index_mapping=mapping, save_distributed=True, enable_consolidation=True
        )
        dcp.save(state, storage_writer=writer)
    finally:
        dist.destroy_process_group()


def main(source: str, output: str, mode: str = "hf") -> None:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as scratch:
        rendezvous = str(Path(scratch) / "rendezvous")
        mp.spawn(_rank, args=(source, output, rendezvous, mode == "plain"), nprocs=2, join=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
