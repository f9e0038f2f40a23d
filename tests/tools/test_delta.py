"""Publishing a delta version and materializing it again: the full version it produces is the
trainer's, byte for byte; unchanged shards are the base's own files; a delta that cannot be
(other shards, a long chain, not smaller) is published whole, saying why."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tests.support.checkpoints import write_weights
from vllm_reloader.checkpoint import gate
from vllm_reloader.checkpoint.delta import DeltaUnusable, write_container
from vllm_reloader.checkpoint.manifest import DELTA_NAME, MANIFEST_NAME, Manifest, base_fingerprint, parse
from vllm_reloader.checkpoint.materialize import materialize
from vllm_reloader.errors import PublishError
from vllm_reloader.tools import delta as delta_tool
from vllm_reloader.tools.delta import publish_delta
from vllm_reloader.tools.publish import publish

SHAPES = {"a.weight": (64, 64), "b.weight": (64, 64), "c.weight": (32, 64)}


def trained(src: Path, into: Path, changes: dict[str, int], seed: int = 0) -> Path:
    """`src`'s weights with `changes[name]` elements of each named tensor moved: a step."""
    into.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for shard in src.glob("*.safetensors"):
        tensors = load_file(str(shard))
        for name, count in changes.items():
            if name in tensors:
                flat = tensors[name].reshape(-1).copy()
                flat[rng.choice(flat.size, count, replace=False)] += 1.0
                tensors[name] = flat.reshape(tensors[name].shape)
        save_file(tensors, str(into / shard.name))
    (into / "config.json").write_bytes((src / "config.json").read_bytes())
    return into


@pytest.fixture
def base(tmp_path: Path) -> tuple[Path, Path]:
    """A root with a full version `step-1` (two shards), and the trainer's weights of it."""
    weights = tmp_path / "w1"
    write_weights(weights, SHAPES, shards=2)
    return publish(weights, tmp_path / "root", step=1), weights


def test_delta_publish_then_materialize_gives_the_trainers_bytes(tmp_path: Path, base):
    first, weights = base
    second = trained(weights, tmp_path / "w2", {"a.weight": 5})
    published = publish_delta(second, first.parent, delta_from="step-1", step=2)
    assert published.delta, published.why_full
    version = published.path
    manifest = parse((version / MANIFEST_NAME).read_bytes())
    assert manifest.delta is not None and manifest.delta.depth == 1
    assert [t.name for t in manifest.delta.tensors] == ["a.weight"]
    assert manifest.delta.tensors[0].encoding == "sparse"
    shards = sorted(p.name for p in second.glob("*.safetensors"))
    assert sorted(p.relative_to(version).as_posix() for p in version.rglob("*") if p.is_file()) == [
        "config.json",
        DELTA_NAME,
        MANIFEST_NAME,
    ]
    assert (version / DELTA_NAME).stat().st_size < 400, "a few bytes per change and the header"

    out = tmp_path / "materialized"
    materialize(first, version, manifest, out)
    for shard in shards:
        assert (out / shard).read_bytes() == (second / shard).read_bytes()
    unchanged = next(s for s in shards if "a.weight" not in load_file(str(second / s)))
    assert (out / unchanged).stat().st_ino == (first / unchanged).stat().st_ino, "the base's own file"
    assert base_fingerprint((out / MANIFEST_NAME).read_bytes()) == base_fingerprint(
        (version / MANIFEST_NAME).read_bytes()
    )
    assert gate.check(out, serving=None).status == "ready", "an ordinary full version"


def test_delta_version_the_daemon_cannot_load_yet_is_rejected_in_one_line(tmp_path: Path, base):
    first, weights = base
    second = trained(weights, tmp_path / "w2", {"a.weight": 5})
    version = publish_delta(second, first.parent, delta_from="step-1", step=2).path
    verdict = gate.check(version, serving=None)
    assert verdict.status == "rejected" and verdict.details["check"] == "manifest"
    assert "delta" in verdict.reason and "\n" not in verdict.reason


def test_delta_with_one_value_changed_after_its_digests_names_the_tensor(tmp_path: Path, base):
    first, weights = base
    second = trained(weights, tmp_path / "w2", {"a.weight": 5, "c.weight": 3})
    version = publish_delta(second, first.parent, delta_from="step-1", step=2).path
    manifest = parse((version / MANIFEST_NAME).read_bytes())
    data = bytearray((version / DELTA_NAME).read_bytes())
    data[-1] ^= 0x01  # the last value of the last tensor's entries
    (version / DELTA_NAME).write_bytes(bytes(data))
    with pytest.raises(
        DeltaUnusable, match=r"tensor 'c.weight' in .*: what the delta produces does not match"
    ):
        materialize(first, version, manifest, tmp_path / "out")
    assert (first / MANIFEST_NAME).exists() and all(
        (first / s).read_bytes() == (weights / s).read_bytes() for s in ("model-00001-of-00002.safetensors",)
    ), "the base is never written to"


def test_delta_on_another_base_than_it_names_is_refused(tmp_path: Path, base):
    first, weights = base
    other = publish(trained(weights, tmp_path / "wx", {"b.weight": 4000}), first.parent, name="other")
    version = publish_delta(
        trained(weights, tmp_path / "w2", {"a.weight": 2}), first.parent, delta_from="step-1", step=2
    ).path
    with pytest.raises(DeltaUnusable, match="its base is"):
        materialize(other, version, parse((version / MANIFEST_NAME).read_bytes()), tmp_path / "out")


def test_delta_of_a_delta_materializes_through_its_chain_and_stops_at_the_bound(
    tmp_path: Path, base, monkeypatch: pytest.MonkeyPatch
):
    first, weights = base
    root = first.parent
    monkeypatch.setattr(delta_tool, "MAX_CHAIN", 2)
    second = trained(weights, tmp_path / "w2", {"a.weight": 3}, seed=1)
    third = trained(second, tmp_path / "w3", {"b.weight": 3}, seed=2)
    fourth = trained(third, tmp_path / "w4", {"c.weight": 3}, seed=3)
    assert publish_delta(second, root, delta_from="step-1", step=2).delta
    made = publish_delta(third, root, delta_from="step-2", step=3)
    assert made.delta and parse((made.path / MANIFEST_NAME).read_bytes()).delta.depth == 2  # type: ignore[union-attr]
    assert not [p for p in root.iterdir() if p.name.startswith(".delta-base-")], "scratch removed"
    again = publish_delta(third, root, delta_from="step-2", name="step-3b", base_weights=second)
    assert (again.path / DELTA_NAME).read_bytes() == (made.path / DELTA_NAME).read_bytes()
    whole = publish_delta(fourth, root, delta_from="step-3", step=4)
    assert not whole.delta and "chain of 2" in whole.why_full
    assert (whole.path / "model-00001-of-00002.safetensors").read_bytes() == (
        fourth / "model-00001-of-00002.safetensors"
    ).read_bytes()


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ("everything", "a delta is no smaller"),
        ("shape", "differs in name, dtype, shape or place"),
    ],
)
def test_delta_that_cannot_be_or_is_not_smaller_is_published_whole(tmp_path: Path, base, change, why):
    first, weights = base
    if change == "everything":
        new = trained(
            weights, tmp_path / "w2", {name: 64 * 64 if name != "c.weight" else 32 * 64 for name in SHAPES}
        )
    else:
        new = tmp_path / "w2"
        write_weights(new, {**SHAPES, "a.weight": (64, 32)}, shards=2)
    published = publish_delta(new, first.parent, delta_from="step-1", step=2)
    assert not published.delta and why in published.why_full
    assert json.loads((published.path / MANIFEST_NAME).read_bytes()).get("delta") is None


def test_delta_manifest_naming_a_path_outside_writes_nothing_there(tmp_path: Path, base):
    first, weights = base
    second = trained(weights, tmp_path / "w2", {"a.weight": 2})
    version = publish_delta(second, first.parent, delta_from="step-1", step=2).path
    manifest = parse((version / MANIFEST_NAME).read_bytes())
    hostile = manifest.model_copy(
        update={
            "files": (*manifest.files, manifest.files[0].model_copy(update={"path": "../../escaped.json"}))
        }
    )
    with pytest.raises(DeltaUnusable, match="leaves the checkpoint directory"):
        materialize(first, version, hostile, tmp_path / "deep" / "out")
    assert not (tmp_path / "escaped.json").exists() and not (tmp_path / "deep").exists()


def test_delta_base_shard_that_is_a_link_is_never_linked_to(tmp_path: Path, base):
    first, weights = base
    second = trained(weights, tmp_path / "w2", {"a.weight": 2})
    version = publish_delta(second, first.parent, delta_from="step-1", step=2).path
    manifest = parse((version / MANIFEST_NAME).read_bytes())
    shard = next(
        e.path
        for e in manifest.files
        if e.path.endswith(".safetensors")
        and e.path
        not in {
            t.shard
            for t in manifest.delta.tensors  # type: ignore[union-attr]
        }
    )
    moved = tmp_path / "elsewhere.safetensors"
    (first / shard).rename(moved)
    (first / shard).symlink_to(moved)
    with pytest.raises(DeltaUnusable, match="not a regular file"):
        materialize(first, version, manifest, tmp_path / "out")
    assert not (tmp_path / "out").exists(), "nothing partial is left"


def one_delta(tmp_path: Path, base: tuple[Path, Path]) -> tuple[Path, Path, Manifest]:
    """The base version, a delta of it (one tensor, two elements) and the delta's manifest."""
    first, weights = base
    second = trained(weights, tmp_path / "w2", {"a.weight": 2})
    published = publish_delta(second, first.parent, delta_from="step-1", step=2)
    assert published.delta, published.why_full
    return first, published.path, parse((published.path / MANIFEST_NAME).read_bytes())


def test_delta_of_weights_whose_header_metadata_changed_is_published_whole(tmp_path: Path, base):
    first, weights = base
    for step in (1, 2):  # the same tensors, a header of the same length, other metadata
        (tmp_path / f"m{step}").mkdir()
        for shard in weights.glob("*.safetensors"):
            save_file(
                load_file(str(shard)), str(tmp_path / f"m{step}" / shard.name), metadata={"step": str(step)}
            )
        (tmp_path / f"m{step}" / "config.json").write_bytes((weights / "config.json").read_bytes())
    publish(tmp_path / "m1", first.parent, name="m-1")
    published = publish_delta(tmp_path / "m2", first.parent, delta_from="m-1", name="m-2")
    assert not published.delta and "header (metadata)" in published.why_full


def test_delta_file_other_than_its_manifest_lists_is_refused_and_nothing_is_left(tmp_path: Path, base):
    first, version, manifest = one_delta(tmp_path, base)
    (version / "config.json").write_text('{"architectures": ["Other"]}')
    with pytest.raises(DeltaUnusable, match=r"config\.json"):
        materialize(first, version, manifest, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_delta_container_declaring_an_entry_larger_than_its_tensor_is_refused_before_reading(
    tmp_path: Path, base
):
    first, version, manifest = one_delta(tmp_path, base)
    container = version / DELTA_NAME
    container.unlink()
    write_container(
        container,
        {"0.gaps": ("U8", b"\1" * (1 << 20)), "0.far": ("U32", b""), "0.values": ("U32", b"\0" * 8)},
    )
    entry = manifest.delta.file.model_copy(update={"size": container.stat().st_size})  # type: ignore[union-attr]
    hostile = manifest.model_copy(update={"delta": manifest.delta.model_copy(update={"file": entry})})  # type: ignore[union-attr]
    with pytest.raises(DeltaUnusable, match="more than"):
        materialize(first, version, hostile, tmp_path / "out")


def test_delta_folder_that_is_a_link_is_never_read_through(tmp_path: Path, base):
    first, version, manifest = one_delta(tmp_path, base)
    (version / "delta").rename(tmp_path / "outside")
    (version / "delta").symlink_to(tmp_path / "outside")
    with pytest.raises(DeltaUnusable, match="a link is never followed"):
        materialize(first, version, manifest, tmp_path / "out")


def test_delta_publish_refuses_a_name_taken_and_a_delta_folder_in_its_source(tmp_path: Path, base):
    first, weights = base
    second = trained(weights, tmp_path / "w2", {"a.weight": 2})
    (first.parent / "step-2").mkdir()
    with pytest.raises(PublishError, match="already exists"):
        publish_delta(second, first.parent, delta_from="step-1", step=2)
    (second / "delta").mkdir()
    (second / "delta" / "x.json").write_text("{}")
    with pytest.raises(PublishError, match="delta/ folder"):
        publish_delta(second, first.parent, delta_from="step-1", step=3)
