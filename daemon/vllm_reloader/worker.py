"""The reload worker: runs one `hot_swap` at a time on its own thread.

A reload can take minutes on a real model. Running it here keeps the main loop free to
take events, answer the control socket and ping systemd's watchdog; the outcome comes back
to the loop as a message, like everything else.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from . import policy
from .engine import EngineClient, Target, hot_swap
from .errors import EngineError


@dataclass(frozen=True)
class Job:
    client: EngineClient
    candidate: policy.Candidate
    target: Target
    fallback: Target | None
    size: int
    started: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Outcome:
    job: Job
    seconds: float
    timings: dict[str, float] | None = None
    error: EngineError | None = None
    resume_error: EngineError | None = None


class ReloadWorker:
    def __init__(self, post: Callable[[Outcome], None]) -> None:
        self._post = post
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="reload-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, job: Job) -> None:
        self._jobs.put(job)

    def close(self, timeout: float = 5.0) -> None:
        self._jobs.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            resume_errors: list[EngineError] = []
            started = time.perf_counter()
            try:
                timings = hot_swap(
                    job.client, job.target, fallback=job.fallback, on_resume_failed=resume_errors.append
                )
                outcome = Outcome(job, time.perf_counter() - started, timings=timings)
            except EngineError as exc:
                outcome = Outcome(job, time.perf_counter() - started, error=exc)
            if resume_errors:
                outcome = Outcome(
                    job, outcome.seconds, outcome.timings, outcome.error, resume_error=resume_errors[0]
                )
            self._post(outcome)
