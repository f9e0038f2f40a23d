from pathlib import Path

import pytest

from tests.support.checkpoints import write_weights
from tests.support.hub_cache import COMMIT, cache_model
from vllm_reloader.sources.hub import cache_dir, is_model_id, snapshot


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"HF_HUB_CACHE": "/c/hub", "HF_HOME": "/h", "XDG_CACHE_HOME": "/x", "HOME": "/home/u"}, "/c/hub"),
        ({"HF_HOME": "/h", "XDG_CACHE_HOME": "/x", "HOME": "/home/u"}, "/h/hub"),
        ({"XDG_CACHE_HOME": "/x", "HOME": "/home/u"}, "/x/huggingface/hub"),
        ({"HOME": "/home/u"}, "/home/u/.cache/huggingface/hub"),
    ],
)
def test_cache_dir_follows_huggingface_hubs_order(environ, expected):
    assert cache_dir(environ) == Path(expected)


def test_is_model_id_takes_org_name_and_not_a_directory(tmp_path):
    assert is_model_id("Qwen/Qwen3-8B") and is_model_id("gpt2")
    assert not is_model_id(str(tmp_path)), "an existing directory is a path"
    assert not is_model_id("/models/Qwen3-8B") and not is_model_id("a/b/c")


def test_snapshot_follows_refs_main_to_the_commits_directory(tmp_path):
    cache = tmp_path / "hub"
    made = cache_model(cache, "org/tiny", write_weights(tmp_path / "src")[0].parent)
    assert snapshot("org/tiny", None, {"HF_HUB_CACHE": str(cache)}) == made
    assert (made / "model.safetensors").is_symlink(), "files are links into blobs/, as the hub lays them out"


def test_snapshot_takes_a_named_revision_or_a_commit(tmp_path):
    cache = tmp_path / "hub"
    other = "f" * 40
    source = write_weights(tmp_path / "src")[0].parent
    cache_model(cache, "org/tiny", source, commit=COMMIT)
    tagged = cache_model(cache, "org/tiny", source, commit=other, ref="v2")
    environ = {"HF_HOME": str(tmp_path)}
    assert snapshot("org/tiny", "v2", environ) == tagged
    assert snapshot("org/tiny", other, environ) == tagged
    assert snapshot("org/tiny", "main", environ) == cache / "models--org--tiny" / "snapshots" / COMMIT


def test_snapshot_is_none_when_the_cache_lacks_the_model_or_the_ref_is_odd(tmp_path):
    cache = tmp_path / "hub"
    environ = {"HF_HUB_CACHE": str(cache)}
    assert snapshot("org/absent", None, environ) is None
    cache_model(cache, "org/tiny", write_weights(tmp_path / "src")[0].parent, ref=None)
    assert snapshot("org/tiny", None, environ) is None, "no refs/main"
    (cache / "models--org--tiny" / "refs").mkdir()
    (cache / "models--org--tiny" / "refs" / "main").write_text("../../../etc\n")
    assert snapshot("org/tiny", None, environ) is None, "a ref that is not a commit hash"
    assert snapshot("../evil", None, environ) is None
    assert snapshot("org/tiny", "b" * 40, environ) is None, "a commit not in snapshots/"
