"""Job progress on a terminal (bars) and in a log (a line per job every few seconds)."""

from __future__ import annotations

import io

from rich.console import Console

from plexrl_dask.rl.progress import JobProgress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_log_gets_a_line_per_job_every_interval_with_its_rate():
    out, clock = io.StringIO(), Clock()
    console = Console(file=out, force_terminal=False, width=200)
    with JobProgress([("add2", 10), ("countdown3", 4)], console, interval=5, clock=clock) as p:
        assert not p.live
        p.update("add2", 1, "warm-up loss 2.000")  # a job's first step: a line
        clock.now += 1
        p.update("add2", 2, "warm-up loss 1.500")  # within the interval: none
        p.update("countdown3", 1, "warm-up loss 3.000")  # another job's first: a line
        clock.now += 4
        p.update("add2", 5, "GRPO reward 0.250")  # 5 s after its last line: 4 steps in 5 s
        clock.now += 1
        p.update("add2", 10, "GRPO reward 0.500")  # its last step: always a line
    lines = out.getvalue().splitlines()
    assert lines == [
        "add2: step 1/10, warm-up loss 2.000",
        "countdown3: step 1/4, warm-up loss 3.000",
        "add2: step 5/10, GRPO reward 0.250, 0.80 steps/s",
        "add2: step 10/10, GRPO reward 0.500, 5.00 steps/s",
    ]


def test_a_terminal_gets_bars_and_no_lines():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    with JobProgress([("add2", 3)], console, interval=0) as p:
        assert p.live
        for step in range(1, 4):
            p.update("add2", step, f"GRPO reward {step / 10:.3f}")
    text = out.getvalue()
    assert "add2: GRPO reward 0.300" in text and "3/3" in text
    assert "add2: step" not in text
