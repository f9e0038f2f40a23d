"""Runs inside the vLLM engine (`--worker-extension-cls vllm_reloader.extension.ReloadExtension`).

Imports torch, safetensors, the standard library and `checkpoint.files` (with `errors`,
which imports nothing) — nothing else of this package, so it imports on an engine host that
has none of the daemon's dependencies.
"""

from .worker import ReloadExtension

__all__ = ["ReloadExtension"]
