"""What the engine is serving, worked out from what it reports and what the root holds.

Pure functions of their inputs (the engine's weight version and startup model path, the
state file, the candidates), so a restarted daemon's judgement is testable without one.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

from ..checkpoint import completeness, order
from ..checkpoint.completeness import DirectoryListing
from ..checkpoint.conventions import Convention, name_says_step
from ..checkpoint.files import changed, read_small
from ..checkpoint.manifest import MANIFEST_NAME
from ..checkpoint.manifest import parse as parse_manifest
from ..engine.client import RELOADING_PREFIX, STARTUP_VERSION
from ..errors import ManifestInvalid, NotJSONYet
from .state import Loaded, State


def version_of(directory: Path) -> str:
    """The manifest's version, else the directory name (read like any writer's file)."""
    try:
        return parse_manifest(read_small(directory / MANIFEST_NAME)).version or order.base_name(
            directory.name
        )
    except (OSError, NotJSONYet, ManifestInvalid):
        return order.base_name(directory.name)


UNKNOWN_CONTENT = "unknown"
"""The fingerprint of weights whose content cannot be told (any content of their name is newer)."""


def _other_content(
    version: str, known: Loaded, root: Path, candidates: Mapping[str, order.Candidate]
) -> bool:
    return any(
        c.fingerprint != known.fingerprint and version_of(root / name) == version
        for name, c in _loadable(candidates).items()
    )


def _loadable(candidates: Mapping[str, order.Candidate]) -> dict[str, order.Candidate]:
    """All but a converter's inputs (a trainer's own format): their version is their output's."""
    return {n: c for n, c in candidates.items() if order.placed_name(n, c.fingerprint) not in candidates}


def _stepped(known: Loaded, candidates: Mapping[str, order.Candidate]) -> Loaded:
    """A record from before trainers' checkpoints had a step (`conventions.trainer_step`) names
    none: it takes its candidate's for the same content, else the one its name says, so an
    older stepped candidate is not newer than it (nor the same bytes reloaded) after an upgrade."""
    if known.step is not None or not known.in_root:
        return known
    candidate = candidates.get(known.name)
    same = candidate is not None and bool(known.fingerprint) and candidate.fingerprint == known.fingerprint
    step = candidate.step if same and candidate else name_says_step(order.base_name(known.name))
    if step is None:  # still none: its place is its arrival's, if it has one
        arrival = known.arrival or (candidate.arrival if same and candidate else None)
        return known.model_copy(update={"arrival": arrival})
    return known.model_copy(update={"step": step})


def serving(
    engine_version: str,
    startup: str,
    *,
    known: Loaded | None,
    root: Path,
    candidates: Mapping[str, order.Candidate],
    trusted: bool = True,
) -> Loaded:
    """The checkpoint the engine holds now.

    `default` means never reloaded (e.g. the engine restarted): its startup model.
    `reloading:…` means a reload was cut short: the weights may be a mix of two checkpoints.
    `known` is what the state says this engine serves; not `trusted` (a follower starts from the
    host's record, not its own), a version that names several contents is of unknown content.
    """
    now = time.time()
    if engine_version.startswith(RELOADING_PREFIX):
        # Weights of unknown mix: no position in the order, so any good candidate replaces them.
        return Loaded(name=engine_version, version=engine_version, path=startup, since=now, in_root=False)
    if engine_version == STARTUP_VERSION:
        directory = Path(startup)
        in_root = directory.parent.resolve() == root.resolve() and directory.name in candidates
        candidate = candidates.get(directory.name) if in_root else None
        return Loaded(
            name=directory.name,
            version=version_of(directory) if in_root else STARTUP_VERSION,
            path=startup,
            since=now,
            step=candidate.step if candidate else None,
            in_root=in_root,
            fingerprint=candidate.fingerprint if candidate else "",
            arrival=candidate.arrival if candidate else None,
        )
    if known is not None and known.version == engine_version:
        if trusted or not _other_content(engine_version, known, root, candidates):
            return _stepped(known, candidates)
        # Another engine's record, and the version names several contents: which is unknown.
        return known.model_copy(update={"fingerprint": UNKNOWN_CONTENT, "since": now})
    for name, candidate in _loadable(candidates).items():
        if version_of(root / name) == engine_version:
            return Loaded(
                name=name,
                version=engine_version,
                path=str(root / name),
                since=now,
                step=candidate.step,
                fingerprint=candidate.fingerprint,
                arrival=candidate.arrival,
            )
    return Loaded(name=engine_version, version=engine_version, path=startup, since=now, in_root=False)


def with_fingerprints(saved: State, convention: Convention) -> State:
    """A state file of the release before versions were content names no fingerprints: each
    checkpoint whose files still have the identities it was verified with takes its directory's
    fingerprint now (one that changed since stays without, and is no rollback target)."""

    def filled(loaded: Loaded, changed_is: str) -> Loaded:
        if loaded.fingerprint or loaded.files is None:
            return loaded
        directory = Path(loaded.path)
        try:
            fingerprint = (
                changed_is
                if changed(directory, loaded.files) is not None
                else completeness.fingerprint(DirectoryListing(directory), convention)
            )
        except OSError:
            fingerprint = changed_is
        return loaded.model_copy(update={"fingerprint": fingerprint}) if fingerprint else loaded

    # What serves and no longer matches its directory (the previous release placed a rewrite
    # over it): of unknown content, so the content there now is newer.
    serving = filled(saved.serving, UNKNOWN_CONTENT) if saved.serving is not None else None
    return saved.model_copy(update={"serving": serving, "good": tuple(filled(g, "") for g in saved.good)})
