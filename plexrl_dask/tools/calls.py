"""The tool-call format of agentic episodes, and what a call returns.

A model turn that calls a tool ends with the call, written as

    <NAME>INPUT</NAME>

where ``NAME`` is a tool's name (letters, digits and ``_``) and ``INPUT`` its input text; the
turn is sampled with every known tool's closing tag as a stop string, so the call is always the
end of the turn. The environment runs the tool and appends the observation

    <out>OUTPUT</out>

(``<out>error: MESSAGE</out>`` when the call failed), and the next turn continues from there. A
turn without a call ends the episode: its text is the answer the task's verifier scores.

A tool is a pure function of its input (:class:`Tool`): the same call gives the same output
wherever and whenever it runs. That is what keeps an agentic job's trajectory the same alone
and multiplexed (the calculator is arithmetic; the sandbox runs a program with a fixed, empty
environment, no network, no clock it could read differently: see :mod:`.sandbox`). It is
also why identical calls of one turn run once (:class:`~plexrl_dask.tools.pool.ToolPool`):
the samples of a group often make the same call, and each gets that one run's result.
"""

from __future__ import annotations

import collections
import contextvars
import functools
import logging
import re
import string
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from distributed import get_worker
from distributed.worker import thread_state

from plexrl_dask.errors import InvalidToolCall, ToolError

#: The observation's tags.
OUT_OPEN, OUT_CLOSE = "<out>", "</out>"
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")


class Tool(Protocol):
    """A deterministic tool: ``name`` (its tag), ``run(text) -> output`` (raises
    :class:`~plexrl_dask.errors.ToolError` for a failed call). A tool whose ``pure``
    attribute is False has each call run, identical or not (by default identical calls of a
    turn run once: see the module docstring)."""

    name: str

    def run(self, text: str) -> str: ...


@dataclass(frozen=True)
class ToolCall:
    """A parsed call: the tool's name and its input."""

    tool: str
    text: str


@dataclass(frozen=True)
class ToolResult:
    """What one call returned: its output (or the error's message), whether it failed, why
    (the error's class name), how long it ran (seconds), and where and when: the tool
    worker's address (``"driver"`` on the driver's own pool; empty for a call that never came
    back) and its wall-clock start (neither compared: a call's result is its output).
    ``shared``: the call did not run itself; an identical call of the same turn did, and this
    is its result (:class:`~plexrl_dask.tools.pool.ToolPool`)."""

    output: str
    error: str | None = None
    seconds: float = 0.0
    worker: str = field(default="", compare=False)
    started: float = field(default=0.0, compare=False)
    shared: bool = field(default=False, compare=False)

    @property
    def ok(self) -> bool:
        return self.error is None

    def observation(self, limit: int) -> str:
        """The text appended to the conversation: ``<out>...</out>``, at most ``limit``
        characters of output (cut ones end with ``...``)."""
        body = self.output if self.ok else f"error: {self.output}"
        if len(body) > limit:
            body = body[: max(0, limit - 3)] + "..."
        return f"{OUT_OPEN}{body}{OUT_CLOSE}"


def stop_strings(tools: Mapping[str, Tool]) -> tuple[str, ...]:
    """The closing tags that end a turn calling one of ``tools``."""
    return tuple(f"</{name}>" for name in sorted(tools))


def check_tools(tools: Mapping[str, Tool]) -> dict[str, Tool]:
    """``tools`` by name, checked: each name a tag (letters, digits, ``_``), not ``out``, and
    each tool's own ``name``; :class:`~plexrl_dask.errors.InvalidToolCall` otherwise."""
    out = {}
    for name, tool in tools.items():
        if not isinstance(name, str) or not _NAME.match(name) or name == "out":
            raise InvalidToolCall(f"a tool's name is a tag of letters, digits and _: {name!r}")
        if getattr(tool, "name", None) != name or not callable(getattr(tool, "run", None)):
            raise InvalidToolCall(f"tool {name!r} has no run() or calls itself otherwise")
        out[name] = tool
    return out


#: What may follow a turn's closing tag in the token that completed it (a tokenizer with
#: tokens such as ``">\n"`` or ``">."``): whitespace and punctuation, this many at most.
_TAIL = 8
_TAIL_CHARS = "".join(c for c in string.whitespace + string.punctuation if c != "<")


def parse_call(turn: str, tools: Mapping[str, Tool]) -> ToolCall | None:
    """The call a turn's text ends with; None if it ends with none (an answer). A turn stops
    at the token that completes a closing tag, so that token's rest may follow the tag (up
    to :data:`_TAIL` whitespace or punctuation characters): still the call.
    :class:`~plexrl_dask.errors.InvalidToolCall` for a turn that ends with a known closing tag
    but whose call does not parse (no opening tag after the last observation)."""
    tail = len(turn) - len(turn.rstrip(_TAIL_CHARS))
    for name in tools:
        close = f"</{name}>"
        end = turn.rfind(close, max(0, len(turn) - len(close) - min(tail, _TAIL)))
        if end < 0 or turn[end + len(close) :].strip(_TAIL_CHARS):
            continue
        body = turn[:end]
        open_ = f"<{name}>"
        start = body.rfind(open_)
        if start < 0:
            raise InvalidToolCall(f"{close} without {open_}")
        return ToolCall(name, body[start + len(open_) :])
    return None


def run_call(call: ToolCall, tools: Mapping[str, Tool]) -> ToolResult:
    """Run ``call`` here: its output, or its :class:`~plexrl_dask.errors.ToolError` as a
    failed result. Any other exception is a fault of the tool, not of the call; it is logged
    with its traceback and becomes a failed result too (``"ToolFailed"``), so that one tool's
    fault ends no episode and no job."""

    try:
        where = get_worker().address
    except ValueError:  # (not on a Dask worker: the driver's own pool)
        where = "driver"
    tool = tools.get(call.tool)
    started, t0 = time.time(), time.perf_counter()
    if tool is None:
        return ToolResult(f"no tool named {call.tool!r}", "InvalidToolCall", 0.0, where, started)
    try:
        output, error = str(tool.run(call.text)), None
    except ToolError as e:
        output, error = str(e), type(e).__name__
    except Exception as e:  # noqa: BLE001 (see the docstring)
        logging.getLogger(__name__).exception("tool %r failed on %r", call.tool, call.text[:80])
        output, error = f"{type(e).__name__}: {e}", "ToolFailed"
    return ToolResult(output, error, time.perf_counter() - t0, where, started)


def run_calls(
    calls: Sequence[ToolCall],
    tools: Mapping[str, Tool],
    at_once: bool = False,
    give_up_s: float | None = None,
    job: str = "",
) -> list[ToolResult]:
    """:func:`run_call` for each of ``calls`` here, results in order: what one task on a tool
    worker runs (:class:`~plexrl_dask.tools.pool.ToolPool` sends a turn's calls to a tool
    worker as one task). One after another; with ``at_once``, on this process's
    :class:`CallThreads` (as many as the worker has threads), which every such task shares:
    however many turns' tasks run here, no more calls run at once than the worker has
    threads, and they start in turn by ``job`` (the calls' job: one job's many calls do not
    hold back another's), in the order they came within one. ``give_up_s`` (with
    ``at_once``): a call still running that long after it started is given up on, a
    ``ToolLimitExceeded`` result, and its thread replaced; the time a call waits for a thread
    does not count."""
    if not at_once:
        return [run_call(c, tools) for c in calls]
    try:
        worker = get_worker()
        threads, where = worker.state.nthreads, worker.address
    except ValueError:  # (not on a Dask worker)
        threads, where = 1, "driver"
    pool = call_threads(threads)
    # (each call in a copy of this task's context: a tool may ask ``get_worker()``, and see
    # whether its task was cancelled)
    stop = threading.Event()
    token = CALL_CANCELLED.set(stop)
    try:
        running = [
            pool.submit(functools.partial(contextvars.copy_context().run, run_call, c, tools), job)
            for c in calls
        ]
    finally:
        CALL_CANCELLED.reset(token)
    cancelled = _task_cancelled()
    results = []
    for r in running:
        got = pool.result(r, give_up_s, where, cancelled)
        if got is None:  # (this task was cancelled: its calls not yet started never run)
            stop.set()  # (and a tool that can stop early does)
            pool.withdraw(running)
            for call in running:  # (a started one is still given up on past its time)
                if call.started is not None and not call.withdrawn:
                    pool.result(call, give_up_s, where)
            return [CANCELLED] * len(running)
        results.append(got)
    return results


#: Set, in a tool call's context, once the task running it is cancelled: nobody reads its
#: result any more, and a tool that can stop early (the sandbox ends its program) does.
CALL_CANCELLED: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar(
    "plexrl_tool_call_cancelled", default=None
)

#: What a task that was cancelled returns for its calls (nobody reads it: its caller gave up).
CANCELLED = ToolResult("the call was cancelled before it ran", "ToolCancelled")


def _task_cancelled() -> Callable[[], bool]:
    """Whether the Dask task this thread runs has been cancelled (its caller gave up on it,
    or its worker released it); never, outside a task."""
    try:
        worker, key = get_worker(), thread_state.key
    except (ValueError, AttributeError):
        return lambda: False

    def cancelled() -> bool:
        task = worker.state.tasks.get(key)
        return task is None or task.state in ("cancelled", "released", "forgotten")

    return cancelled


class _Call:
    """A call queued on :class:`CallThreads`: when it started (monotonic), its result."""

    def __init__(self, fn: Callable[[], ToolResult]) -> None:
        self.fn = fn
        self.started: float | None = None
        self.result: ToolResult | None = None
        self.given_up = False
        self.withdrawn = False
        self.done = threading.Event()
        self.lock = threading.Lock()


class CallThreads:
    """Daemon threads (as a Dask worker's own: a call stuck in a tool does not keep the
    process from exiting) that run tool calls ``threads`` at once, the jobs with calls
    waiting in turn, one call each (a job's turn of 512 calls at their time limit delays
    another job's call by one call per job, not by all of them), each job's in the order
    they came. A call given up on keeps its thread until it returns, and a new thread takes
    its place, so calls stuck in a tool do not use up the pool."""

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._ready = threading.Condition()
        self._queues: dict[str, collections.deque[_Call]] = {}
        self._turns: collections.deque[str] = collections.deque()  # jobs with calls waiting
        for _ in range(self.threads):
            self._start()

    def _next(self) -> _Call:
        with self._ready:
            while not self._turns:
                self._ready.wait()
            job = self._turns.popleft()
            waiting = self._queues[job]
            call = waiting.popleft()
            if waiting:
                self._turns.append(job)  # (its next call after the other jobs' next)
            else:
                del self._queues[job]
            call.started = time.monotonic()  # (under the lock: withdraw sees it)
            return call

    def _start(self) -> None:
        threading.Thread(target=self._serve, name="plexrl-tool-call", daemon=True).start()

    def _serve(self) -> None:
        while True:
            call = self._next()
            try:
                result = call.fn()
            except BaseException as e:  # (``run_call`` catches the rest: a tool's exit)
                result = ToolResult(f"{type(e).__name__}: {e}", "ToolFailed")
            with call.lock:
                call.result, given_up = result, call.given_up
            call.done.set()
            if given_up:
                return  # (another thread has taken its place)

    def submit(self, fn: Callable[[], ToolResult], job: str = "") -> _Call:
        call = _Call(fn)
        with self._ready:
            waiting = self._queues.get(job)
            if waiting is None:
                waiting = self._queues[job] = collections.deque()
                self._turns.append(job)
            waiting.append(call)
            self._ready.notify()
        return call

    def withdraw(self, calls: Sequence[_Call]) -> int:
        """Take those of ``calls`` that have not started out of the queues (they never run);
        how many. A call already running runs to its end or its own limit."""
        with self._ready:
            out = [c for c in calls if c.started is None and not c.withdrawn]
            for call in out:
                call.withdrawn = True
            for job, waiting in list(self._queues.items()):
                kept = collections.deque(c for c in waiting if not c.withdrawn)
                if len(kept) == len(waiting):
                    continue
                if kept:
                    self._queues[job] = kept
                else:
                    del self._queues[job]
                    self._turns.remove(job)
        return len(out)

    def waiting(self) -> int:
        """Calls queued, not yet started."""
        with self._ready:
            return sum(len(q) for q in self._queues.values())

    def result(
        self,
        call: _Call,
        give_up_s: float | None,
        where: str,
        cancelled: Callable[[], bool] | None = None,
    ) -> ToolResult | None:
        """``call``'s result once it is done; with ``give_up_s``, a failed result once it has
        run that long (see :func:`run_calls`); None as soon as ``cancelled()`` says its caller
        is gone."""
        while not call.done.wait(POLL_S):
            if cancelled is not None and cancelled():
                return None
            started = call.started
            if give_up_s is None or started is None or time.monotonic() - started < give_up_s:
                continue
            with call.lock:
                newly = call.result is None and not call.given_up  # (not done meanwhile)
                if newly:
                    call.given_up = True
            if newly:  # (its thread is lost to it: one replacement, however often asked)
                self._start()
            if call.given_up:
                message = f"the call did not return within {give_up_s:g} s"
                wall_start = time.time() - (time.monotonic() - started)
                return ToolResult(message, "ToolLimitExceeded", give_up_s, where, wall_start)
        assert call.result is not None
        return call.result


#: How often a task waiting for its calls looks whether one has run past its time.
POLL_S = 0.05
_threads: CallThreads | None = None
_threads_lock = threading.Lock()


def call_threads(threads: int) -> CallThreads:
    """This process's :class:`CallThreads` (made on first use with ``threads`` threads; the
    first caller's count stays: a worker's thread count does not change)."""
    global _threads
    with _threads_lock:
        if _threads is None:
            _threads = CallThreads(threads)
        return _threads
