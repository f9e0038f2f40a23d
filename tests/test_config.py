from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_reloader import config, log
from vllm_reloader.errors import ConfigError

MINIMAL = """
[source]
path = "/srv/checkpoints"
[engine]
url = "http://127.0.0.1:8000/"
[state]
dir = "/var/lib/vllm-reloader"
"""

STORE = MINIMAL.replace('path = "/srv/checkpoints"', 'path = "s3://bucket/runs"')


@pytest.fixture(autouse=True)
def no_secrets_left() -> Iterator[None]:
    """A key parsed here is registered for redaction; no later test's log should lose it."""
    yield
    log.forget_secrets()


def test_config_minimal_file_gets_defaults():
    cfg = config.parse(MINIMAL)
    assert str(cfg.source.path) == "/srv/checkpoints"
    assert cfg.engine.url == "http://127.0.0.1:8000"
    assert cfg.engine.pause_mode == "keep"
    assert cfg.source.rescan_interval == 30.0
    assert cfg.gate.verify_digests is True


def test_config_is_frozen():
    cfg = config.parse(MINIMAL)
    with pytest.raises(ValueError):
        cfg.engine.url = "http://elsewhere"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (MINIMAL + "[gate]\nbogus = 1\n", "gate.bogus: unknown key"),
        (MINIMAL.replace('[state]\ndir = "/var/lib/vllm-reloader"\n', ""), "state: required key is missing"),
        (MINIMAL.replace('path = "/srv/checkpoints"', ""), "source.path: required key is missing"),
        (MINIMAL + '[gate]\ndigest_threads = "four"\n', "gate.digest_threads"),
        (MINIMAL.replace("http://127.0.0.1:8000/", "127.0.0.1:8000"), "engine.url"),
        (MINIMAL + "[engine]\n", "not valid TOML"),
        (MINIMAL.replace('url = "http', 'pause_mode = "drop"\nurl = "http'), "engine.pause_mode"),
        (MINIMAL + '[gate]\nscan = "gpu"\n', "gate.scan"),
        (MINIMAL + '[gate]\nscan = "engine"\n[canary]\nprobe = false\n', "set canary.probe = true"),
        (MINIMAL + '[node]\nrole = "lead"\n', "node.role = lead needs source.path in a store"),
        (MINIMAL.replace('"/srv/checkpoints"', '"file://srv/checkpoints"'), "file:// needs an absolute path"),
        (MINIMAL.replace('"/srv/checkpoints"', '"file:///"'), "file:// needs an absolute path below /"),
        (STORE + '[node]\nrole = "stage"\n', "node.role = stage needs node.leader"),
        (STORE + '[node]\nrole = "lead"\n[rollout]\nrole = "follow"\n', "rollout.role = canary"),
        (STORE + '[node]\nrole = "stage"\nleader = "../x"\n', "node.leader"),
        (STORE + '[node]\nrole = "leader"\n', "node.role"),
        (STORE + '[node]\nrole = "lead"\n[canary]\nenabled = false\n', "set canary.enabled"),
    ],
)
def test_config_error_names_the_key_on_one_line(text, message):
    with pytest.raises(ConfigError) as error:
        config.parse(text, "x.toml")
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_config_shared_root_is_a_store_every_node_copies_from():
    shared = MINIMAL.replace('"/srv/checkpoints"', '"file:///mnt/shared/checkpoints"')
    cfg = config.parse(shared + '[rollout]\nhost = "n1"\n[node]\nrole = "stage"\nleader = "n0"\n')
    assert cfg.source.remote and cfg.node.role == "stage"
    assert config.parse(shared).source.interval == 10.0


def test_config_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        config.load(tmp_path / "absent.toml")


def test_config_example_file_is_valid_and_matches_defaults():
    from pathlib import Path

    example = Path(__file__).parent.parent / "config" / "vllm-reloader.toml"
    parsed = config.load(example)
    required = {"source": {"path"}, "engine": {"url", "urls"}, "state": {"dir"}}
    for section_name, section in parsed:
        default = type(section).model_construct()
        for key in type(section).model_fields:
            if key not in required.get(section_name, set()):
                assert getattr(section, key) == getattr(default, key), f"{section_name}.{key}"
    assert parsed.engine.pause_mode == "keep"


def with_key_file(tmp_path, content: str, mode: int = 0o600) -> str:
    key_file = tmp_path / "engine.key"
    key_file.write_text(content)
    key_file.chmod(mode)
    return MINIMAL.replace("[state]", f'api_key_file = "{key_file}"\n[state]')


def test_config_reads_api_key_from_its_file_before_the_environment(tmp_path):
    cfg = config.parse(with_key_file(tmp_path, "file-key\n"), environ={"VLLM_API_KEY": "env-key-1"})
    assert cfg.engine.api_key is not None
    assert cfg.engine.api_key.get_secret_value() == "file-key"
    assert "file-key" not in repr(cfg) and "file-key" not in str(cfg.model_dump())


def test_config_reads_api_key_from_vllm_api_key_without_a_file():
    cfg = config.parse(MINIMAL, environ={"VLLM_API_KEY": "env-key-1"})
    assert cfg.engine.api_key is not None and cfg.engine.api_key.get_secret_value() == "env-key-1"
    assert config.parse(MINIMAL, environ={}).engine.api_key is None


@pytest.mark.parametrize(
    ("content", "mode", "message"),
    [
        ("k", 0o644, "readable by others (mode 0644); chmod 600 it"),
        ("k", 0o640, "readable by others (mode 0640)"),
        ("\n", 0o600, "is empty"),
        ("two words", 0o600, "must hold one key"),
    ],
)
def test_config_api_key_file_problems_are_one_line_errors(tmp_path, content, mode, message):
    text = with_key_file(tmp_path, content, mode)
    with pytest.raises(ConfigError) as error:
        config.parse(text, "x.toml", environ={})
    assert f"x.toml: engine.api_key_file: {tmp_path / 'engine.key'}: {message}" in str(error.value)
    assert "\n" not in str(error.value)


def test_config_refuses_an_api_key_written_into_the_config_file():
    text = MINIMAL.replace("[state]", 'api_key = "secret"\n[state]')
    with pytest.raises(
        ConfigError, match=r"engine.api_key: .*use engine.api_key_file or VLLM_API_KEY"
    ) as error:
        config.parse(text, environ={})
    assert "secret" not in str(error.value)


def test_config_missing_api_key_file_names_it(tmp_path):
    text = MINIMAL.replace("[state]", f'api_key_file = "{tmp_path / "absent"}"\n[state]')
    with pytest.raises(ConfigError, match=r"engine.api_key_file: .*absent: cannot read: No such file"):
        config.parse(text, environ={})


def test_config_refuses_an_api_key_too_short_to_redact_from_the_log(tmp_path):
    """Every log line has the key's value removed: a one-letter key would take letters out of
    every event name and path."""
    with pytest.raises(ConfigError, match="shorter than 8 characters") as refused:
        config.parse(MINIMAL, environ={"VLLM_API_KEY": "a"})
    assert "'a'" not in str(refused.value)


def test_config_relative_paths_are_relative_to_the_config_files_directory(tmp_path, monkeypatch):
    """Every path-valued key; an absolute one and an object-store URL stay as written."""
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "engine.key").write_text("file-key-1\n")
    (etc / "engine.key").chmod(0o600)
    (etc / "daemon.toml").write_text(
        '[source]\npath = "../checkpoints"\n'
        '[engine]\nurl = "http://e"\napi_key_file = "engine.key"\nbaseline = "models/base"\n'
        '[state]\ndir = "state"\ncache_dir = "/var/cache/r"\n[control]\nsocket = "./run/c.sock"\n'
    )
    monkeypatch.chdir(tmp_path / "etc" / "..")  # not the config's directory
    cfg = config.load(Path("etc/daemon.toml"))
    assert cfg.source.path == str(tmp_path / "checkpoints")
    assert cfg.engine.api_key_file == etc / "engine.key" and cfg.engine.baseline == etc / "models" / "base"
    assert cfg.state.dir == etc / "state" and cfg.state.cache_dir == Path("/var/cache/r")
    assert cfg.control_socket == etc / "run" / "c.sock"
    assert cfg.engine.api_key is not None and cfg.engine.api_key.get_secret_value() == "file-key-1"
    remote = MINIMAL.replace("/srv/checkpoints", "s3://bucket/runs")
    assert config.parse(remote, base=etc).source.path == "s3://bucket/runs"


def test_config_empty_path_is_an_error_not_the_current_directory():
    with pytest.raises(ConfigError, match=r"state\.dir: Value error, must not be empty"):
        config.parse(MINIMAL.replace('"/var/lib/vllm-reloader"', '""'))


@pytest.mark.parametrize("key", ["/srv/checkpoints", "/var/lib/vllm-reloader"])
def test_config_path_holding_a_nul_is_a_config_error_not_a_crash(key):
    with pytest.raises(ConfigError, match=r"must not hold a NUL character"):
        config.parse(MINIMAL.replace(f'"{key}"', f'"{key}\\u0000x"'))


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (
            'converter = ["/no/such/convert", "{input}", "{output}"]',
            "'/no/such/convert' is not an executable",
        ),
        ('converter = ["/bin/true", "{input}"]', "no {output} argument"),
        ('converter = "/bin/true {input} {output}"', "source.converter"),
        ('completeness = "manifest"\nconverter = ["/bin/true", "{output}"]', 'needs completeness = "auto"'),
    ],
)
def test_config_converter_mistakes_are_one_line_errors(lines, message):
    text = MINIMAL.replace('path = "/srv/checkpoints"', f'path = "/srv/checkpoints"\n{lines}')
    with pytest.raises(ConfigError) as error:
        config.parse(text, "x.toml")
    assert message in str(error.value) and "\n" not in str(error.value)


def test_config_converter_runs_on_a_local_root_only():
    text = MINIMAL.replace('"/srv/checkpoints"', '"s3://bucket/runs"\nconverter = ["/bin/true", "{output}"]')
    with pytest.raises(ConfigError, match="converter: works on a local root only"):
        config.parse(text, "x.toml")
    assert config.parse(
        MINIMAL.replace('"/srv/checkpoints"', '"/srv/c"\nconverter = ["/bin/true", "{output}"]')
    )


def test_config_of_a_stage_node_needs_no_engine():
    """A headless node serves no HTTP: its daemon's config leaves `[engine]` out."""
    text = '[source]\npath = "s3://bucket/runs"\n[state]\ndir = "/var/lib/r"\n'
    text += '[node]\nrole = "stage"\nleader = "node-0"\n'
    cfg = config.parse(text)
    assert (cfg.node.role, cfg.node.leader) == ("stage", "node-0")
    with pytest.raises(ConfigError, match="engine: required key is missing"):
        config.parse(text.replace('role = "stage"', 'role = "single"'))
