"""The one error tree of vllm-reloader.

Third-party exceptions (httpx, OSError from the filesystem, pydantic) are translated where
they enter, so the rest of the daemon only ever catches these::

    ReloaderError
    ├── ConfigError            bad or unreadable config file (the CLI exits 2, one line)
    ├── PublishError           `publish` cannot place a checkpoint (nothing half-written stays)
    ├── StateError             the state file cannot be read or written
    ├── DownloadError          the local side of a download: no space, cannot write the cache
    ├── SourceError            the object store: unreachable, denied, no such bucket (retried)
    │   └── ObjectChanged      an object's ETag changed under a download (start again)
    └── EngineError            anything between us and the vLLM engine
        ├── EngineUnavailable  no answer: refused, reset, timed out (retry with backoff)
        └── EngineCallFailed   the engine answered, with an error status or a bad body

A gate verdict is *not* an exception: `ready` / `pending` / `rejected` are data
(see `gate.Verdict`), because a bad checkpoint is an expected input, not a failure.
"""


class ReloaderError(Exception):
    """Base of every error the daemon raises on purpose."""


class ConfigError(ReloaderError):
    """The config file is missing, unparsable or invalid; the message names the key."""


class PublishError(ReloaderError):
    """A checkpoint could not be published into the root."""


class StateError(ReloaderError):
    """The state file could not be read or written."""


class DownloadError(ReloaderError):
    """A download cannot be placed in the cache (short of space, disk errors)."""


class SourceError(ReloaderError):
    """The object store refused or did not answer; the message is one line with its code."""


class ObjectChanged(SourceError):
    """An object was replaced while it was being downloaded (the If-Match failed)."""


class EngineError(ReloaderError):
    """A call to the engine did not do what was asked."""

    def __init__(self, message: str, *, endpoint: str) -> None:
        super().__init__(message)
        self.endpoint = endpoint


class EngineUnavailable(EngineError):
    """The engine did not answer at all (connection refused, reset, or timed out)."""


class EngineCallFailed(EngineError):
    """The engine answered, but with an error status or a body we cannot use."""

    def __init__(self, message: str, *, endpoint: str, status: int | None = None) -> None:
        super().__init__(message, endpoint=endpoint)
        self.status = status
