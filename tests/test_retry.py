"""The one retry policy."""

from vllm_reloader.retry import Backoff, Policy


def test_backoff_keeps_counting_failures_for_days_without_overflowing():
    """An engine polled every second while it never answers fails ~86,400 times a day."""
    backoff: Backoff[str] = Backoff(Policy(initial=0.5, cap=30.0, jitter=0.0))
    waits = [backoff.failed("engine", at_most=1.0) for _ in range(5000)]
    assert waits[0] == 0.5 and set(waits[1:]) == {1.0}
    assert Policy(initial=0.5, cap=30.0, jitter=0.0).wait(10**6) == 30.0
