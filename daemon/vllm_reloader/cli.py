"""`vllm-reloader`: run the daemon, publish a checkpoint, verify one offline.

Exit codes: 0 ok; 1 the thing asked for failed (a checkpoint is not loadable, a publish
could not be placed); 2 bad usage or bad config, always one line on stderr, no traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from . import config as config_mod
from . import gate, layout, log
from .errors import ConfigError, PublishError, StateError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-reloader", description="Hot-swap new checkpoints into a running vLLM engine."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run the daemon in the foreground")
    run.add_argument("--config", required=True, type=Path, metavar="FILE")
    run.add_argument(
        "--log-priority-prefix",
        action="store_true",
        help="prefix each log line with <N> for journald (as the systemd unit does)",
    )

    publish = commands.add_parser("publish", help="place a checkpoint into a root atomically")
    publish.add_argument("src", type=Path, metavar="SRC")
    publish.add_argument("--into", required=True, type=Path, metavar="ROOT")
    publish.add_argument("--version", dest="name", metavar="NAME")
    publish.add_argument("--step", type=int, metavar="N")
    publish.add_argument("--move", action="store_true", help="move files instead of copying")

    verify = commands.add_parser("verify", help="run the gate on a directory, offline")
    verify.add_argument("dir", type=Path, metavar="DIR")
    verify.add_argument(
        "--against", type=Path, metavar="SERVING_DIR", help="also check the layout against this checkpoint"
    )
    return parser


def _fail(code: int, message: str) -> int:
    print(f"vllm-reloader: {message}", file=sys.stderr)
    return code


def _run(config_path: Path, priority_prefix: bool) -> int:
    from .daemon import Daemon  # imports watchdog and httpx only when running

    cfg = config_mod.load(config_path)
    if priority_prefix:
        cfg = cfg.model_copy(update={"log": cfg.log.model_copy(update={"priority_prefix": True})})
    log.configure(cfg.log.level, cfg.log.format, priority_prefix=cfg.log.priority_prefix)
    daemon = Daemon(cfg, config_path=config_path)
    daemon.install_signal_handlers()
    return daemon.run()


def _publish(args: argparse.Namespace) -> int:
    from .publish import publish

    final = publish(args.src, args.into, name=args.name, step=args.step, move=args.move)
    print(final)
    return 0


def _verify(directory: Path, against: Path | None) -> int:
    serving = None
    if against is not None:
        try:
            serving = layout.read_served_layout(against)
        except (OSError, layout.LayoutUnreadable) as exc:
            return _fail(2, f"--against {against}: {exc}")
    verdict = gate.check(directory, serving=serving, options=gate.GateOptions(manifest_grace=0))
    if verdict.status == "ready":
        compared = "" if serving else " (layout not compared: no --against)"
        print(f"ready: {directory} ({verdict.bytes} bytes){compared}")
        return 0
    print(f"{verdict.status}: {verdict.reason}")
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "run":
            return _run(args.config, args.log_priority_prefix)
        if args.command == "publish":
            return _publish(args)
        return _verify(args.dir, args.against)
    except ConfigError as exc:
        return _fail(2, str(exc))
    except (PublishError, StateError) as exc:
        return _fail(1, str(exc))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
