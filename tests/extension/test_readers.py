"""The worker extension's reading path, with torch on the CPU; the real engine loading
through it is in test_e2e.py (the session engine runs with the extension)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch  # the test environment has it (the engine extra): never skipped
from safetensors.torch import save_file

from vllm_reloader.checkpoint.files import INDEX_NAME
from vllm_reloader.extension import readers as worker
from vllm_reloader.extension.readers import BufferPool, LoadStats, TensorRead

MODULES = (
    ["", "model", "model.embed_tokens"] + [f"model.layers.{i}" for i in range(12)] + ["model.norm", "lm_head"]
)


def _tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    tensors = {
        f"model.layers.{i}.mlp.up.weight": torch.randn(16, 3 + i, dtype=torch.bfloat16) for i in range(12)
    }
    tensors |= {
        "lm_head.weight": torch.randn(7, 5),
        "model.embed_tokens.weight": torch.randn(7, 5),
        "model.norm.weight": torch.randn(()),
        "model.layers.0.odd": torch.arange(3, dtype=torch.int8),  # 3 bytes: the next one is unaligned
        "model.layers.0.empty": torch.zeros(0, 4),
    }
    return tensors


def _sharded(directory: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """Two shards named by an index (the first holds the later layers), and a stray one."""
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    directory.mkdir()
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, directory / shard)
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (directory / INDEX_NAME).write_text(json.dumps({"weight_map": weight_map}))
    save_file({"stray.weight": torch.ones(2)}, directory / "consolidated.safetensors")
    return directory


def _load(
    directory: Path, pool: BufferPool, *, chunk: int = 256, threads: int = 3
) -> dict[str, torch.Tensor]:
    reads = worker.layer_order(worker.plan(directory), MODULES)
    return {
        name: t.clone()
        for name, t in worker.read_weights(worker.runs(reads, chunk), pool, threads, LoadStats())
    }


def test_worker_orders_tensors_by_the_modules_that_consume_them():
    def read(name: str) -> TensorRead:
        return TensorRead(name, Path("x"), 0, 4, "F32", (1,))

    names = [
        "lm_head.weight",
        "model.layers.10.w",
        "model.layers.2.w",
        "renamed.w",
        "model.embed_tokens.weight",
    ]
    ordered = [r.name for r in worker.layer_order(map(read, names), MODULES)]
    assert ordered == [
        "model.embed_tokens.weight",
        "model.layers.2.w",
        "model.layers.10.w",  # not alphabetical: the model's own order
        "lm_head.weight",
        "renamed.w",  # no module of that name (the root module does not count): last
    ]


@pytest.mark.parametrize("reader", ["buffered", "mapped"])
def test_worker_reads_every_tensor_bit_exact_across_shards_dtypes_and_runs(tmp_path: Path, reader: str):
    tensors = _tensors()
    directory = _sharded(tmp_path / "ckpt", tensors)
    if reader == "buffered":
        loaded = _load(directory, BufferPool(pin=False, min_bytes=256))
    else:
        reads = worker.layer_order(worker.plan(directory), MODULES)
        loaded = {name: t.clone() for name, t in worker.mapped_weights(reads, LoadStats())}
    assert loaded.keys() == tensors.keys(), "exactly the tensors the index names (no stray shard)"
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


def test_worker_runs_keep_a_big_tensor_alone_and_fill_the_others_up_to_the_chunk():
    reads = [TensorRead(f"t{i}", Path("x"), 0, n, "U8", (n,)) for i, n in enumerate([60, 60, 1000, 10])]
    assert [[r.name for r in run] for run in worker.runs(reads, 128)] == [["t0", "t1"], ["t2"], ["t3"]]


def test_worker_reuses_buffers_only_once_the_model_let_go_of_their_tensors(tmp_path: Path):
    tensors = _tensors()
    directory = _sharded(tmp_path / "ckpt", tensors)
    pool = BufferPool(pin=False, min_bytes=256)
    _load(directory, pool)
    first = pool.allocated
    assert first > 1
    pool.reset_counts()
    _load(directory, pool)
    assert pool.allocated == 0, "a second reload reads into the same buffers"

    # A model that keeps what it was given (vLLM's layerwise loader does, until a layer is
    # complete): no buffer it still sees may be written again.
    reads = worker.runs(worker.layer_order(worker.plan(directory), MODULES), 256)
    held = list(worker.read_weights(reads, pool, 3, LoadStats()))
    assert pool.allocated > 0
    for name, tensor in held:
        assert torch.equal(tensor, tensors[name]), f"{name} was overwritten while still held"


def test_worker_read_fails_with_the_tensor_named_when_a_shard_ends_early(tmp_path: Path):
    directory = _sharded(tmp_path / "ckpt", _tensors())
    reads = worker.layer_order(worker.plan(directory), MODULES)
    shard = directory / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-8])
    with pytest.raises(OSError, match=r"model-00001-of-00002.safetensors: ends inside tensor "):
        list(
            worker.read_weights(worker.runs(reads, 256), BufferPool(pin=False, min_bytes=256), 2, LoadStats())
        )


def test_worker_plan_refuses_a_short_shard_before_the_model_is_touched(tmp_path: Path):
    directory = _sharded(tmp_path / "ckpt", _tensors())
    shard = directory / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-8])
    with pytest.raises(
        ValueError, match=r"model-00002-of-00002.safetensors: ends inside tensor .*nothing was loaded"
    ):
        worker.plan(directory)


def test_worker_plan_refuses_a_tensor_whose_bytes_do_not_fit_its_shape(tmp_path: Path):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    save_file({"a.weight": torch.ones(4, 4)}, directory / "model.safetensors")
    raw = (directory / "model.safetensors").read_bytes()
    (directory / "model.safetensors").write_bytes(raw.replace(b'"shape":[4,4]', b'"shape":[4,2]'))
    with pytest.raises(ValueError, match=r"tensor a.weight has 64 bytes for its shape \[4, 2\]"):
        worker.plan(directory)
