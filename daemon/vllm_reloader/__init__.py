"""vllm-reloader: hot-swap new checkpoints into a running vLLM engine, gated so that only
whole, loadable weights ever reach it."""

__version__ = "0.1.0"
