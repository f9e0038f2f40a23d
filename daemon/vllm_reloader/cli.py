"""`vllm-reloader`: run the daemon, publish a checkpoint, verify one offline.

Exit codes: 0 ok; 1 the thing asked for failed (a checkpoint is not loadable, a publish
could not be placed); 2 bad usage or bad config, always one line on stderr, no traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from . import config as config_mod
from . import log
from .checkpoint import gate, layout
from .checkpoint.conventions import Convention, Mode
from .errors import ConfigError, LayoutUnreadable, ReloaderError

DEFAULT_CONFIG = Path("/etc/vllm-reloader/vllm-reloader.toml")
"""Where the production install puts it (the systemd unit's --config): found without --config."""
CONFIG_ENV = "VLLM_RELOADER_CONFIG"


def _config_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", type=Path, metavar="FILE",
        help=f"the daemon's config (default: ${CONFIG_ENV}, else {DEFAULT_CONFIG})",
    )  # fmt: skip


def _config_path(given: Path | None) -> Path:
    """--config, else $VLLM_RELOADER_CONFIG, else where the production install puts it."""
    if given is not None:
        return given
    found = Path(os.environ[CONFIG_ENV]) if os.environ.get(CONFIG_ENV) else DEFAULT_CONFIG
    if not found.exists():
        raise ConfigError(f"no --config given and {found} does not exist: pass --config FILE")
    return found


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm-reloader")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-reloader", description="Hot-swap new checkpoints into a running vLLM engine."
    )
    parser.add_argument("--version", action="version", version=f"vllm-reloader {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run the daemon in the foreground")
    _config_flag(run)
    run.add_argument(
        "--log-priority-prefix",
        action="store_true",
        help="prefix each log line with <N> for journald (as the systemd unit does)",
    )

    publish = commands.add_parser("publish", help="place a checkpoint into a root atomically")
    publish.add_argument("src", type=Path, metavar="SRC")
    publish.add_argument(
        "--into",
        required=True,
        metavar="ROOT",
        help="a local or shared root (path, file://), or s3:// gs:// az://",
    )
    publish.add_argument("--endpoint-url", metavar="URL", help="object store endpoint (S3-compatible)")
    publish.add_argument("--version", dest="name", metavar="NAME")
    publish.add_argument("--step", type=int, metavar="N")
    publish.add_argument("--move", action="store_true", help="move files instead of copying")

    status = commands.add_parser("status", help="what the running daemon serves and why")
    _config_flag(status)
    status.add_argument("--json", action="store_true", help="the raw answer, as JSON")
    pin = commands.add_parser("pin", help="load VERSION and stop auto-advancing")
    pin.add_argument("version", metavar="VERSION")
    _config_flag(pin)
    pin.add_argument("--force", action="store_true", help="pin a rejected version: gate and load it again")
    for name, text in (("unpin", "resume auto-advancing"), ("reload", "rescan and check the engine now")):
        _config_flag(commands.add_parser(name, help=text))

    demo = commands.add_parser("demo", help="tiny checkpoints, a CPU vLLM engine, one hot reload")
    demo.add_argument("--engine-url", metavar="URL", help="use this running engine instead of starting one")
    demo.add_argument("--keep", action="store_true", help="keep the temporary directory")

    verify = commands.add_parser("verify", help="run the gate on a directory, offline")
    verify.add_argument("dir", type=Path, metavar="DIR")
    verify.add_argument(
        "--against", type=Path, metavar="SERVING_DIR", help="also check the layout against this checkpoint"
    )
    verify.add_argument(
        "--completeness", choices=("auto", "manifest", "hf-index", "marker"), default="auto",
        help="how the writer marks a checkpoint whole (as [source] completeness)",
    )  # fmt: skip
    return parser


def _fail(code: int, message: str) -> int:
    print(f"vllm-reloader: {message}", file=sys.stderr)
    return code


def _run(config_path: Path, priority_prefix: bool) -> int:
    from .service.daemon import Daemon  # imports watchdog and httpx only when running

    cfg = config_mod.load(config_path)
    if priority_prefix:
        cfg = cfg.model_copy(update={"log": cfg.log.model_copy(update={"priority_prefix": True})})
    log.configure(cfg.log.level, cfg.log.format, priority_prefix=cfg.log.priority_prefix)
    if cfg.node.role == "stage":
        from .service.stage import Stage

        stage = Stage(cfg)
        stage.install_signal_handlers()
        code = stage.run()
        return log.EXIT_OUTPUT_LOST if code == 0 and log.output_lost() else code
    daemon = Daemon(cfg, config_path=config_path)
    daemon.install_signal_handlers()
    code = daemon.run()
    return log.EXIT_OUTPUT_LOST if code == 0 and log.output_lost() else code


def _publish(args: argparse.Namespace) -> int:
    from .config import REMOTE_SCHEMES
    from .config.base import SHARED_ROOT, shared_root_problem

    if problem := shared_root_problem(args.into):
        return _fail(2, f"--into {args.into}: {problem}")
    if args.into.startswith(SHARED_ROOT):  # a shared root is a directory here: publish into it as one
        args.into = args.into.removeprefix(SHARED_ROOT)
    if args.into.startswith(REMOTE_SCHEMES):
        from .tools.upload import publish_remote

        if args.move:
            return _fail(2, "--move works only into a local root")
        print(
            publish_remote(
                args.src, args.into, name=args.name, step=args.step, endpoint_url=args.endpoint_url
            )
        )
        return 0
    from .tools.publish import publish

    print(publish(args.src, Path(args.into), name=args.name, step=args.step, move=args.move))
    return 0


def _verify(directory: Path, against: Path | None, mode: Mode) -> int:
    if not directory.is_dir():  # a typo, not a checkpoint that went away while checked
        return _fail(2, f"{'not a directory' if directory.exists() else 'no such directory'}: {directory}")
    serving = None
    if against is not None:
        try:
            serving = layout.read_served_layout(against)
        except (OSError, LayoutUnreadable) as exc:
            return _fail(2, f"--against {against}: {exc}")
    verdict = gate.check(
        directory,
        serving=serving,
        options=gate.GateOptions(convention=Convention(mode, manifest_grace=0, settle_seconds=0)),
    )
    if verdict.status == "ready":
        compared = "" if serving else " (layout not compared: no --against)"
        print(f"ready: {directory} ({verdict.bytes} bytes){compared}")
        return 0
    print(f"{verdict.status}: {verdict.reason}")
    return 1


def _control(args: argparse.Namespace) -> int:
    from .service import control, status

    cfg = config_mod.load(_config_path(args.config))
    fields = {"version": args.version, "force": args.force} if args.command == "pin" else {}
    answer = control.call(cfg.control_socket, args.command, **fields)
    if not answer.get("ok"):
        return _fail(1, str(answer.get("error", "failed")))
    if args.command == "status":
        print(json.dumps(answer, indent=1) if args.json else status.render(answer))
    else:
        print("ok")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "run":
            return _run(_config_path(args.config), args.log_priority_prefix)
        if args.command == "publish":
            return _publish(args)
        if args.command in ("status", "pin", "unpin", "reload"):
            return _control(args)
        if args.command == "demo":
            from .tools import demo

            return demo.run(args.engine_url, keep=args.keep)
        return _verify(args.dir, args.against, args.completeness)
    except ConfigError as exc:
        return _fail(2, str(exc))
    except ReloaderError as exc:  # publish, state, demo, control: one line, exit 1
        return _fail(1, str(exc))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
