"""`[adapters]`: LoRA adapters, a source of versions of their own (`sources.adapters`)."""

from __future__ import annotations

from pydantic import Field

from .base import ConfigPath, Location, Section, is_remote


class AdaptersConfig(Section):
    """LoRA adapters: `<root>/<adapter>/<version>/` as PEFT writes them, each version gated,
    loaded under the adapter's name, canaried and rolled back on its own."""

    root: Location | None = None
    """None: adapters are not managed. A local directory, or an object-store prefix (`s3://`,
    `gs://`, `az://`)."""
    endpoint_url: str | None = None
    """The object store's endpoint (as `source.endpoint_url`); default `source.endpoint_url`
    when the source is on the same kind of store, else the store's own variables (`""`: those
    variables, whatever the source's)."""
    copies: ConfigPath | None = None
    """Where verified copies live, the engine's user able to read them; default `<state.dir>/adapters`."""
    max_rank: int | None = Field(None, ge=1, le=4096)
    """At most this `r` (None: the engine's `--max-lora-rank`, from `/server_info`; 16 where
    it does not say). Set, the lower of this and the engine's."""
    interval: float | None = Field(None, gt=0, le=3600)
    """How often the root is looked at: default 1 s for a local root, 10 s for an object store
    (a LIST each time)."""
    unload_removed: bool = False
    """Unload an adapter whose folder is gone (else it is served on from its copy)."""

    @property
    def remote(self) -> bool:
        return is_remote(self.root)

    @property
    def look_interval(self) -> float:
        return self.interval or (10.0 if self.remote else 1.0)
