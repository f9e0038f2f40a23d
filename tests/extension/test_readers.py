"""The worker extension's reading path, with torch on the CPU; the real engine loading
through it is in test_e2e.py (the session engine runs with the extension)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch  # the test environment has it (the engine extra): never skipped
from safetensors.torch import save_file

from tests.support.hub_cache import cache_model
from vllm_reloader.checkpoint.files import INDEX_NAME, Identity, identity
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


def _plan(directory: Path, files: dict[str, Identity] | None = None) -> list[TensorRead]:
    """Opens the shards (kept open until the test ends, as the extension keeps them for a load)."""
    checkpoint = worker.Checkpoint(directory)
    OPEN.append(checkpoint)
    return worker.layer_order(worker.plan(checkpoint, files), MODULES)


OPEN: list[worker.Checkpoint] = []


@pytest.fixture(autouse=True)
def _close_checkpoints() -> Iterator[None]:
    yield
    while OPEN:
        OPEN.pop().close()


def _load(
    directory: Path, pool: BufferPool, *, chunk: int = 256, threads: int = 3
) -> dict[str, torch.Tensor]:
    reads = _plan(directory)
    return {
        name: t.clone()
        for name, t in worker.read_weights(worker.runs(reads, chunk), pool, threads, LoadStats(), OPEN[-1])
    }


def _identities(directory: Path) -> dict[str, Identity]:
    return {p.name: identity(p.lstat()) for p in directory.iterdir() if p.name != "consolidated.safetensors"}


def _verified(tmp_path: Path) -> tuple[dict[str, torch.Tensor], Path, dict[str, Identity]]:
    """A checkpoint as the gate passes it (no stray shard), with its files' identities."""
    tensors = _tensors()
    directory = _sharded(tmp_path / "ckpt", tensors)
    (directory / "consolidated.safetensors").unlink()
    return tensors, directory, _identities(directory)


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


def test_worker_reads_every_tensor_bit_exact_across_shards_dtypes_and_runs(tmp_path: Path):
    tensors = _tensors()
    directory = _sharded(tmp_path / "ckpt", tensors)
    loaded = _load(directory, BufferPool(pin=False, min_bytes=256))
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
    reads = worker.runs(_plan(directory), 256)
    held = list(worker.read_weights(reads, pool, 3, LoadStats()))
    assert pool.allocated > 0
    for name, tensor in held:
        assert torch.equal(tensor, tensors[name]), f"{name} was overwritten while still held"


def test_worker_read_fails_with_the_tensor_named_when_a_shard_ends_early(tmp_path: Path):
    directory = _sharded(tmp_path / "ckpt", _tensors())
    reads = _plan(directory)
    shard = directory / "model-00001-of-00002.safetensors"
    os.truncate(shard, shard.stat().st_size - 8)  # the open file: a truncation, not a new file
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
        _plan(directory)


def test_worker_plan_refuses_a_tensor_whose_bytes_do_not_fit_its_shape(tmp_path: Path):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    save_file({"a.weight": torch.ones(4, 4)}, directory / "model.safetensors")
    raw = (directory / "model.safetensors").read_bytes()
    (directory / "model.safetensors").write_bytes(raw.replace(b'"shape":[4,4]', b'"shape":[4,2]'))
    with pytest.raises(ValueError, match=r"tensor a.weight has 64 bytes for its shape \[4, 2\]"):
        _plan(directory)


def test_worker_loads_only_the_files_the_gate_verified(tmp_path: Path):
    tensors, directory, verified = _verified(tmp_path)
    assert len(_plan(directory, verified)) == len(tensors)
    shard = directory / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes())  # same bytes, written again: not the verified file
    with pytest.raises(
        ValueError, match=r"model-00001-of-00002.safetensors is not the file the gate verified"
    ):
        _plan(directory, verified)


def test_worker_refuses_a_shard_the_gate_did_not_list(tmp_path: Path):
    directory = _sharded(tmp_path / "ckpt", _tensors())  # holds a stray shard besides the index's
    with pytest.raises(ValueError, match="are not the verified"):
        _plan(directory, _identities(directory))


def test_worker_refuses_an_index_that_points_outside_the_checkpoint(tmp_path: Path):
    directory = _sharded(tmp_path / "ckpt", _tensors())
    (directory / INDEX_NAME).write_text(json.dumps({"weight_map": {"a.weight": "/etc/x.safetensors"}}))
    with pytest.raises(ValueError, match=r"not a top-level \.safetensors file"):
        _plan(directory)


def test_worker_load_fails_when_a_shard_is_rewritten_while_it_is_read(tmp_path: Path):
    _, directory, verified = _verified(tmp_path)
    reads = _plan(directory, verified)
    shard = directory / "model-00002-of-00002.safetensors"
    with shard.open("r+b") as f:  # in place, same size: the trainer's save over a fixed path
        f.seek(-4, os.SEEK_END)
        f.write(b"\x01\x02\x03\x04")
    with pytest.raises(ValueError, match="changed while it was read"):
        list(
            worker.read_weights(
                worker.runs(reads, 256), BufferPool(pin=False, min_bytes=256), 2, LoadStats(), OPEN[-1]
            )
        )


def test_worker_load_fails_when_a_shard_is_replaced_by_rename_while_it_is_read(tmp_path: Path):
    """The open file keeps its bytes, but its identity moves (its last link went: ctime), and
    the extension cannot tell that from a write: the load fails, the daemon restores."""
    tensors, directory, verified = _verified(tmp_path)
    reads = _plan(directory, verified)
    other = tmp_path / "other.safetensors"
    save_file({k: torch.zeros_like(v) for k, v in tensors.items()}, other)
    os.rename(other, directory / "model-00001-of-00002.safetensors")
    pool = BufferPool(pin=False, min_bytes=256)
    with pytest.raises(ValueError, match="changed while it was read"):
        list(worker.read_weights(worker.runs(reads, 256), pool, 2, LoadStats(), OPEN[-1]))


def test_worker_reports_how_long_the_model_took_with_what_it_was_handed(tmp_path: Path):
    """The load's split: reading (threads), waiting for bytes, and vLLM's own work."""
    _, directory, verified = _verified(tmp_path)
    reads = _plan(directory, verified)
    stats = LoadStats()
    for _name, _tensor in worker.read_weights(
        worker.runs(reads, 256), BufferPool(pin=False, min_bytes=256), 2, stats, OPEN[-1]
    ):
        time.sleep(0.002)  # the model copying it into its parameter
    assert stats.model_s >= 0.002 * stats.tensors and stats.read_s > 0


def test_worker_reads_the_engines_own_hub_snapshot_through_its_blob_links(tmp_path: Path):
    """The startup model (a rollback's last target) may be a Hugging Face cache snapshot."""
    tensors, directory, _ = _verified(tmp_path)
    snapshot = cache_model(tmp_path / "hub", "org/tiny", directory)
    assert (snapshot / INDEX_NAME).is_symlink()
    assert len(_plan(snapshot)) == len(tensors)


def test_worker_never_follows_a_link_in_a_verified_checkpoint(tmp_path: Path):
    _, directory, verified = _verified(tmp_path)
    shard = directory / "model-00001-of-00002.safetensors"
    shard.rename(tmp_path / "elsewhere.safetensors")
    shard.symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(OSError, match="Too many levels of symbolic links"):
        _plan(directory, verified)
