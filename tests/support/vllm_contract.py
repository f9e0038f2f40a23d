"""The compatibility contract: what the daemon and its worker extension rely on in vLLM,
checked by reading a release's Python sources (never running them).

The routes and the parameters the daemon sends are read out of the daemon's own client
(`engine/client.py`), so the contract follows the code; the worker side lists what
`extension/worker.py` uses. `check(release, sources)` returns one line per thing that moved,
naming it and where the daemon uses it; an empty list is a pass.

Run by hand: `python -m tests.support.vllm_contract` (every release from the oldest supported
on), printing each release's verdict and what it took to read."""

from __future__ import annotations

import ast
import hashlib
import re
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from packaging.version import InvalidVersion, Version

from tests.support.lazy_wheel import Fetched, read_members, under
from vllm_reloader.engine import capabilities, client

INDEX = "https://pypi.org/simple/vllm/"
CACHE = Path.home() / ".cache" / "vllm-reloader" / "contract"
PREFIXES = ("vllm/entrypoints/", "vllm/v1/worker/", "vllm/config/", "vllm/engine/", "vllm/v1/metrics/")
EXACT = ("vllm/envs.py", "vllm/v1/engine/__init__.py", "vllm/lora/request.py")
WANTED = under(PREFIXES, EXACT)
SELECTION = hashlib.sha256(repr((PREFIXES, EXACT)).encode()).hexdigest()[:12]
"""The cache is keyed by what is read: another choice of files is read again."""
NOT_VLLMS = {"/openapi.json": "FastAPI's own", "/metrics": "prometheus' mounted app"}
"""Routes the daemon calls that no vLLM handler defines; `/metrics` is checked by its names."""
SCHEDULER_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")
WORKER = "vllm/v1/worker/gpu_worker.py"
"""`Worker`: every worker class the extension is mixed into derives from it."""
RUNNER = "vllm/v1/worker/gpu_model_runner.py"
"""`GPUModelRunner`: its `_dummy_run` is the probe's forward pass (CPU's runner inherits it)."""
PROBE_KEYWORDS = ("is_profile", "remove_lora", "skip_eplb")
"""What `extension/probe.py` passes `_dummy_run` besides the token count, where it has them."""
LORA_MIXIN = "vllm/v1/worker/lora_model_runner_mixin.py"
LORA_METHODS = {
    "_set_active_loras": ("prompt_lora_mapping", "token_lora_mapping", "lora_requests"),
    "maybe_dummy_run_with_lora": ("lora_config", "num_scheduled_tokens", "num_sampled_tokens"),
    "add_lora": ("lora_request",),
    "remove_lora": ("lora_id",),
}
"""What the probe calls, or replaces, on a LoRA-enabled runner, with its leading parameters."""
LORA_REQUEST = ("vllm/lora/request.py", "LoRARequest", ("lora_name", "lora_int_id", "lora_path"))
CONFIG_FIELDS = {
    "ModelConfig": ("model", "model_weights", "revision", "enable_sleep_mode"),
    "ParallelConfig": ("worker_extension_cls",),
}
"""Read from `/server_info` by the daemon, written by the extension after a load."""


@dataclass(frozen=True)
class Call:
    """One request the daemon's engine client makes."""

    method: str
    path: str
    params: tuple[str, ...] = ()
    body: tuple[str, ...] = ()
    line: int = 0


@dataclass
class Handler:
    method: str
    path: str
    file: str
    query: set[str] = field(default_factory=set)
    """What it reads from the query string: plain arguments, `query_params.get("…")`."""
    body: set[str] = field(default_factory=set)
    """What it reads from a JSON body: its body models' fields, `Body()` arguments, `x.get("…")`."""
    doc: str = ""
    constants: set[str] = field(default_factory=set)
    """Every string in it (what it answers, among others)."""
    also: list[str] = field(default_factory=list)
    """Other files defining the same route (the app's include order decides which serves)."""


def daemon_calls(source: str | None = None) -> list[Call]:
    """Every `_call` / `_answered` / `_exchange` / `_optional` of the engine client, with the query
    parameters and JSON keys it sends (literal dict keys, or the first of literal pairs)."""
    tree = ast.parse(source if source is not None else Path(client.__file__).read_text())
    calls = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        strings = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        if node.func.attr == "_optional" and strings:
            calls.append(Call("GET", strings[0], line=node.lineno))
        elif node.func.attr in ("_call", "_exchange", "_answered") and len(strings) >= 2:
            keywords = {k.arg: k.value for k in node.keywords}
            calls.append(
                Call(
                    strings[0],
                    strings[1],
                    _keys(keywords.get("params")),
                    _keys(keywords.get("json")),
                    node.lineno,
                )
            )
    return calls


def _keys(node: ast.expr | None) -> tuple[str, ...]:
    if isinstance(node, ast.Dict):
        return tuple(k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
    if isinstance(node, ast.ListComp) and isinstance(node.elt, ast.Tuple) and node.elt.elts:
        first = node.elt.elts[0]
        return (first.value,) if isinstance(first, ast.Constant) and isinstance(first.value, str) else ()
    return ()


Trees = Mapping[str, ast.Module]
Function = ast.FunctionDef | ast.AsyncFunctionDef
Classes = Mapping[str, tuple[set[str], list[str], set[str]]]
"""Each class by name: its annotated fields, its bases' names, its methods."""


def parsed(sources: Mapping[str, str]) -> dict[str, ast.Module]:
    """Each Python source's syntax tree (one that does not parse is left out)."""
    trees = {}
    for name, text in sorted(sources.items()):
        if name.endswith(".py"):
            try:
                trees[name] = ast.parse(text)
            except SyntaxError:
                continue
    return trees


def _defs(tree: ast.AST) -> Iterator[ast.AST]:
    """Every statement, descending only into statement bodies (not expressions): the
    definitions, at a fraction of `ast.walk`'s cost."""
    for name in ("body", "orelse", "finalbody", "handlers"):
        for child in getattr(tree, name, ()):
            yield child
            yield from _defs(child)


def classes(trees: Trees) -> dict[str, tuple[set[str], list[str], set[str]]]:
    """Every class by name: its annotated fields, its bases' names, its methods. A union
    alias (`TokenizeRequest: TypeAlias = A | B`) counts as a class with each member as a base:
    a body of any of them is accepted."""
    found: dict[str, tuple[set[str], list[str], set[str]]] = {}
    for tree in trees.values():
        for node in _defs(tree):
            if (members := _union_alias(node)) is not None:
                found[members[0]] = (set(), members[1:], set())
            elif isinstance(node, ast.ClassDef):
                fields, methods = set(), set()
                for item in node.body:
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        fields.add(item.target.id)
                    elif isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                        methods.add(item.name)
                bases = [ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases]
                known = found.get(node.name, (set(), [], set()))
                found[node.name] = (known[0] | fields, known[1] + bases, known[2] | methods)
    return found


def _union_alias(node: ast.AST) -> list[str] | None:
    """`[alias, member, …]` for `Alias: TypeAlias = A | B | …`, else None."""
    if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
        return None
    if ast.unparse(node.annotation).rsplit(".", 1)[-1] != "TypeAlias" or node.value is None:
        return None
    members = [m.strip() for m in ast.unparse(node.value).split("|")]
    return [node.target.id, *(m.rsplit(".", 1)[-1] for m in members if m.replace(".", "").isidentifier())]


def fields_of(name: str, known: Classes) -> set[str]:
    """A class's annotated fields, its known bases' included."""
    seen, todo, fields = set(), [name], set()
    while todo:
        current = todo.pop()
        if current in seen or current not in known:
            continue
        seen.add(current)
        fields |= known[current][0]
        todo += known[current][1]
    return fields


def handlers(trees: Trees, known: Classes) -> dict[tuple[str, str], Handler]:
    """Every FastAPI route vLLM defines by decorator (`@router.post("/pause")`)."""
    found: dict[tuple[str, str], Handler] = {}
    for name, tree in trees.items():
        if not name.startswith("vllm/entrypoints/"):
            continue
        for node in _defs(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for decorator in node.decorator_list:
                route = _route(decorator)
                if route is not None and route in found:
                    found[route].also.append(name)
                elif route is not None:
                    found[route] = _handler(route, name, node, known)
    return found


def _route(decorator: ast.expr) -> tuple[str, str] | None:
    if not (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)):
        return None
    verb = decorator.func.attr.upper()
    first = decorator.args[0] if decorator.args else None
    if verb in ("GET", "POST", "PUT") and isinstance(first, ast.Constant) and isinstance(first.value, str):
        return verb, first.value
    return None


def _handler(
    route: tuple[str, str],
    file: str,
    node: Function,
    known: Classes,
) -> Handler:
    handler = Handler(*route, file, doc=ast.get_docstring(node) or "")
    for arg in node.args.args + node.args.kwonlyargs:
        annotation = ast.unparse(arg.annotation) if arg.annotation is not None else ""
        default = _default_of(node, arg)
        models = set().union(*(fields_of(word, known) for word in re.findall(r"\w+", annotation)))
        if "Body(" in annotation + default:
            handler.body.add(arg.arg)
        elif models:
            handler.body |= models
        else:
            handler.query.add(arg.arg)
    for inner in ast.walk(node):
        read = isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute) and inner.args
        if read and inner.func.attr in ("get", "getlist") and isinstance(inner.args[0], ast.Constant):
            key = inner.args[0].value
            from_query = ast.unparse(inner.func.value).endswith("query_params")
            (handler.query if from_query else handler.body).add(str(key))
        elif isinstance(inner, ast.Subscript) and isinstance(inner.slice, ast.Constant):
            handler.body.add(str(inner.slice.value))
        if isinstance(inner, ast.Constant) and isinstance(inner.value, str):
            handler.constants.add(inner.value)
    return handler


def _default_of(node: Function, arg: ast.arg) -> str:
    """The default's source (`Query(False)`, `Body(...)`), or ""."""
    positional = node.args.args
    if arg in positional:
        offset = len(positional) - len(node.args.defaults)
        at = positional.index(arg) - offset
        return ast.unparse(node.args.defaults[at]) if at >= 0 else ""
    default = node.args.kw_defaults[node.args.kwonlyargs.index(arg)]
    return ast.unparse(default) if default is not None else ""


def check(release: str, sources: Mapping[str, str], calls: list[Call] | None = None) -> list[str]:
    """What moved in `release` that the daemon or its extension uses: one line each."""
    problems = []
    trees = parsed(sources)
    known = classes(trees)
    routes = handlers(trees, known)
    for call in calls if calls is not None else daemon_calls():
        where = f"(engine/client.py:{call.line})"
        if call.path in NOT_VLLMS:
            continue
        handler = routes.get((call.method, call.path))
        if handler is None:
            problems.append(f"vLLM {release}: no {call.method} {call.path} route {where}")
            continue
        if handler.also:
            problems.append(
                f"vLLM {release}: {call.method} {call.path} is in {handler.file} and {handler.also} {where}"
            )
        for sent, taken, kind in (
            (call.params, handler.query, "query parameter"),
            (call.body, handler.body, "JSON key"),
        ):
            problems += [
                f"vLLM {release}: {call.method} {call.path} ({handler.file}) takes no {kind} {name!r} {where}"
                for name in sent
                if name not in taken
            ]
    text = "\n".join(sources.values())
    problems += [f"vLLM {release}: no /metrics gauge {m}" for m in SCHEDULER_METRICS if m not in text]
    problems += _behaviour(release, routes, trees, text)
    problems += _pause_modes(release, sources)
    problems += _worker(release, trees, known)
    return problems


def _behaviour(release: str, routes: Mapping[tuple[str, str], Handler], trees: Trees, text: str) -> list[str]:
    """What the daemon believes each release does (`engine/capabilities.py`), read in its source:
    from which release a `wait`/`abort` pause answers 503, and the KV-cache loan's refusal."""
    problems = []
    parsed, pause = capabilities.release(release), routes.get(("POST", "/pause"))
    if parsed is not None and pause is not None:
        says = "503" in pause.doc
        if says != (parsed[:2] >= capabilities.PAUSE_REJECTS_FROM):
            problems.append(
                f"vLLM {release}: /pause {'answers' if says else 'no longer answers'} new requests with 503, "
                f"unlike what the daemon expects (capabilities.PAUSE_REJECTS_FROM)"
            )
    if parsed is not None and parsed[:2] >= capabilities.LOAN_FROM:
        if not _raised_with(trees, "Updating weights layer by layer needs about"):
            problems.append(
                f"vLLM {release}: no error raised saying 'Updating weights layer by layer needs about …' "
                "(capabilities.refused: a refusal would blame the checkpoint)"
            )
        if capabilities.LOAN_REFUSED not in text:
            problems.append(
                f"vLLM {release}: the loan's refusal no longer says {capabilities.LOAN_REFUSED!r}"
            )
        if not re.search(r'"VLLM_RELOAD_MODE".*\n?.*"direct"', text):
            problems.append(
                f"vLLM {release}: envs.py has no VLLM_RELOAD_MODE=direct (engine.reload_mode_direct)"
            )
        info = routes.get(("GET", "/server_info"))
        if info is not None and "vllm_env" not in info.body | info.constants:
            problems.append(f"vLLM {release}: /server_info answers no vllm_env (engine.reload_mode_direct)")
    return problems


def _raised_with(trees: Trees, words: str) -> bool:
    """Some function both holds `words` in a string and raises."""
    for tree in trees.values():
        for node in _defs(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                inner = list(ast.walk(node))
                says = any(isinstance(n, ast.Constant) and words in str(n.value) for n in inner)
                if says and any(isinstance(n, ast.Raise) for n in inner):
                    return True
    return False


def _pause_modes(release: str, sources: Mapping[str, str]) -> list[str]:
    """The modes `[engine] pause_mode` offers must be vLLM's `PauseMode`."""
    wanted = ("keep", "wait", "abort")
    for text in sources.values():
        if found := re.search(r"^PauseMode\s*=\s*Literal\[([^\]]*)\]", text, re.M):
            missing = [m for m in wanted if f'"{m}"' not in found.group(1)]
            return [f"vLLM {release}: PauseMode has no {m!r} ([engine] pause_mode)" for m in missing]
    return [f"vLLM {release}: no PauseMode literal found ([engine] pause_mode)"]


def _worker(release: str, trees: Trees, known: Classes) -> list[str]:
    """What `extension/worker.py` uses: the worker's `reload_weights(weights_iterator=…,
    weights_path=…)` (vLLM's own, or each model runner's it passes them on to), the model
    runner's `get_model`, and the config fields it and the daemon read."""
    problems = []
    worker = _function(trees.get(WORKER), "Worker", "reload_weights")
    if worker is None:
        problems.append(f"vLLM {release}: Worker.reload_weights is gone ({WORKER}; extension/worker.py)")
    else:
        runners = [] if _accepts(worker) else _all_functions(trees, "vllm/v1/worker/", "reload_weights")
        for file, function in [(WORKER, worker), *runners]:
            if not _accepts(function) and not (function.args.vararg and function.args.kwarg):
                problems.append(
                    f"vLLM {release}: {file}: reload_weights takes no weights_iterator/weights_path "
                    "(extension/worker.py)"
                )
    problems += _probe(release, trees)
    if not any("get_model" in methods for _, _, methods in known.values()):
        problems.append(f"vLLM {release}: no model runner has get_model (extension/worker.py)")
    for cls, names in CONFIG_FIELDS.items():
        have = fields_of(cls, known)
        problems += [f"vLLM {release}: {cls} has no field {n!r}" for n in names if n not in have]
    return problems


def _probe(release: str, trees: Trees) -> list[str]:
    """The probe inside the pause (`extension/probe.py`): `GPUModelRunner._dummy_run(num_tokens,
    …)` with the keywords it passes. A release without it (0.34 rewrote its runners) gets no
    probe, which the extension says (`engine.probe_unavailable`): no problem here; one with it
    changed would be probed wrongly."""
    runner = _function(trees.get(RUNNER), "GPUModelRunner", "_dummy_run")
    where = f"({RUNNER}; extension/probe.py)"
    if runner is None:
        return []
    if [a.arg for a in runner.args.args[:2]] != ["self", "num_tokens"]:
        return [f"vLLM {release}: GPUModelRunner._dummy_run takes no leading num_tokens {where}"]
    names = {a.arg for a in runner.args.args + runner.args.kwonlyargs}
    problems = [
        f"vLLM {release}: _dummy_run takes no {k!r} {where}" for k in PROBE_KEYWORDS if k not in names
    ]
    return problems + _lora_probe(release, trees)


def _lora_probe(release: str, trees: Trees) -> list[str]:
    """With LoRA on, the probe maps the pass's tokens itself (`_set_active_loras`) in place of
    `maybe_dummy_run_with_lora`, and an adapter probe loads a `LoRARequest` of its own."""
    where = "(extension/probe.py)"
    problems = []
    for method, leading in LORA_METHODS.items():
        found = _function(trees.get(LORA_MIXIN), "LoRAModelRunnerMixin", method)
        args = [a.arg for a in found.args.args[1 : 1 + len(leading)]] if found else None
        if args != list(leading):
            problems.append(f"vLLM {release}: LoRAModelRunnerMixin.{method} takes no leading {leading}")
    file, cls, fields = LORA_REQUEST
    tree = trees.get(file)
    have = {
        n.target.id
        for node in (_defs(tree) if tree is not None else ())
        if isinstance(node, ast.ClassDef) and node.name == cls
        for n in node.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    problems += [f"vLLM {release}: {cls} has no field {f!r} ({file})" for f in fields if f not in have]
    return [f"{problem} {where}" for problem in problems]


def _accepts(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    names = {a.arg for a in function.args.args + function.args.kwonlyargs}
    return {"weights_iterator", "weights_path"} <= names


def _function(tree: ast.Module | None, cls: str, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    for node in _defs(tree) if tree is not None else ():
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name == name:
                    return item
    return None


def _all_functions(trees: Trees, prefix: str, name: str) -> list[tuple[str, Function]]:
    return [
        (file, node)
        for file, tree in trees.items()
        if file.startswith(prefix) and file != WORKER
        for node in _defs(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name
    ]


FILE = re.compile(r"vllm-(?P<version>[^-]+)-(?P<tags>.+)\.whl")
X86 = re.compile(r"cp\d+-abi3-manylinux[^-]*_x86_64")


@dataclass(frozen=True)
class Wheel:
    release: str
    url: str
    size: int
    sha256: str


def wheels(http: httpx.Client, index: str = INDEX) -> tuple[list[Wheel], list[str]]:
    """The x86_64 wheel of every final release (post-releases included) from the oldest the
    daemon supports to the newest; and the releases in that range with no such wheel."""
    answer = http.get(index, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    answer.raise_for_status()
    found: dict[Version, Wheel | None] = {}
    for file in answer.json()["files"]:
        name = FILE.fullmatch(file["filename"])
        if name is None or file.get("yanked"):
            continue
        try:
            version = Version(name["version"])
        except InvalidVersion:
            continue
        if version.is_prerelease or version.is_devrelease or version.release[:3] < capabilities.OLDEST:
            continue
        if X86.fullmatch(name["tags"]):
            found[version] = Wheel(str(version), file["url"], file["size"], file["hashes"]["sha256"])
        else:
            found.setdefault(version, None)
    missing = [str(v) for v, wheel in sorted(found.items()) if wheel is None]
    return [wheel for _, wheel in sorted(found.items()) if wheel is not None], missing


def sources_of(http: httpx.Client, wheel: Wheel, cache: Path = CACHE) -> tuple[dict[str, str], Fetched]:
    return read_members(http, wheel.url, wheel.size, wheel.sha256, WANTED, cache, SELECTION)


def main() -> int:
    started, failed = time.perf_counter(), 0
    with httpx.Client(timeout=60, follow_redirects=True) as http:
        found, missing = wheels(http)
        failed += len(missing)
        for release in missing:
            print(f"{release}: FAILS (no x86_64 wheel to read)")
        for wheel in found:
            sources, fetched = sources_of(http, wheel)
            problems = check(wheel.release, sources)
            failed += bool(problems)
            how = "cached" if fetched.cached else f"{fetched.requests} requests, {fetched.bytes / 1e6:.1f} MB"
            print(f"{wheel.release}: {'FAILS' if problems else 'ok'} ({how}, {fetched.seconds:.2f} s)")
            for problem in problems:
                print(f"  {problem}")
    print(f"{time.perf_counter() - started:.1f} s in all")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
