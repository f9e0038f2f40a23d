"""Which convention says a checkpoint is whole: the writers' files and their order, no I/O.

`completeness` reads a checkpoint by the convention `resolved` picks; `auto` picks whichever
the files show (see `completeness`'s docstring for what each one requires).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import Literal

from .files import INDEX_NAME, SINGLE_NAME, WEIGHT_SUFFIX, is_top_level_shard
from .manifest import MANIFEST_NAME, MAX_STEP

Mode = Literal["auto", "manifest", "hf-index", "marker"]
# Besides the weights, the small files a serving directory needs (config, tokenizer, chat
# template). A trainer's optimizer state and RNG files are neither checked nor downloaded.
METADATA_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken")
TRAINER_STATE = "trainer_state.json"
"""HF Trainer writes it last into `checkpoint-N`, after the weights, optimizer and RNG state."""
TRAINER_FILES = ("optimizer.pt", "scheduler.pt", "rng_state.pth")
"""Trainer's checkpoint files written before `trainer_state.json` (with `rng_state_<rank>.pth`
on several GPUs): their presence means it will come. Not `training_args.bin`, which
`save_model()` also writes, with no trainer_state.json ever after."""
DOWNLOADING_SUFFIXES = (".aria2", ".part", ".partial", ".incomplete", ".tmp", ".crdownload")
"""A downloader's files beside a checkpoint it has not finished (some preallocate the target)."""
CONTENT_METADATA = (INDEX_NAME, "config.json")
"""`auto`: besides the weights, the files whose sizes are part of a foreign checkpoint's
content (a rejection for a bad config.json or index is retried once either is fixed)."""
UNFINISHED_SUFFIX = "-unfinished"
"""NeMo writes `<name>-unfinished` next to a checkpoint it has not finished: `<name>` waits."""


@dataclass(frozen=True)
class Convention:
    mode: Mode = "auto"
    markers: tuple[str, ...] = ("commit_success.txt", "_SUCCESS", "COMPLETE")
    settle_seconds: float = 30.0
    manifest_grace: float = 10.0
    """How long an unparsable manifest or index may be mid-write before it is rejected."""
    converter: bool = False
    """A converter command is configured: a trainer's own format, once whole, is converted."""

    def with_mode(self, mode: Mode) -> Convention:
        return replace(self, mode=mode)


def wanted(name: str, convention: Convention) -> bool:
    """Is this top-level file part of a foreign writer's checkpoint, as far as serving goes?"""
    return name.endswith((WEIGHT_SUFFIX, *METADATA_SUFFIXES)) or name in convention.markers


def resolved(names: Collection[str], convention: Convention) -> Convention:
    """`auto`: the convention these files follow (`auto` itself while none shows yet)."""
    if convention.mode != "auto":
        return convention
    if MANIFEST_NAME in names:
        return convention.with_mode("manifest")
    if any(name in names for name in convention.markers):
        return convention.with_mode("marker")
    if TRAINER_STATE in names:
        return replace(convention, mode="marker", markers=(TRAINER_STATE,))
    if _trainer_unfinished(names) or _downloading(names):
        return convention
    if INDEX_NAME in names or SINGLE_NAME in names:  # a lone file settles for settle_seconds
        return convention.with_mode("hf-index")
    return convention


def _trainer_unfinished(names: Collection[str]) -> bool:
    trainer = any(n in TRAINER_FILES or (n.startswith("rng_state_") and n.endswith(".pth")) for n in names)
    return trainer and TRAINER_STATE not in names


def _downloading(names: Collection[str]) -> str | None:
    return next((name for name in sorted(names) if name.endswith(DOWNLOADING_SUFFIXES)), None)


def signal_name(names: Collection[str], convention: Convention) -> str | None:
    """The file whose arrival says a checkpoint is (or may be) complete, if it is there."""
    convention = resolved(names, convention)
    if convention.mode == "manifest":
        order_: tuple[str, ...] = (MANIFEST_NAME,)
    elif convention.mode == "hf-index":
        order_ = (INDEX_NAME, SINGLE_NAME)
    elif convention.mode == "marker":
        order_ = convention.markers
    else:
        order_ = ()
    return next((name for name in order_ if name in names), None)


def unsignalled_reason(names: Collection[str], convention: Convention) -> str:
    """Why a checkpoint with no `signal_name` file waits (said as `describe` says it)."""
    if convention.mode == "auto":
        return waiting_reason(names)
    if convention.mode == "manifest":
        return f"no {MANIFEST_NAME} yet"
    if convention.mode == "hf-index":
        return f"no {INDEX_NAME} or {SINGLE_NAME} yet"
    return f"no completion marker ({', '.join(convention.markers)}) yet"


DCP_METADATA = ".metadata"
"""torch DCP's `FileSystemWriter` renames it into place after every rank's `.distcp` file."""
RANK_SHARD = re.compile(r"shard-\d{5}-model-\d{5}-of-\d{5}\.safetensors")
"""`HuggingFaceStorageWriter(save_distributed=True)`'s per-rank files: each holds a slice."""
PUBLISH = "publish the output with `vllm-reloader publish` (docs/trainers.md)"
DEEPSPEED_PREFIXES = ("mp_rank_", "zero_pp_rank_", "bf16_zero_pp_rank_")
"""DeepSpeed's `global_stepN/` files: model states and ZeRO optimizer partitions."""
DEEPSPEED_TRACKER = "latest"
"""DeepSpeed writes the tag of the checkpoint it finished into `<save_dir>/latest`, last."""
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
"""Megatron writes the iteration it finished into `<save_dir>/<this>`, after `iter_N/`."""
MEGATRON_METADATA = "metadata.json"
"""Megatron's `torch_dist` format writes it into `iter_N/` after the DCP files."""
MEGATRON_LEGACY_FILE = "mp_rank_00/model_optim_rng.pt"
"""Megatron's legacy format: one `mp_rank_XX/` folder of pickled state per model-parallel rank."""
TRACKERS = (DEEPSPEED_TRACKER, MEGATRON_TRACKER)
_TRAILING_NUMBER = re.compile(r"(\d+)$")


def name_step(name: str) -> int | None:
    """The step a converted trainer's checkpoint gets: the number its name ends in
    (`global_step100`, `iter_0000100`, `step-100`)."""
    found = _TRAILING_NUMBER.search(name)
    return int(found[1]) if found else None


_STEP_NAME = re.compile(r"(?:checkpoint|step|global_step|iter)[-_]?(\d+)", re.IGNORECASE)


def name_says_step(name: str) -> int | None:
    """The step a `checkpoint-N` / `step-N` / `global_stepN` / `iter_N` name says (Trainer
    names its checkpoints after `global_step`), at most the manifest's bound."""
    named = _STEP_NAME.fullmatch(name)
    return int(named[1]) if named and len(named[1]) <= 16 and int(named[1]) <= MAX_STEP else None


def trainer_step(name: str, trainer_state: bytes) -> int | None:
    """The step a trainer gave a servable checkpoint with no manifest of ours: the number a
    `checkpoint-N` / `step-N` name ends in, else Trainer's `global_step` in
    trainer_state.json (`b""`: none). None when neither says (a `save_model` output): it
    orders by name, before every stepped version."""
    if (named := name_says_step(name)) is not None:
        return named
    try:
        found = json.loads(trainer_state) if trainer_state else None
    except (ValueError, RecursionError):  # half written, or hostile
        found = None
    step = found.get("global_step") if isinstance(found, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) and 0 <= step <= MAX_STEP else None


_ITERATION = re.compile(r"iter_0*(\d+)")


@dataclass(frozen=True)
class Foreign:
    """A trainer's own format, which vLLM cannot read."""

    format: Literal["torch-dcp", "megatron", "deepspeed", "hf-per-rank"]
    complete: bool
    """Whole by its trainer's own rule: a converter may run on it."""
    reason: str
    """What it is and what to do, as a pending checkpoint's one line."""


def _tracked(name: str, trackers: Mapping[str, str], tracker: str) -> bool | None:
    """Does the root's tracker name this checkpoint? None: there is no such tracker."""
    value = trackers.get(tracker)
    if value is None:
        return None
    if tracker == DEEPSPEED_TRACKER:
        return value.strip() == name
    found = _ITERATION.fullmatch(name)
    return found is not None and value.strip().isdigit() and int(value) == int(found[1])


def _said(kind: str, complete: bool, state: str, converter: bool, instead: str) -> str:
    """A foreign checkpoint's one line: what it is, how far, and what happens or is to be done."""
    if converter:
        return f"a {kind} checkpoint ({state}): " + (
            "being converted by [source] converter"
            if complete
            else "[source] converter runs on it once whole"
        )
    return (
        f"a {kind} checkpoint ({state}), which vLLM cannot read: set [source] converter to convert "
        f"it (docs/trainers.md), or {instead}"
    )


def foreign(
    name: str, names: Collection[str], *, trackers: Mapping[str, str] = {}, legacy: bool = False,
    converter: bool = False,
) -> Foreign | None:  # fmt: skip
    """What a trainer's own format is, whether it is whole by its trainer's rule, and what to do
    (`converter`: one is configured). `trackers`: the root's tracker files by name (their text);
    `legacy`: Megatron's `MEGATRON_LEGACY_FILE` is there."""
    manual = f"convert it to safetensors and {PUBLISH}"
    if any(n.endswith(".distcp") for n in names) or legacy:
        megatron = legacy or MEGATRON_METADATA in names or MEGATRON_TRACKER in trackers
        tracked = _tracked(name, trackers, MEGATRON_TRACKER)
        if legacy:
            complete, rule = tracked is True, f"{MEGATRON_TRACKER} names it"
        elif megatron:
            complete = DCP_METADATA in names and MEGATRON_METADATA in names and tracked is not False
            rule = f"{MEGATRON_METADATA} is there and {MEGATRON_TRACKER} names it"
        else:
            complete, rule = DCP_METADATA in names, f"{DCP_METADATA} is renamed in"
        kind = "Megatron legacy" if legacy else "Megatron torch DCP" if megatron else "torch DCP"
        instead = (
            manual
            if megatron
            else f"save with HuggingFaceStorageWriter (TorchTitan: last_save_in_hf), or {manual}"
        )
        state = "complete" if complete else f"being written: whole once {rule}"
        return Foreign(
            "megatron" if megatron else "torch-dcp",
            complete,
            _said(kind, complete, state, converter, instead),
        )
    if any(RANK_SHARD.fullmatch(n) for n in names):
        return Foreign(
            "hf-per-rank",
            False,
            "HuggingFaceStorageWriter's per-rank shards (save_distributed without consolidation), "
            "each a slice of the tensors: save with enable_consolidation=True",
        )
    if any(n.startswith(DEEPSPEED_PREFIXES) and n.endswith(".pt") for n in names):
        complete = _tracked(name, trackers, DEEPSPEED_TRACKER) is True
        state = "complete" if complete else f"being written: whole once {DEEPSPEED_TRACKER} names it"
        instead = f"run the zero_to_fp32.py saved beside it with --safe_serialization, then {PUBLISH}"
        return Foreign("deepspeed", complete, _said("DeepSpeed", complete, state, converter, instead))
    return None


def waiting_reason(names: Collection[str]) -> str:
    """Why an `auto` checkpoint waits, and what would end the wait."""
    if downloading := _downloading(names):
        return f"{downloading} is there: a download into it has not finished"
    if _trainer_unfinished(names):
        return f"a Trainer checkpoint without its {TRAINER_STATE} yet (Trainer writes it last)"
    if found := foreign("", names):
        return found.reason
    weights = [name for name in names if is_top_level_shard(name)]
    if weights:
        return (
            f"{len(weights)} .safetensors file(s) but no {INDEX_NAME} yet (HF writes it after the "
            "shards); a checkpoint written another way: publish it with `vllm-reloader publish`"
        )
    if any(name.endswith((".bin", ".pt", ".pth")) for name in names):
        return (
            "no .safetensors weights (.bin/.pt only): save with safetensors "
            "(save_pretrained(..., safe_serialization=True)) or convert them"
        )
    return (  # a trainer's save begins so too: not told to publish what it is still writing
        f"no {MANIFEST_NAME}, {INDEX_NAME}, {SINGLE_NAME} or completion marker yet (still being "
        "written?); a checkpoint written another way: publish it with `vllm-reloader publish`"
    )
