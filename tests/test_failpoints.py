import pytest

from vllm_reloader import failpoints


def test_failpoint_fails_the_named_rank_once(tmp_path, monkeypatch):
    monkeypatch.setattr(failpoints, "_HOLD_DIR", str(tmp_path))
    (tmp_path / "load_start.rank1.fail").touch()
    failpoints.hit("load_start", rank=0)  # another rank: nothing
    with pytest.raises(failpoints.FailpointError, match="load_start on rank 1"):
        failpoints.hit("load_start", rank=1)
    failpoints.hit("load_start", rank=1)  # taken: the restore after it loads
    assert not list(tmp_path.iterdir())
