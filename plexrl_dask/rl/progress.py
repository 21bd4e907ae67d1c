"""Progress of several jobs at once: bars on a terminal, a line per job every few seconds in a
log.

A driver that runs jobs for minutes must show that it is alive wherever its output goes. On a
terminal, :class:`JobProgress` draws one ``rich`` bar per job. Written to a file or a pipe
(``make demo > run.log``, a batch job's log), bars draw nothing until the end, so it prints
plain lines instead: per job, at most one every ``interval`` seconds (and always its first and
last), with its step, what the step reports (loss, reward) and its rate in steps per second
over the time since its previous line.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


@dataclass
class _Job:
    total: int
    done: int = 0
    status: str = ""
    printed_at: float | None = None  # monotonic time of the job's last line (log mode)
    printed_done: int = 0  # its step then
    task: Any = field(default=None)  # its bar (terminal mode)


class JobProgress:
    """Progress of ``jobs`` (name → total steps) on ``console``: bars on a terminal, lines
    every ``interval`` seconds otherwise (see the module docstring). Use as a context manager;
    :meth:`update` from any thread that reports a job's step."""

    def __init__(
        self,
        jobs: Iterable[tuple[str, int]],
        console: Console | None = None,
        interval: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.console = console or Console()
        self.interval = float(interval)
        self.clock = clock
        self.jobs = {name: _Job(int(total)) for name, total in jobs}
        self.live = self.console.is_terminal
        self._bars: Progress | None = None
        if self.live:
            self._bars = Progress(
                TextColumn("{task.description:<44}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=self.console,
            )
            for name, job in self.jobs.items():
                job.task = self._bars.add_task(name, total=job.total)

    def __enter__(self) -> JobProgress:
        if self._bars is not None:
            self._bars.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self._bars is not None:
            self._bars.stop()

    def update(self, name: str, done: int, status: str) -> None:
        """Job ``name`` has done ``done`` of its steps; ``status`` says what the last one
        reported (e.g. ``"GRPO reward 0.531"``)."""
        job = self.jobs[name]
        job.done, job.status = int(done), status
        if self._bars is not None:
            self._bars.update(job.task, completed=job.done, description=f"{name}: {status}")
            return
        now = self.clock()
        first = job.printed_at is None
        finished = job.done >= job.total
        if not first and not finished and now - job.printed_at < self.interval:  # type: ignore[operator]
            return
        rate = ""
        if not first:
            seconds = now - job.printed_at  # type: ignore[operator]
            if seconds > 0:
                rate = f", {(job.done - job.printed_done) / seconds:.2f} steps/s"
        self.console.print(
            f"{name}: step {job.done}/{job.total}, {status}{rate}", highlight=False, soft_wrap=True
        )
        job.printed_at, job.printed_done = now, job.done
