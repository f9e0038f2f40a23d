"""The console script as a user runs it: a real subprocess, exit codes, one-line errors."""

import socket
import subprocess
import sys

from tests.support.checkpoints import write_weights
from vllm_reloader.cli import main


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "vllm_reloader", *args], capture_output=True, text=True, timeout=60
    )


def test_cli_config_error_exits_2_with_one_line_and_no_traceback(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(
        '[source]\npath = "/x"\nwatch = true\n[engine]\nurl = "http://127.0.0.1:1"\n[state]\ndir = "/y"\n'
    )
    result = cli("run", "--config", str(bad))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "source.watch: unknown key" in result.stderr


def test_cli_missing_required_key_exits_2(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[source]\npath = "/x"\n[state]\ndir = "/y"\n')
    result = cli("run", "--config", str(bad))
    assert result.returncode == 2
    assert "engine: required key is missing" in result.stderr


def test_cli_publish_then_verify_against_serving(tmp_path):
    src = tmp_path / "out"
    write_weights(src)
    serving = tmp_path / "serving"
    write_weights(serving, seed=3)
    published = cli("publish", str(src), "--into", str(tmp_path / "root"), "--step", "5")
    assert published.returncode == 0, published.stderr
    assert published.stdout.strip() == str(tmp_path / "root" / "step-5")
    verified = cli("verify", published.stdout.strip(), "--against", str(serving))
    assert verified.returncode == 0, verified.stdout
    assert verified.stdout.startswith("ready:")


def test_cli_verify_reports_reason_and_exits_1(tmp_path, capsys):
    directory = tmp_path / "step-1"
    write_weights(directory)
    assert main(["verify", str(directory)]) == 1
    assert capsys.readouterr().out.strip() == "pending: no manifest.json yet"


def test_cli_publish_into_existing_version_exits_1(tmp_path, capsys):
    src = tmp_path / "out"
    write_weights(src)
    assert main(["publish", str(src), "--into", str(tmp_path / "root"), "--version", "v"]) == 0
    assert main(["publish", str(src), "--into", str(tmp_path / "root"), "--version", "v"]) == 1
    assert "already exists" in capsys.readouterr().err


def test_cli_publish_into_s3_prints_the_url_and_refuses_a_second_time(tmp_path, bucket):
    write_weights(tmp_path / "out")
    first = cli("publish", str(tmp_path / "out"), "--into", bucket.url, "--step", "7")
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == f"{bucket.url}/step-7"
    assert "step-7/manifest.json" in bucket.listed()
    again = cli("publish", str(tmp_path / "out"), "--into", bucket.url, "--step", "7")
    assert again.returncode == 1 and "already exists" in again.stderr and again.stderr.count("\n") == 1


def test_cli_verify_knows_the_foreign_conventions(tmp_path):
    from tests.support.checkpoints import hf_index

    shards = write_weights(tmp_path / "hf", shards=2)
    assert cli("verify", str(tmp_path / "hf"), "--completeness", "hf-index").returncode == 1
    (tmp_path / "hf" / "model.safetensors.index.json").write_bytes(hf_index(shards))
    result = cli("verify", str(tmp_path / "hf"), "--completeness", "hf-index")
    assert result.returncode == 0 and result.stdout.startswith("ready:"), result.stdout


def _config(tmp_path, **sections: str) -> str:
    parts = {
        "source": f'path = "{tmp_path / "root"}"',
        "engine": 'url = "http://127.0.0.1:1"',
        "state": f'dir = "{tmp_path / "state"}"',
        **sections,
    }
    path = tmp_path / "daemon.toml"
    path.write_text("".join(f"[{name}]\n{body}\n" for name, body in parts.items()))
    return str(path)


def _exits_2_in_one_line(result: subprocess.CompletedProcess[str], expected: str) -> None:
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert expected in result.stderr


def test_cli_config_that_is_not_utf8_exits_2(tmp_path):
    path = tmp_path / "daemon.toml"
    path.write_bytes(b'[source]\npath = "/x\xff"\n')
    _exits_2_in_one_line(cli("run", "--config", str(path)), "not UTF-8")


def test_cli_infinite_interval_exits_2(tmp_path):
    config = _config(tmp_path, source=f'path = "{tmp_path / "root"}"\nrescan_interval = inf')
    _exits_2_in_one_line(
        cli("run", "--config", config), "source.rescan_interval: Input should be a finite number"
    )


def test_cli_metrics_port_out_of_range_or_in_use_exits_2(tmp_path):
    _exits_2_in_one_line(
        cli("run", "--config", _config(tmp_path, metrics='listen = "127.0.0.1:70000"')),
        "port from 1 to 65535",
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = _config(tmp_path, metrics=f'listen = "127.0.0.1:{port}"')
        _exits_2_in_one_line(
            cli("run", "--config", config), f"metrics.listen 127.0.0.1:{port}: cannot listen"
        )


def test_cli_control_socket_path_too_long_exits_2(tmp_path):
    long = tmp_path / ("d" * 120) / "control.sock"
    config = _config(tmp_path, control=f'socket = "{long}"')
    _exits_2_in_one_line(cli("run", "--config", config), "longer than the 107 bytes")


def test_cli_source_path_naming_a_file_exits_2(tmp_path):
    (tmp_path / "root").write_text("not a directory")
    _exits_2_in_one_line(cli("run", "--config", _config(tmp_path)), "exists and is not a directory")
