"""The config's sections and the one frozen `Config`: every key, its default and its checks.

Every section rejects unknown keys, so a typo fails loudly at start instead of silently
falling back to a default.
"""

from __future__ import annotations

import shutil
import socket
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)

from .adapters import AdaptersConfig
from .base import ConfigPath, Location, Section, is_remote
from .node import NodeConfig

DEFAULT_MARKERS = ("commit_success.txt", "_SUCCESS", "COMPLETE")
API_KEY_ENV = "VLLM_API_KEY"
"""vLLM's own variable for `--api-key`: the daemon reads it too when no key file is set."""


class SourceConfig(Section):
    path: Annotated[Location, Field(min_length=1)]
    """A local checkpoint root, an object-store prefix (`s3://`, `gs://`, `az://`), or a shared
    root (`file:///mnt/checkpoints`) copied into the cache like one."""
    endpoint_url: str | None = None
    """Object store endpoint (an S3-compatible store); overrides `AWS_ENDPOINT_URL`."""
    poll: bool = False
    """Poll instead of inotify. Turned on by itself for NFS/CIFS/FUSE mounts."""
    poll_interval: float | None = Field(None, gt=0)
    """Default 2 s for a polled local root, 10 s for a store (a LIST, or a walk of a shared root)."""
    rescan_interval: float = Field(30.0, gt=0)
    """Full rescan even with inotify: its queue can overflow."""
    pending_recheck_interval: float = Field(1.0, gt=0)
    """How often pending candidates are re-gated when no event arrives."""
    manifest_grace: float = Field(10.0, ge=0)
    """How long an unparsable manifest may be mid-write before it is rejected."""
    ignore: tuple[str, ...] = ()
    """More glob patterns of names that are never candidates, on top of `source.ALWAYS_IGNORED`."""
    completeness: Literal["auto", "manifest", "hf-index", "marker"] = "auto"
    """How a checkpoint says it is whole: `auto` takes whichever of the others it shows (our
    manifest, a marker, Trainer's trainer_state.json, HF's index, a lone model.safetensors
    whose header accounts for its size); `manifest`, `hf-index` and `marker` take only that."""
    markers: tuple[str, ...] = DEFAULT_MARKERS
    """`marker` and `auto` modes: any of these files in the checkpoint directory marks it complete."""
    settle_seconds: float = Field(30.0, ge=0)
    """`hf-index` mode, single-file checkpoints: how long the directory must be quiet."""
    download_concurrency: int = Field(8, ge=1, le=256)
    part_size: int = Field(16 << 20, ge=4096)
    """Bytes per ranged GET; also what a resumed download can lose at most per part in flight."""
    converter: tuple[str, ...] = ()
    """A command (argv) run once on each checkpoint in a trainer's own format (torch DCP,
    Megatron, DeepSpeed) that its trainer's rule says is whole: `{input}` is its directory,
    `{output}` a new directory to write safetensors (and config.json) into, `{format}` one of
    torch-dcp/megatron/deepspeed, `{name}` its name. The output is placed in the root as
    `NAME@<fingerprint>` and gated like any checkpoint; a failure rejects that content."""
    converter_timeout: float = Field(3600.0, gt=0)
    """A converter still running after this many seconds is killed (and the content rejected)."""

    @field_validator("ignore", "markers", "converter", mode="before")
    @classmethod
    def _tuple_from_list(cls, value: object) -> object:
        return tuple(value) if isinstance(value, list) else value

    @model_validator(mode="after")
    def _converter_runs_here(self) -> SourceConfig:
        if not self.converter:
            return self
        if self.remote:
            raise ValueError(
                "converter: works on a local root only (an object store's files are not downloaded)"
            )
        if self.completeness != "auto":
            raise ValueError(
                f'converter: needs completeness = "auto" (with "{self.completeness}" no trainer\'s own '
                "format is ever whole)"
            )
        if not any("{output}" in arg for arg in self.converter):
            raise ValueError("converter: no {output} argument: where would it write the safetensors?")
        if shutil.which(self.converter[0]) is None:
            raise ValueError(f"converter: {self.converter[0]!r} is not an executable (give its full path)")
        return self

    @property
    def remote(self) -> bool:
        return is_remote(self.path)

    @property
    def interval(self) -> float:
        return self.poll_interval or (10.0 if self.remote else 2.0)


class GateConfig(Section):
    verify_digests: bool = True
    check_finite: bool = True
    """Reject a checkpoint with NaN or Inf in any float tensor (off: no scan anywhere)."""
    scan: Literal["auto", "host", "engine", "both"] = "auto"
    """Where the NaN/Inf scan runs: `host` (the gate reads every value), `engine` (each rank
    checks its loaded parameters inside the pause, with the probe: a GPU reads its memory
    ~100x faster than 2 host cores read the files; the gate then only hashes), `both`, or
    `auto`: `engine` once every engine ran a probe on an accelerator, `host` for CPU engines
    (there the scan would lengthen the pause clients wait through). An engine that cannot
    scan (no worker extension, `canary.probe` off) always gets host-scanned weights."""
    digest_threads: int = Field(4, ge=1, le=64)
    max_header_bytes: int = Field(256 << 20, ge=1)
    """The safetensors headers of one checkpoint's shards together, in bytes, as their 8-byte
    prefixes declare them: over it the checkpoint is rejected before any header is read. The
    largest real checkpoints (1T-parameter MoE, ~100-300k tensors at ~140 bytes of JSON each)
    have ~15-40 MB of headers in all."""
    max_tensors: int = Field(1_000_000, ge=1)
    """Tensors listed by one checkpoint's shards together, counted before the headers are
    parsed and again while they are (each costs ~0.4-1 KB of memory while the gate holds it):
    the largest real checkpoints list ~100-300k."""


class EngineConfig(Section):
    url: str
    """The engine, or with `urls` the first of them: the canary engine."""
    urls: tuple[str, ...] = ()
    """Several engines on this host (instead of `url`): one gate, then a rolling update, the
    first engine first (the canary engine), at most `max_unavailable` paused at a time."""
    max_unavailable: int = Field(1, ge=1)
    """Engines paused or reloading at the same moment."""
    pause_mode: Literal["keep", "wait", "abort"] = "keep"
    strategy: Literal["inplace", "sleep", "auto"] = "auto"
    """`sleep` wraps the reload in sleep level 2 / wake_up (engines with --enable-sleep-mode);
    `auto` uses it when `/server_info` says sleep mode is on."""
    timeout: float = Field(10.0, gt=0)
    """Deadline for each quick call (pause, resume, reset, version, info): the whole exchange,
    however slowly an engine answers, not each read; `pause_timeout`/`reload_timeout` alike."""
    pause_timeout: float = Field(120.0, gt=0)
    """`wait` mode waits for in-flight requests, so pausing may take longer."""
    reload_timeout: float = Field(600.0, gt=0)
    retry_initial: float = Field(0.5, gt=0)
    retry_max: float = Field(30.0, gt=0)
    check_interval: float = Field(5.0, gt=0)
    """How often an idle daemon asks the engine for its weight version, to notice a restart."""
    baseline: ConfigPath | None = None
    """A directory with the served model's safetensors, whose layout every candidate must match.
    Default: the engine's startup model (from `/server_info`; a hub id is looked up in the
    Hugging Face cache). Set it where the daemon cannot read that."""
    api_key_file: ConfigPath | None = None
    """A file holding the engine's `--api-key`, readable by the daemon only (a systemd
    credential: `LoadCredential=`). Without it, `VLLM_API_KEY` from the environment."""
    api_key: SecretStr | None = None
    """Never from the config file (it would be readable by anyone who may read the config):
    `parse` fills it in from `api_key_file` or `VLLM_API_KEY`. SecretStr keeps it out of reprs."""

    @field_validator("api_key", mode="before")
    @classmethod
    def _not_from_the_file(cls, value: object) -> object:
        if value is not None and not isinstance(value, SecretStr):
            raise ValueError(f"not allowed in the config file; use engine.api_key_file or {API_KEY_ENV}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _url_or_urls(cls, data: Any) -> Any:
        """`url` for one engine, `urls` for several: one of the two; `url` becomes the first."""
        if not isinstance(data, dict) or "urls" not in data:
            return data
        if "url" in data:
            raise ValueError("set url (one engine) or urls (several), not both")
        urls = data["urls"]
        if not isinstance(urls, list | tuple) or not urls:
            raise ValueError("urls: must be a non-empty list of engine URLs")
        return {**data, "url": urls[0], "urls": tuple(urls)}

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        return _engine_url(value)

    @field_validator("urls")
    @classmethod
    def _http_urls(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        urls = tuple(_engine_url(url) for url in value)
        if len(set(urls)) != len(urls):
            raise ValueError("an engine is listed twice")
        return urls

    @model_validator(mode="after")
    def _one_list(self) -> EngineConfig:
        if not self.urls:  # `url` alone: a list of one, so the daemon has one code path
            object.__setattr__(self, "urls", (self.url,))
        return self


def _engine_url(value: str) -> str:
    if not value.startswith(("http://", "https://")):
        raise ValueError(f"{value!r} must start with http:// or https://")
    return value.rstrip("/")


class CanaryConfig(Section):
    """After every reload, real requests must come back with finite logprobs, or it is rolled back."""

    enabled: bool = True
    prompts: tuple[str, ...] = Field(("The capital of France is",), min_length=1)
    max_tokens: int = Field(4, ge=1, le=256)
    timeout: float = Field(30.0, gt=0)
    min_mean_logprob: float | None = None
    """Optional floor on the mean token logprob over all prompts (e.g. -8: garbage weights
    give near-uniform logits, log(1/vocab) ≈ -11 for a 64k vocab)."""
    probe: bool = True
    """First, inside the pause: a forward pass on every rank on the prompts' tokens (engines
    with the worker extension). Logits that are not finite, or flat, are a failed load: the last
    good weights are loaded back before the resume, so no client ever reaches them. A new
    adapter version is probed with it active before it is loaded for clients."""
    probe_timeout: float = Field(60.0, gt=0)
    """For the probe's answer from every rank (the engine is paused meanwhile)."""

    @field_validator("prompts", mode="before")
    @classmethod
    def _tuple_from_list(cls, value: object) -> object:
        return tuple(value) if isinstance(value, list) else value


class StateConfig(Section):
    dir: ConfigPath
    cache_dir: ConfigPath | None = None
    """Where an object-store source downloads to; default `<dir>/cache`."""
    keep: int = Field(2, ge=0)
    """Downloaded checkpoints kept besides the serving and last good one (and a pinned one)."""
    min_free_bytes: int = Field(1 << 30, ge=0)
    """Free space that must remain in `cache_dir` after a download, or it does not start."""


class LogConfig(Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["auto", "json", "console"] = "auto"
    priority_prefix: bool = False
    """`<N>` before each line for journald (the unit turns it on with --log-priority-prefix)."""


class ControlConfig(Section):
    socket: ConfigPath | None = None
    """The control socket (mode 0660); default `<state.dir>/control.sock`."""


def _host_port(value: str | None) -> str | None:
    port = value.rpartition(":")[2] if value is not None else ""
    if value is not None and not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError("must be HOST:PORT with a port from 1 to 65535, e.g. 127.0.0.1:9400")
    return value


Listen = Annotated[str | None, AfterValidator(_host_port)]


class MetricsConfig(Section):
    listen: Listen = None
    """`HOST:PORT` for the Prometheus endpoint; off when unset."""


class ReadinessConfig(Section):
    """What a load balancer or a kubelet reads to send an engine traffic or not
    (`service.readiness`)."""

    listen: Listen = None
    """`HOST:PORT` for `GET /ready/<n>`; off when unset."""
    drain: bool = False
    """Take an engine out of rotation before its reload (not ready, then its requests in flight
    finish), and back only after its canary passed or its rollback. Needs `listen`, and a
    second engine to take the traffic: one engine alone is reloaded in place."""
    grace: float = Field(2.0, ge=0, le=600)
    """Seconds between marking it not ready and draining: at least the balancer's check interval."""
    drain_timeout: float = Field(60.0, gt=0, le=3600)
    """At most this long for its requests in flight to finish (vLLM's `/metrics`)."""

    @model_validator(mode="after")
    def _drain_needs_listen(self) -> ReadinessConfig:
        if self.drain and self.listen is None:
            raise ValueError("drain = true needs listen: the balancer reads readiness there")
        return self


class RolloutConfig(Section):
    """A fleet of hosts following one object-store prefix (`sources.verdicts`)."""

    role: Literal["canary", "follow"] = "canary"
    """`canary`: load a version as soon as it is gated, and record its canary's verdict in the
    store; `follow`: load only versions `min_canaries` canary hosts recorded as passed."""
    min_canaries: int = Field(1, ge=1, le=1000)
    host: str = Field(default_factory=socket.gethostname, min_length=1, max_length=255)
    """This host's name in the records (default: the hostname)."""

    @field_validator("host")
    @classmethod
    def _one_key_segment(cls, value: str) -> str:
        if value.startswith(".") or not all(c.isascii() and (c.isalnum() or c in "._-") for c in value):
            raise ValueError(f"{value!r}: letters, digits, '.', '_' and '-' only, not starting with '.'")
        return value


class Config(Section):
    source: SourceConfig
    engine: EngineConfig
    state: StateConfig
    gate: GateConfig = GateConfig()
    canary: CanaryConfig = CanaryConfig()
    log: LogConfig = LogConfig()
    control: ControlConfig = ControlConfig()
    metrics: MetricsConfig = MetricsConfig()
    readiness: ReadinessConfig = ReadinessConfig()
    rollout: RolloutConfig = RolloutConfig()
    adapters: AdaptersConfig = AdaptersConfig()
    node: NodeConfig = NodeConfig()

    @model_validator(mode="before")
    @classmethod
    def _a_stage_node_has_no_engine(cls, data: Any) -> Any:
        """A headless node serves no HTTP: its daemon never calls an engine, so `[engine]`
        may be left out (a placeholder that is never dialled stands in)."""
        node = data.get("node") if isinstance(data, dict) else None
        if isinstance(node, dict) and node.get("role") == "stage" and "engine" not in data:
            return {**data, "engine": {"url": "http://127.0.0.1:1"}}
        return data

    @model_validator(mode="after")
    def _nodes_need_a_store(self) -> Config:
        if self.node.role != "single" and not self.source.remote:
            raise ValueError(
                f"node.role = {self.node.role} needs source.path in a store (s3://, gs://, az://, or "
                "file:// for a shared root): each node copies its own to the same path"
            )
        if self.node.role == "stage" and self.node.leader is None:
            raise ValueError("node.role = stage needs node.leader: the leading daemon's [rollout] host")
        if self.node.role == "lead" and not self.canary.enabled:
            raise ValueError("node.role = lead records the passes its stage nodes keep: set canary.enabled")
        if self.node.role == "lead" and self.rollout.role != "canary":
            raise ValueError(
                "node.role = lead records verdicts for its stage nodes: set rollout.role = canary"
            )
        return self

    @model_validator(mode="after")
    def _engine_scan_needs_the_probe(self) -> Config:
        if self.gate.scan in ("engine", "both") and self.gate.check_finite and not self.canary.probe:
            raise ValueError(
                f'gate.scan = "{self.gate.scan}" scans inside the probe: set canary.probe = true, '
                'or gate.scan = "host"'
            )
        return self

    @model_validator(mode="after")
    def _followers_need_a_store(self) -> Config:
        if self.rollout.role == "follow" and not self.source.remote:
            raise ValueError(
                "rollout.role = follow needs source.path in a store (s3://, gs://, az://, or file:// for "
                "a shared root): the canary hosts' verdicts are read from it"
            )
        return self

    @property
    def control_socket(self) -> Path:
        return self.control.socket or self.state.dir / "control.sock"

    @property
    def adapter_copies(self) -> Path:
        return self.adapters.copies or self.state.dir / "adapters"

    @property
    def adapter_endpoint(self) -> str | None:
        """`adapters.endpoint_url`, else the source's when both are on one kind of store."""
        same_store = (
            self.source.remote
            and self.adapters.remote
            and (self.source.path.partition("://")[0] == (self.adapters.root or "").partition("://")[0])
        )
        if self.adapters.endpoint_url is not None:  # "": the store's own variables, explicitly
            return self.adapters.endpoint_url or None
        return self.source.endpoint_url if same_store else None

    @property
    def cache_dir(self) -> Path:
        return self.state.cache_dir or self.state.dir / "cache"

    @property
    def checkpoint_root(self) -> Path:
        """The local directory the engine loads from: the source itself, or the download cache."""
        return self.cache_dir / "checkpoints" if self.source.remote else Path(self.source.path)
