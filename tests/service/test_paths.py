"""The directories a config names are checked before the daemon starts, never created: each
problem is a `ConfigError` (exit 2), one line naming the key, the path and what to do."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vllm_reloader import config
from vllm_reloader.errors import ConfigError
from vllm_reloader.service import paths


def local(tmp_path: Path, **state: object) -> config.Config:
    for made in ("root", "state"):
        (tmp_path / made).mkdir(exist_ok=True)
    return config.Config(
        source=config.SourceConfig(path=str(tmp_path / "root")),
        engine=config.EngineConfig(url="http://engine.test"),
        state=config.StateConfig(dir=tmp_path / "state", **state),  # type: ignore[arg-type]
    )


def remote(tmp_path: Path, **state: object) -> config.Config:
    cfg = local(tmp_path, **state)
    return cfg.model_copy(update={"source": config.SourceConfig(path="s3://bucket/runs")})


def refused(cfg: config.Config) -> str:
    with pytest.raises(ConfigError) as error:
        paths.check(cfg)
    assert "\n" not in str(error.value)
    return str(error.value)


def test_paths_of_an_operators_directories_pass_and_nothing_is_made(tmp_path):
    paths.check(local(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root", "state"]
    assert list((tmp_path / "state").iterdir()) == []


def test_paths_source_path_naming_a_file_is_refused(tmp_path):
    cfg = local(tmp_path)
    (tmp_path / "root").rmdir()
    (tmp_path / "root").write_text("not a directory")
    assert refused(cfg) == f"source.path {tmp_path / 'root'}: exists and is not a directory"


def deny(monkeypatch: pytest.MonkeyPatch, path: Path, bit: int) -> None:
    """`os.access` says no to `bit` on `path`, as for the daemon's user (the tests may run as
    root, who may read and write anything)."""
    real = os.access

    def access(where: object, mode: int, **kw: bool) -> bool:
        return not (Path(str(where)) == path and mode & bit) and real(where, mode, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "access", access)


def test_paths_a_state_dir_the_daemon_cannot_write_is_refused(tmp_path, monkeypatch):
    cfg = local(tmp_path)
    deny(monkeypatch, tmp_path / "state", os.W_OK)
    assert refused(cfg).startswith(f"state.dir {tmp_path / 'state'}: not writable by this user (uid ")


def test_paths_a_source_the_daemon_cannot_read_is_refused_a_read_only_one_is_fine(tmp_path, monkeypatch):
    """The shipped unit mounts the root read-only (`ReadOnlyPaths=`): reading is all it needs."""
    cfg = local(tmp_path)
    deny(monkeypatch, tmp_path / "root", os.W_OK)
    paths.check(cfg)
    deny(monkeypatch, tmp_path / "root", os.R_OK)
    assert refused(cfg).startswith(f"source.path {tmp_path / 'root'}: not readable by this user (uid ")


def test_paths_a_control_socket_in_a_missing_directory_is_refused(tmp_path):
    socket = tmp_path / "run" / "control.sock"
    cfg = local(tmp_path).model_copy(update={"control": config.ControlConfig(socket=socket)})
    said = refused(cfg)
    assert said.startswith(f"control.socket {socket}: its directory {socket.parent}: no such directory")
    assert not (tmp_path / "run").exists()


def test_paths_object_store_default_cache_is_made_in_the_state_dir(tmp_path):
    """The cache is the daemon's own layout inside a directory it was given."""
    cfg = remote(tmp_path)
    paths.check(cfg)
    assert cfg.checkpoint_root == tmp_path / "state" / "cache" / "checkpoints"
    assert cfg.checkpoint_root.is_dir()


def test_paths_object_store_cache_dir_set_but_missing_is_refused_and_not_made(tmp_path):
    """An operator who names a cache directory (a big disk) means that one: a typo would fill
    another disk."""
    cfg = remote(tmp_path, cache_dir=tmp_path / "big-disk" / "cache")
    assert refused(cfg).startswith(f"state.cache_dir {tmp_path / 'big-disk' / 'cache'}: no such directory")
    assert not (tmp_path / "big-disk").exists()
    (tmp_path / "big-disk" / "cache").mkdir(parents=True)
    paths.check(cfg)
    assert (tmp_path / "big-disk" / "cache" / "checkpoints").is_dir()


def test_paths_object_store_default_cache_that_is_a_file_is_refused(tmp_path):
    cfg = remote(tmp_path)
    (tmp_path / "state" / "cache").write_text("not a directory")
    assert refused(cfg).startswith(f"state.cache_dir {tmp_path / 'state' / 'cache'}: cannot make ")


def test_paths_a_root_the_daemon_cannot_write_is_refused_when_a_converter_places_output_there(
    tmp_path, monkeypatch
):
    cfg = local(tmp_path)
    source = config.SourceConfig(path=str(tmp_path / "root"), converter=("/bin/true", "{output}"))
    cfg = cfg.model_copy(update={"source": source})
    paths.check(cfg)
    deny(monkeypatch, tmp_path / "root", os.W_OK)
    said = refused(cfg)
    assert said.startswith(f"source.path {tmp_path / 'root'}: not writable by this user (uid ")
    assert "[source] converter places its output there; systemd: ReadWritePaths=" in said


def with_adapters(cfg: config.Config, **adapters: object) -> config.Config:
    return cfg.model_copy(update={"adapters": config.AdaptersConfig(**adapters)})  # type: ignore[arg-type]


def test_paths_a_missing_local_adapter_root_is_refused_and_not_made(tmp_path):
    cfg = with_adapters(local(tmp_path), root=str(tmp_path / "adapters"))
    assert refused(cfg).startswith(f"adapters.root {tmp_path / 'adapters'}: no such directory")
    assert not (tmp_path / "adapters").exists()


def test_paths_an_adapter_store_it_cannot_address_is_refused_naming_adapters_root(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ALLOW_HTTP", "maybe")  # not a boolean: obstore refuses the client
    cfg = with_adapters(local(tmp_path), root="s3://bucket/adapters")
    assert refused(cfg).startswith("adapters.root 's3://bucket/adapters': AWS_ALLOW_HTTP='maybe' is refused")


def test_config_adapters_from_the_sources_store_take_its_endpoint_and_a_slower_look(tmp_path):
    cfg = remote(tmp_path).model_copy(
        update={"source": config.SourceConfig(path="s3://bucket/runs", endpoint_url="http://minio.test:9000")}
    )
    on_s3 = with_adapters(cfg, root="s3://bucket/adapters")
    assert on_s3.adapter_endpoint == "http://minio.test:9000" and on_s3.adapters.look_interval == 10.0
    assert with_adapters(cfg, root="az://container/adapters").adapter_endpoint is None
    assert with_adapters(cfg, root="s3://b/a", endpoint_url="http://other.test").adapter_endpoint == (
        "http://other.test"
    )
    assert with_adapters(local(tmp_path), root=str(tmp_path)).adapters.look_interval == 1.0
    with pytest.raises(ValueError, match="unsupported scheme"):
        config.AdaptersConfig(root="ftp://host/adapters")


def test_paths_adapter_copies_inside_the_adapter_root_are_refused(tmp_path):
    root, copies = tmp_path / "adapters", tmp_path / "adapters" / "copies"
    copies.mkdir(parents=True)
    assert refused(with_adapters(local(tmp_path), root=str(root), copies=copies)).startswith(
        f"adapters.copies {copies}: overlaps adapters.root {root}"
    )
    (tmp_path / "copies").mkdir()
    paths.check(with_adapters(local(tmp_path), root=str(root), copies=tmp_path / "copies"))


@pytest.mark.parametrize(
    ("copies", "cache", "said"),
    [
        ("cache", "cache", "adapters.copies {copies}: overlaps state.cache_dir {cache}"),
        ("cache/adapters", "cache", "adapters.copies {copies}: overlaps state.cache_dir {cache}"),
        ("state", "cache", "state.dir {state}: is adapters.copies {copies}"),
        ("copies", "state", "state.dir {state}: is state.cache_dir {cache}"),
    ],
)
def test_paths_the_daemons_stores_overlapping_each_other_or_the_state_are_refused(
    tmp_path, copies, cache, said
):
    for made in {copies, cache or "x", "root", "adapters"}:
        (tmp_path / made).mkdir(parents=True, exist_ok=True)
    state = {"cache_dir": tmp_path / cache} if cache else {}
    cfg = with_adapters(remote(tmp_path, **state), root=str(tmp_path / "adapters"), copies=tmp_path / copies)
    expected = said.format(copies=tmp_path / copies, cache=tmp_path / (cache or ""), state=tmp_path / "state")
    assert refused(cfg).startswith(expected)


def test_paths_a_state_dir_inside_the_checkpoint_root_is_refused(tmp_path):
    (tmp_path / "root" / "state").mkdir(parents=True)
    cfg = local(tmp_path).model_copy(update={"state": config.StateConfig(dir=tmp_path / "root" / "state")})
    assert refused(cfg).startswith(f"state.dir {tmp_path / 'root' / 'state'}: inside source.path")


def test_paths_adapter_copies_missing_are_refused_for_a_store_root_too(tmp_path):
    cfg = with_adapters(local(tmp_path), root="s3://bucket/adapters", copies=tmp_path / "big-disk")
    assert refused(cfg).startswith(f"adapters.copies {tmp_path / 'big-disk'}: no such directory")


def test_config_adapters_endpoint_url_empty_takes_the_stores_own_variables(tmp_path):
    cfg = remote(tmp_path).model_copy(
        update={"source": config.SourceConfig(path="s3://bucket/runs", endpoint_url="http://minio.test:9000")}
    )
    assert with_adapters(cfg, root="s3://b/a", endpoint_url="").adapter_endpoint is None


def shared(tmp_path: Path, **state: object) -> config.Config:
    cfg = local(tmp_path, **state)
    return cfg.model_copy(update={"source": config.SourceConfig(path=f"file://{tmp_path / 'root'}")})


def test_paths_a_shared_root_must_be_there_and_apart_from_the_cache(tmp_path):
    paths.check(shared(tmp_path))
    assert (tmp_path / "state" / "cache" / "checkpoints").is_dir(), "copied into the cache"
    (tmp_path / "root" / "cache").mkdir()
    cfg = shared(tmp_path, cache_dir=tmp_path / "root" / "cache")
    assert refused(cfg).startswith(f"state.cache_dir {tmp_path / 'root' / 'cache'}: overlaps source.path")
    gone = shared(tmp_path).model_copy(update={"source": config.SourceConfig(path=f"file://{tmp_path}/x")})
    assert refused(gone) == (
        f"source.path {tmp_path / 'x'}: no such directory; create it (the daemon never does), "
        "or correct source.path"
    )
