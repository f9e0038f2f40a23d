"""Every event the daemon emits is in the catalogue of docs/events.md (its Logs section), and
the catalogue names none it does not emit: on-call engineers grep logs by these names."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "daemon" / "vllm_reloader"
LOG_METHODS = {"debug", "info", "warning", "error", "exception", "critical"}
EVENT = re.compile(r"[a-z_]+\.[a-z_]+")


FILE_SUFFIXES = {"json", "txt", "safetensors", "sock", "toml", "log", "bin", "pt", "pth", "sqlite"}


def emitted_events(source: str) -> set[str]:
    """Event names in a module, as patterns: every `noun.verb` string literal (events are also
    built as data, `Event("error", "reload.failed", ...)`, and logged elsewhere) that is not a
    file name, and the f-strings logged directly (`{x}` → a word)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        value = node.value if isinstance(node, ast.Constant) else None
        if isinstance(value, str) and EVENT.fullmatch(value) and value.rsplit(".", 1)[1] not in FILE_SUFFIXES:
            found.add(re.escape(value))
        logged = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args
        if logged and node.func.attr in LOG_METHODS and isinstance(node.args[0], ast.JoinedStr):
            parts = [
                re.escape(p.value) if isinstance(p, ast.Constant) else "[a-z_]+" for p in node.args[0].values
            ]
            found.add("".join(parts))
    return found


def code_events() -> set[str]:
    patterns: set[str] = set()
    for module in PACKAGE.rglob("*.py"):
        patterns |= emitted_events(module.read_text())
    return patterns


def catalogue() -> set[str]:
    """Event names in backticks in docs/events.md's Logs section (up to the next `## ` heading)."""
    events_doc = (ROOT / "docs" / "events.md").read_text()
    section = events_doc.split("\n## Logs\n", 1)[1].split("\n## ", 1)[0]
    return {name for name in re.findall(r"`([^`]+)`", section) if EVENT.fullmatch(name)}


def test_catalogue_reader_finds_literal_and_formatted_events():
    source = 'log.info("a.b", x=1)\nself.log.error(f"{kind}.failed")\nopen("state.json")\nlog.info(name)\n'
    assert emitted_events(source) == {r"a\.b", r"[a-z_]+\.failed"}


def test_every_emitted_event_is_in_the_docs_catalogue():
    documented = catalogue()
    missing = {p for p in code_events() if not any(re.fullmatch(p, name) for name in documented)}
    assert not missing, f"events emitted but not in the Logs section of docs/events.md: {sorted(missing)}"


def test_every_catalogued_event_is_emitted():
    patterns = code_events()
    stale = {name for name in catalogue() if not any(re.fullmatch(p, name) for p in patterns)}
    assert not stale, f"docs/events.md catalogues events the code never emits: {sorted(stale)}"
