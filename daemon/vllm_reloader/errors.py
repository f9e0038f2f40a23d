"""The one error tree of vllm-reloader.

Third-party exceptions (httpx, obstore, OSError from the filesystem, pydantic, json) are
translated where they enter, so the rest of the code only ever catches these::

    ReloaderError
    ├── ConfigError            bad or unreadable config file (the CLI exits 2, one line)
    │   ├── EngineNotSetUp     the engine lacks what the daemon needs: dev mode, a release in
    │   │                      range, a readable layout baseline (the daemon exits 2, one line)
    │   └── AlreadyRunning     another daemon holds the state directory (exit 2, naming its pid)
    ├── CheckpointError        a checkpoint's own bytes say what it is not (becomes a verdict)
    │   ├── NotJSONYet         a manifest or HF index is not whole JSON: may still be written
    │   ├── ManifestInvalid    whole JSON that breaks the manifest schema: final until it changes
    │   └── LayoutUnreadable   a safetensors header or config.json cannot be read as such
    ├── PublishError           `publish` cannot place a checkpoint (nothing half-written stays)
    ├── StateError             the state file cannot be read or written
    ├── ControlError           the control socket cannot be reached or answered badly
    ├── DemoError              the demo cannot run (what to install or fix)
    ├── DownloadError          the local side of a download: no space, cannot write the cache
    │   └── Cancelled          the daemon is stopping; the journal keeps what was done
    ├── SourceError            the object store: unreachable, denied, no such bucket (retried)
    │   ├── ObjectChanged      an object's ETag changed under a download (start again)
    │   └── KeyUnreadable      one file of a shared root cannot be read (its version waits)
    └── EngineError            anything between us and the vLLM engine
        ├── EngineUnavailable  no answer: refused, reset, timed out (retry with backoff)
        ├── EngineCallFailed   the engine answered, with an error status or a bad body
        └── ReloadFailed       `reload_weights` failed; says whether the fallback was restored

A gate verdict is *not* an exception: `ready` / `pending` / `rejected` are data
(see `checkpoint.gate.Verdict`), because a bad checkpoint is an expected input, not a
failure; `CheckpointError`s never leave the gate.

This module imports nothing, so the worker extension (which runs inside vLLM with only
torch and safetensors) can raise the same errors as the daemon.
"""


class ReloaderError(Exception):
    """Base of every error vllm-reloader raises on purpose."""


class ConfigError(ReloaderError):
    """The config file is missing, unparsable or invalid; the message names the key."""


class EngineNotSetUp(ConfigError):
    """The engine is not started the way the daemon needs; the message names what to set.
    No retry fixes it, so the daemon exits 2 (systemd: `RestartPreventExitStatus=2`)."""


class AlreadyRunning(ConfigError):
    """Another daemon holds the state directory: two would reload one engine and replace each
    other's control socket. Exit 2, naming its pid; nothing was touched."""


class CheckpointError(ReloaderError):
    """Something in a checkpoint's own files; the gate turns it into a verdict."""


class NotJSONYet(CheckpointError):
    """The bytes are not JSON (yet): the producer may still be writing them."""


class ManifestInvalid(CheckpointError):
    """The JSON is whole but breaks the schema: final until the manifest changes."""


class LayoutUnreadable(CheckpointError):
    """A safetensors header or config.json could not be read as such."""


class PublishError(ReloaderError):
    """A checkpoint could not be published into the root."""


class StateError(ReloaderError):
    """The state file could not be read or written."""


class ControlError(ReloaderError):
    """The control socket could not be reached or answered badly."""


class DemoError(ReloaderError):
    """The demo could not run; the message says what to install or fix."""


class DownloadError(ReloaderError):
    """A download cannot be placed in the cache (short of space, disk errors)."""


class Cancelled(DownloadError):
    """The daemon is stopping; the download journal keeps what was done."""


class SourceError(ReloaderError):
    """The object store refused or did not answer. The message is one stable line (the
    operation, the key, the condition: a store's code, refused, DNS, TLS, credentials), the
    same at every retry; `detail` keeps the store's own words for `status`."""

    def __init__(self, message: str, detail: str | None = None) -> None:
        super().__init__(message)
        self.detail = detail or message


class ObjectChanged(SourceError):
    """An object was replaced while it was being downloaded (the If-Match failed)."""


class KeyUnreadable(SourceError):
    """One file of a shared root is not for this daemon to read (its mode, owner, a link or a
    FIFO put there): that version's own problem, which the others do not wait on."""


class EngineError(ReloaderError):
    """A call to the engine did not do what was asked."""

    def __init__(self, message: str, *, endpoint: str) -> None:
        super().__init__(message)
        self.endpoint = endpoint


class EngineUnavailable(EngineError):
    """The engine did not answer at all (connection refused, reset, or timed out)."""


class EngineCallFailed(EngineError):
    """The engine answered, but with an error status or a body we cannot use."""

    def __init__(self, message: str, *, endpoint: str, status: int | None = None, detail: str = "") -> None:
        super().__init__(message, endpoint=endpoint)
        self.status = status
        self.detail = detail
        """The engine's error text, longer than the message keeps (matched, never logged whole)."""


class ReloadFailed(EngineError):
    """`reload_weights` failed; `restored` tells whether the fallback was loaded back,
    `engine_up` whether the engine still answers, `changed` whether the cause was a writer
    changing the files under the load (not the checkpoint's fault: it is checked again),
    `refused` whether vLLM refused the load for want of device memory (the engine's
    condition: retried later, the checkpoint not blamed), `probed` whether the forward pass
    inside the pause found the new weights broken (the fallback was loaded back before any
    client saw them), `unjudged` whether the probe gave no answer (a timeout, an error of the
    engine's own): the weights were loaded back unjudged, nothing blamed, tried again later."""

    def __init__(
        self,
        message: str,
        *,
        restored: bool,
        engine_up: bool,
        changed: bool = False,
        refused: bool = False,
        probed: bool = False,
        unjudged: bool = False,
    ) -> None:
        super().__init__(message, endpoint="/collective_rpc")
        self.restored = restored
        self.engine_up = engine_up
        self.changed = changed
        self.refused = refused
        self.probed = probed
        self.unjudged = unjudged
