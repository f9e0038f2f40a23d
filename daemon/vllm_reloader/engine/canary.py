"""The canary: a checkpoint can be whole and shaped right and still be garbage.

A diverged run writes NaN or exploded weights that pass every check of the gate. So after a
reload, before it counts as a success, a few real requests go to the engine (greedy, with
logprobs): one that errors or times out, any logprob that is not finite, an output
distribution that is flat at every step (every token exactly as likely: what weights scaled
into overflow give once the engine's norms and softmax have flattened them), or a mean below
`min_mean_logprob`, fails the reload, and the worker loads the last good checkpoint
back. The engine is already serving the new weights during the probe (vLLM serves no
request while paused), so clients may see them for the probe's duration: a second or so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..config import CanaryConfig
from ..errors import EngineCallFailed, EngineError
from .client import EngineClient

NON_FINITE_JSON = "Out of range float values are not JSON compliant"
"""What vLLM answers (HTTP 400) when a logprob it would return is inf or NaN."""
FLAT = 1e-6
"""Top logprobs closer than this at a step count as equal (a model's never are, at every step)."""


def judge(
    logprobs: Sequence[Sequence[float | None]],
    min_mean: float | None,
    top: Sequence[Sequence[Sequence[float]]] = (),
) -> str | None:
    """Why these answers mean broken weights, or None. Pure. `top`: for each prompt, each
    step's most likely tokens' logprobs (may be empty: then not judged)."""
    flat: list[float] = []
    for i, values in enumerate(logprobs):
        if not values:
            return f"prompt {i}: no tokens generated"
        for value in values:
            if value is None or not math.isfinite(value):
                return f"prompt {i}: logprob {value} is not finite"
            flat.append(value)
    steps = [step for prompt in top for step in prompt]
    if steps and all(len(step) > 1 and max(step) - min(step) < FLAT for step in steps):
        return f"every token equally likely at every step (logprob {steps[0][0]:.3f}): broken weights"
    mean = sum(flat) / len(flat)
    if min_mean is not None and mean < min_mean:
        return f"mean logprob {mean:.2f} is below min_mean_logprob {min_mean:g}"
    return None


@dataclass(frozen=True)
class Finding:
    reason: str
    answered: bool
    """The engine answered, and its answers (or its error for them) say the weights are broken;
    False: no answer (a timeout, no connection, overloaded), which blames nothing."""


def examine(client: EngineClient, config: CanaryConfig, model: str | None = None) -> Finding | None:
    """Ask the engine (`model`: an adapter's name; None: the base model); None when it answers
    like a model, else what is wrong."""
    answers, tops = [], []
    for i, prompt in enumerate(config.prompts):
        try:
            values, top = client.token_logprobs(
                prompt, max_tokens=config.max_tokens, timeout=config.timeout, model=model
            )
        except EngineError as exc:  # an error answer (NaN made vLLM fail its JSON) blames the weights
            answered = isinstance(exc, EngineCallFailed) and exc.status not in (None, 429, 503)
            said = f"the weights produce non-finite logits ({exc})" if NON_FINITE_JSON in str(exc) else exc
            return Finding(f"prompt {i}: {said}", answered)
        answers.append(values)
        tops.append(top)
    reason = judge(answers, config.min_mean_logprob, tops)
    return None if reason is None else Finding(reason, answered=True)


def probe(client: EngineClient, config: CanaryConfig, model: str | None = None) -> str | None:
    """`examine`'s reason, or None."""
    found = examine(client, config, model)
    return None if found is None else found.reason
