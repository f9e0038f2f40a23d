"""The canary: a checkpoint can be whole and shaped right and still be garbage.

A diverged run writes NaN or exploded weights that pass every check of the gate. So after a
reload, before it counts as a success, a few real requests go to the engine (greedy, with
logprobs): one that errors or times out, or any logprob that is not finite, or a mean
below `min_mean_logprob`, fails the reload, and the worker loads the last good checkpoint
back. The engine is already serving the new weights during the probe (vLLM serves no
request while paused), so clients may see them for the probe's duration: a second or so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..config import CanaryConfig
from ..errors import EngineError
from .client import EngineClient


def judge(logprobs: Sequence[Sequence[float | None]], min_mean: float | None) -> str | None:
    """Why these answers mean broken weights, or None. Pure."""
    flat: list[float] = []
    for i, values in enumerate(logprobs):
        if not values:
            return f"prompt {i}: no tokens generated"
        for value in values:
            if value is None or not math.isfinite(value):
                return f"prompt {i}: logprob {value} is not finite"
            flat.append(value)
    mean = sum(flat) / len(flat)
    if min_mean is not None and mean < min_mean:
        return f"mean logprob {mean:.2f} is below min_mean_logprob {min_mean:g}"
    return None


def probe(client: EngineClient, config: CanaryConfig) -> str | None:
    """Ask the engine; None when it answers like a model, else why not."""
    answers = []
    for i, prompt in enumerate(config.prompts):
        try:
            answers.append(
                client.token_logprobs(prompt, max_tokens=config.max_tokens, timeout=config.timeout)
            )
        except EngineError as exc:
            return f"prompt {i}: {exc}"
    return judge(answers, config.min_mean_logprob)
