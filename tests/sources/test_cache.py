from vllm_reloader.checkpoint.order import Candidate
from vllm_reloader.sources import cache
from vllm_reloader.sources.cache import to_prune


def cands(*items: tuple[str, int | None]) -> dict[str, Candidate]:
    return {name: Candidate(name, step, f"fp-{name}") for name, step in items}


def test_cache_prunes_all_but_protected_and_the_newest_kept():
    candidates = cands(("a", 1), ("b", 2), ("c", 3), ("d", 4), ("e", 5))
    assert to_prune(candidates, protected={"b", "e"}, keep=1) == ["c", "a"]
    assert to_prune(candidates, protected={"b", "e"}, keep=0) == ["d", "c", "a"]
    assert to_prune(candidates, protected=set(), keep=10) == []


def test_cache_prunes_a_checkpoint_whose_name_is_as_long_as_a_name_can_be(tmp_path):
    longest = "z" * 255
    (tmp_path / longest).mkdir()
    (tmp_path / longest / "model.safetensors").write_bytes(b"x")
    assert cache.prune(tmp_path, [longest]) == [longest]
    assert list(tmp_path.iterdir()) == []
