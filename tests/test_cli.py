"""The console script as a user runs it: a real subprocess, exit codes, one-line errors."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

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
    assert main(["verify", str(directory), "--completeness", "manifest"]) == 1
    assert capsys.readouterr().out.strip() == "pending: no manifest.json yet"


def test_cli_verify_says_what_a_sharded_checkpoint_without_its_index_waits_for(tmp_path, capsys):
    write_weights(tmp_path / "hf", shards=2)
    assert main(["verify", str(tmp_path / "hf")]) == 1
    said = capsys.readouterr().out.strip()
    assert said.startswith("pending: 2 .safetensors file(s) but no model.safetensors.index.json yet")
    assert "vllm-reloader publish" in said


def test_cli_publish_into_existing_version_exits_1(tmp_path, capsys):
    src = tmp_path / "out"
    write_weights(src)
    assert main(["publish", str(src), "--into", str(tmp_path / "root"), "--version", "v"]) == 0
    assert main(["publish", str(src), "--into", str(tmp_path / "root"), "--version", "v"]) == 1
    assert "already exists" in capsys.readouterr().err


def test_cli_publish_into_a_shared_root_publishes_into_its_directory(tmp_path, capsys, monkeypatch):
    write_weights(tmp_path / "out")
    assert main(["publish", str(tmp_path / "out"), "--into", f"file://{tmp_path}/root", "--step", "3"]) == 0
    assert (tmp_path / "root" / "step-3" / "manifest.json").is_file()
    monkeypatch.chdir(tmp_path)
    for url in ("file://root", "file://localhost/tmp/x", "file://"):
        assert main(["publish", str(tmp_path / "out"), "--into", url]) == 2
        said = capsys.readouterr().err
        assert "file:// needs an absolute path below /" in said and said.count("\n") == 1, said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "root"], "nothing published elsewhere"


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
    """A config naming ROOT and STATE under `tmp_path`, made here as an operator would (unless
    something is there already), and anything else `sections` says."""
    for made in ("root", "state"):
        if not (tmp_path / made).exists():
            (tmp_path / made).mkdir()
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
    long.parent.mkdir()
    config = _config(tmp_path, control=f'socket = "{long}"')
    _exits_2_in_one_line(cli("run", "--config", config), "longer than the 107 bytes")


def test_cli_source_path_naming_a_file_exits_2(tmp_path):
    (tmp_path / "root").write_text("not a directory")
    _exits_2_in_one_line(cli("run", "--config", _config(tmp_path)), "exists and is not a directory")


@pytest.mark.parametrize("key", ["source.path", "state.dir"])
def test_cli_run_with_a_missing_directory_exits_2_naming_it_and_creates_nothing(tmp_path, key):
    """A typo in a path is one line and exit 2, not a new tree on the host."""
    typo = tmp_path / "typo" / "dir"
    body = {"source": f'path = "{typo}"'} if key == "source.path" else {"state": f'dir = "{typo}"'}
    config = _config(tmp_path, **body)
    _exits_2_in_one_line(cli("run", "--config", config), f"{key} {typo}: no such directory; create it")
    assert not (tmp_path / "typo").exists()
    assert list((tmp_path / "state").iterdir()) == [], "no state file, no control socket"


def test_cli_run_with_state_dir_under_a_file_exits_2_in_one_line(tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    under = tmp_path / "a-file" / "state"
    config = _config(tmp_path, state=f'dir = "{under}"')
    _exits_2_in_one_line(cli("run", "--config", config), f"state.dir {under}: a part of the path is a file")


def test_cli_run_resolves_relative_paths_against_the_config_files_directory(tmp_path):
    """Not against the directory the daemon happens to be started from."""
    from tests.support.engine_fixtures import DaemonProcess

    etc, elsewhere = tmp_path / "etc", tmp_path / "elsewhere"
    for directory in (etc / "checkpoints", etc / "state", elsewhere):
        directory.mkdir(parents=True)
    config = etc / "daemon.toml"
    config.write_text(
        '[source]\npath = "checkpoints"\n[engine]\nurl = "http://127.0.0.1:1"\nretry_initial = 5.0\n'
        '[state]\ndir = "./state"\n[log]\nformat = "json"\n'
    )
    daemon = DaemonProcess(Path("..") / "etc" / "daemon.toml", cwd=elsewhere)
    try:
        started = daemon.wait_for("daemon.started", timeout=30)
        assert started["root"] == str(etc / "checkpoints")
        assert (etc / "state" / "control.sock").is_socket()
        assert list(elsewhere.iterdir()) == []
    finally:
        assert daemon.stop() == 0


def test_cli_verify_of_a_path_that_is_not_there_is_a_usage_error_naming_it(tmp_path):
    missing = tmp_path / "step-typo"
    _exits_2_in_one_line(cli("verify", str(missing)), f"no such directory: {missing}")
    (tmp_path / "file").write_text("x")
    _exits_2_in_one_line(cli("verify", str(tmp_path / "file")), f"not a directory: {tmp_path / 'file'}")


def test_cli_publish_of_bin_weights_only_is_refused_at_once_and_writes_nothing(tmp_path):
    src = tmp_path / "out"
    src.mkdir()
    (src / "pytorch_model.bin").write_bytes(b"\x80\x02pickled torch weights")
    (src / "config.json").write_text("{}")
    result = cli("publish", str(src), "--into", str(tmp_path / "root"), "--step", "3")
    assert result.returncode == 1, result.stdout
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "no .safetensors weights (found pytorch_model.bin)" in result.stderr
    assert "save_pretrained(..., safe_serialization=True)" in result.stderr
    assert not (tmp_path / "root").exists(), "nothing written into the root"


def test_cli_run_whose_reader_goes_away_stops_at_once_without_a_traceback(tmp_path):
    """`vllm-reloader run ... | head -2`: the line after the reader left (here the one a SIGHUP
    brings) stops the daemon."""
    config = _config(tmp_path, engine='url = "http://127.0.0.1:1"\nretry_initial = 0.05\nretry_max = 0.1')
    with subprocess.Popen(
        [sys.executable, "-m", "vllm_reloader", "run", "--config", config],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    ) as daemon:  # fmt: skip
        assert daemon.stdout is not None and daemon.stderr is not None
        first = [daemon.stdout.readline() for _ in range(2)]  # daemon.started, engine.starting
        daemon.stdout.close()  # as `head -2` exits
        daemon.send_signal(signal.SIGHUP)  # config.reloaded: a line with nobody reading
        try:
            assert daemon.wait(timeout=20) == 141, "stopped as by SIGTERM, not 0: systemd restarts it"
        finally:
            daemon.kill()  # (a no-op once it has exited)
        errors = daemon.stderr.read()
    assert "Traceback" not in errors and "BrokenPipe" not in errors, errors
    assert errors == ""
    assert [json.loads(line)["event"] for line in first] == ["daemon.started", "engine.starting"]


def test_cli_says_its_version():
    result = cli("--version")
    assert result.returncode == 0 and result.stdout.startswith("vllm-reloader ")
    assert result.stdout.split()[1][0].isdigit()


def test_cli_control_commands_find_the_config_from_the_environment_without_flag(tmp_path):
    """The runbooks paste `vllm-reloader status`: no --config needed where the install put it."""
    config = tmp_path / "daemon.toml"
    config.write_text(
        f'[source]\npath = "{tmp_path}"\n[engine]\nurl = "http://127.0.0.1:1"\n[state]\ndir = "{tmp_path}"\n'
    )
    env = {**os.environ, "VLLM_RELOADER_CONFIG": str(config)}
    found = subprocess.run(
        [sys.executable, "-m", "vllm_reloader", "status"], capture_output=True, text=True, timeout=60, env=env
    )
    assert found.returncode == 1 and "cannot reach the daemon" in found.stderr, found.stderr
    env["VLLM_RELOADER_CONFIG"] = str(tmp_path / "missing.toml")
    missing = subprocess.run(
        [sys.executable, "-m", "vllm_reloader", "status"], capture_output=True, text=True, timeout=60, env=env
    )
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1
    assert "missing.toml does not exist: pass --config FILE" in missing.stderr


def test_cli_publish_of_a_truncated_shard_is_refused_naming_it_and_writes_nothing(tmp_path):
    src = tmp_path / "out"
    [shard, *_] = write_weights(src, shards=2)
    whole = shard.stat().st_size
    os.truncate(shard, whole - 100)
    result = cli("publish", str(src), "--into", str(tmp_path / "root"), "--step", "3")
    assert result.returncode == 1, result.stdout
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert f"{shard}: {whole - 100} bytes where its header says {whole}" in result.stderr
    assert not (tmp_path / "root").exists(), "nothing written into the root"
