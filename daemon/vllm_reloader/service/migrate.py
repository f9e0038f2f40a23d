"""The previous release's JSON files, imported into the record store at the first start.

That release kept its facts in `state.dir`: `state.json` (serving, rollback history, pin,
rejected checkpoints), `adapters.json` (rejected adapter contents), `unwritten-verdicts.json`
and `instance-id` (the checkpoints' fleet), and the same two under `adapter-fleet/` (the
adapters' fleet). Each is read with the record store's own policy: one that cannot be read
(EACCES, EIO) is tried again and then the daemon does not start — a rejection is never
forgotten for a disk's bad moment; one that reads and is not what it should be is set aside
(`.corrupt-<time>`) and said. All of it lands in one transaction; only then is each file
renamed `<name>.migrated` (kept, for an operator going back a release).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from ..errors import StateError
from ..records import RecordStore, read_to_start
from ..sources.verdicts import Verdict
from .state import State, StateRecords

IMPORTED = "imported"
"""The meta key saying the JSON files were imported (when)."""
MIGRATED = ".migrated"
_VERDICTS = TypeAdapter(list[Verdict])
_ADAPTER_REJECTIONS = TypeAdapter(dict[str, dict[str, str]])
FLEETS = {"checkpoints": Path("."), "adapters": Path("adapter-fleet")}
"""Each fleet's folder in the state dir, in the previous release."""


def migrate(records: RecordStore, directory: Path, log: Any, *, completeness_unset: bool = False) -> None:
    """Whatever JSON files are there are imported, each time they are: at the first start after
    an upgrade, and after going back a release and forward again (that release wrote its facts
    there since: they are the newer ones). A crash between the import and the renames imports
    the same again, harmlessly (a verdict written twice is found there, and kept).
    `completeness_unset`: the config leaves `[source] completeness` at its default, which was
    `manifest` in the oldest of those releases: said once, at the import."""
    files = _files(directory)
    if not files:
        if records.meta(IMPORTED) is None:
            records.set_meta(IMPORTED, str(time.time()))
        return
    found: dict[str, object] = {}
    state = _read(directory / "state.json", log, lambda data: State.model_validate_json(data))
    rejected = _read(directory / "adapters.json", log, _adapter_rejections)
    committed: list[bool] = []
    with records.transaction():
        records.ended(committed.append)
        if state is not None:
            StateRecords(records, log).save(state)
            found["state.json"] = {"rejected": len(state.rejected), "good": len(state.good)}
        if rejected is not None:
            records.replace("adapter_rejected", dict(rejected))
            found["adapters.json"] = {"rejected": len(rejected)}
        for fleet, folder in FLEETS.items():
            queued = _read(directory / folder / "unwritten-verdicts.json", log, _VERDICTS.validate_json)
            for verdict in queued or ():
                records.outbox_add(fleet, asdict(verdict))
            if queued:
                found[str(folder / "unwritten-verdicts.json")] = {"verdicts": len(queued)}
            instance = _instance(directory / folder / "instance-id")
            if instance is not None:
                records.set_meta(f"instance:{fleet}", instance)
        records.set_meta(IMPORTED, str(time.time()))
    if not committed[0]:  # said by the store; the files stay, and are imported at the next start
        return
    _rename(directory, files)
    log.info("state.migrated", path=str(records.path), imported=found, renamed_to=f"<name>{MIGRATED}")
    if completeness_unset and "state.json" in found:
        log.warning(
            "config.default_changed",
            key="[source] completeness",
            now="auto",
            before="manifest in the oldest releases with state.json",
            reason="if yours waited for a manifest: a checkpoint without one (a Trainer's) loads when whole",
            fix='set [source] completeness = "manifest" to load only published checkpoints',
        )


def _adapter_rejections(data: bytes) -> dict[str, str]:
    return _ADAPTER_REJECTIONS.validate_json(data).get("rejected", {})


def _files(directory: Path) -> list[Path]:
    names = ["state.json", "adapters.json"]
    for folder in FLEETS.values():
        names += [str(folder / "unwritten-verdicts.json"), str(folder / "instance-id")]
    return [directory / name for name in names if (directory / name).is_file()]


def _rename(directory: Path, files: list[Path]) -> None:
    for path in files:
        with contextlib.suppress(OSError):  # kept for going back: it is never read again here
            os.replace(path, path.with_name(path.name + MIGRATED))


def _read(path: Path, log: Any, parse: Callable[[bytes], Any]) -> Any:
    """What the file holds (parsed); None when there is none or it was set aside as corrupt.
    `StateError` when it cannot be read, after retries (`records.read_to_start`)."""

    def read() -> bytes | None:
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None

    data = read_to_start(read, path, log)
    if data is None:
        return None
    try:
        return parse(data)
    except (ValidationError, ValueError, RecursionError) as exc:
        aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}")
        try:
            os.replace(path, aside)
        except OSError as moved:
            raise StateError(f"{path} is corrupt and cannot be moved aside: {moved.strerror}") from exc
        log.error("state.corrupt", path=str(path), moved_to=str(aside), reason=str(exc)[:300])
        return None


def _instance(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        return None  # a new id is made: the worst is one `verdict.host_conflict` line
    return text if len(text) == 32 and all(c in "0123456789abcdef" for c in text) else None
