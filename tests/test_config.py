import pytest

from vllm_reloader import config
from vllm_reloader.errors import ConfigError

MINIMAL = """
[source]
path = "/srv/checkpoints"
[engine]
url = "http://127.0.0.1:8000/"
[state]
dir = "/var/lib/vllm-reloader"
"""


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
    ],
)
def test_config_error_names_the_key_on_one_line(text, message):
    with pytest.raises(ConfigError) as error:
        config.parse(text, "x.toml")
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_config_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        config.load(tmp_path / "absent.toml")


def test_config_example_file_is_valid_and_matches_defaults():
    from pathlib import Path

    example = Path(__file__).parent.parent / "config" / "vllm-reloader.toml"
    parsed = config.load(example)
    required = {"source": {"path"}, "engine": {"url"}, "state": {"dir"}}
    for section_name, section in parsed:
        default = type(section).model_construct()
        for key in type(section).model_fields:
            if key not in required.get(section_name, set()):
                assert getattr(section, key) == getattr(default, key), f"{section_name}.{key}"
    assert parsed.engine.pause_mode == "keep"
