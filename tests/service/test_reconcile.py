"""What an engine holds, told from its reported version and the root."""

from pathlib import Path

from tests.support.checkpoints import write_manifest, write_weights
from vllm_reloader.checkpoint import order
from vllm_reloader.service import reconcile
from vllm_reloader.service.state import Loaded


def _converted(root: Path) -> dict[str, order.Candidate]:
    """A trainer's DCP `step-2/` and its converter's output `step-2@<fp>/`, version step-2."""
    source_fp, output_fp = "c" * 64, "d" * 64
    (root / "step-2").mkdir(parents=True)
    (root / "step-2" / ".metadata").write_bytes(b"m")
    placed = order.placed_name("step-2", source_fp)
    write_weights(root / placed)
    write_manifest(root / placed, step=2, overrides={"version": "step-2"})
    return {
        "step-2": order.Candidate("step-2", None, source_fp),
        placed: order.Candidate(placed, 2, output_fp),
    }


def test_reconcile_a_follower_serving_a_converted_version_knows_its_content(tmp_path):
    """The trainer's directory beside the output has the same version and other content: it
    never loads, so a follower's record of the output is not made unknown (a reload on every
    restart) by it."""
    candidates = _converted(tmp_path)
    placed = next(n for n in candidates if "@" in n)
    known = Loaded(
        name=placed, version="step-2", path=str(tmp_path / placed), since=1.0, fingerprint="d" * 64
    )
    found = reconcile.serving("step-2", "", known=known, root=tmp_path, candidates=candidates, trusted=False)
    assert found.fingerprint == "d" * 64


def test_reconcile_without_a_record_maps_a_converted_version_to_the_output_not_the_trainers(tmp_path):
    candidates = _converted(tmp_path)
    reordered = dict(reversed(list(candidates.items())))  # whichever the root lists first
    for listed in (candidates, reordered):
        found = reconcile.serving("step-2", "", known=None, root=tmp_path, candidates=listed)
        assert found.name == order.placed_name("step-2", "c" * 64)


def test_reconcile_a_record_from_before_trainer_steps_takes_its_candidates_step_so_nothing_older_is_newer(
    tmp_path,
):
    """An upgrade: the record names checkpoint-500 with no step; the root's candidates now carry
    their trainer's steps. Without its step, checkpoint-100 would sort above what serves, and
    the same bytes of checkpoint-500 would be reloaded."""
    from vllm_reloader.service.served import serving_of

    candidates = {
        "checkpoint-500": order.Candidate("checkpoint-500", 500, "f" * 64),
        "checkpoint-100": order.Candidate("checkpoint-100", 100, "e" * 64),
    }
    known = Loaded(
        name="checkpoint-500", version="checkpoint-500", path=str(tmp_path / "checkpoint-500"), since=1.0,
        fingerprint="f" * 64,
    )  # fmt: skip
    found = reconcile.serving("checkpoint-500", "", known=known, root=tmp_path, candidates=candidates)
    assert found.step == 500
    newer = order.to_try(candidates, serving=serving_of(found), rejected={})
    assert newer == [], "neither an older checkpoint nor the same bytes"
    other = known.model_copy(update={"fingerprint": "a" * 64})  # rewritten since: its name's step
    kept = reconcile.serving("checkpoint-500", "", known=other, root=tmp_path, candidates=candidates)
    assert kept.step == 500
    final = known.model_copy(update={"name": "final", "version": "final"})  # no step anywhere
    assert reconcile.serving("final", "", known=final, root=tmp_path, candidates=candidates).step is None
