"""Multi-turn episodes of an agentic task: model turns and tool calls, one turn per request.

A step's episodes (``group_size`` per problem) advance together, one turn at a time:

1. every live conversation (its prompt, its turns and observations so far, as token ids: a
   :class:`~plexrl_dask.shared.types.TurnPrompt`, so the replica prefills only what it has not
   seen, :mod:`plexrl_dask.worker.prefix_cache`) is sampled for one turn in **one** ``sample``
   request, ``n=1`` each, stopping at the task's stop or at any tool's closing tag
   (:func:`~plexrl_dask.tools.calls.stop_strings`); between turns the workers serve other work;
2. each turn that ends with a call is parsed, and the calls run at once on the tool pool
   (:class:`~plexrl_dask.tools.pool.ToolPool`, off the model workers); a call that does not
   parse or fails gives an error observation; the observation
   (:meth:`~plexrl_dask.tools.calls.ToolResult.observation`) is tokenized without special
   tokens and appended;
3. a turn without a call ends its episode: its text is the answer. So does the last allowed
   turn (``max_turns``), whatever it ends with, and a turn after whose observation no whole
   turn (``max_tokens``) would fit the model's context: its call runs, but its observation is
   not appended (no turn would read it), so no episode outgrows the context it trains in.

Deterministic by construction: turn ``t`` of conversation ``c`` (problem ``i``, sample ``j``:
``c = i * group_size + j``) draws its tokens with seed ``(seed, t)`` and prompt id ``c``
(:func:`turn_seed`), the same wherever and with whatever else it runs; tools are pure
functions of their input. So an episode is the same alone and multiplexed.

Training (:func:`plexrl_dask.rl.objective.group_data` with ``masks``): the completion is every
token after the prompt, the policy's and the observations'; only the policy's tokens carry
weight (observations are masked out of the loss, and get no gradient). Where the importance
ratio is not 1 (several epochs, split-async), the behaviour log-probabilities of every turn's
tokens are scored on the weights that sampled the episode, at the loss's temperature, as for
single-turn jobs (:class:`~plexrl_dask.rl.grpo.GRPOJob`): not the turns' sampling
log-probabilities (:attr:`Turn.logprobs`, kept with the episode), which are of the sampling
temperature's distribution and of the decode's arithmetic, not the training forward's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from plexrl_dask.config import request_timeout
from plexrl_dask.driver.deployment import Deployment
from plexrl_dask.driver.waits import result
from plexrl_dask.errors import InvalidToolCall, JobStopped, SequenceTooLong
from plexrl_dask.shared.types import Chat, Datum, SamplingParams, TurnPrompt
from plexrl_dask.tasks.base import Problem
from plexrl_dask.tools.calls import (
    OUT_CLOSE,
    OUT_OPEN,
    Tool,
    ToolCall,
    ToolResult,
    check_tools,
    parse_call,
    stop_strings,
)
from plexrl_dask.tools.pool import ToolPool


@dataclass(frozen=True)
class Turn:
    """One model turn: its tokens and their sampling log-probabilities, its text, the call it
    ended with (if any) and that call's result, and the observation's tokens."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    call: ToolCall | None = None
    result: ToolResult | None = None
    observation: tuple[int, ...] = ()


@dataclass(frozen=True)
class Episode:
    """A conversation: its prompt's tokens and its turns."""

    prompt: tuple[int, ...]
    turns: tuple[Turn, ...]

    @property
    def completion(self) -> tuple[int, ...]:
        """Every token after the prompt: each turn's, then its observation's."""
        return tuple(t for turn in self.turns for t in (*turn.tokens, *turn.observation))

    @property
    def mask(self) -> tuple[float, ...]:
        """Per completion token: 1 for the policy's own tokens, 0 for observations."""
        return tuple(
            w
            for turn in self.turns
            for w in ((1.0,) * len(turn.tokens) + (0.0,) * len(turn.observation))
        )

    @property
    def answer(self) -> str:
        """The last turn's text (what the verifier scores)."""
        return self.turns[-1].text if self.turns else ""

    @property
    def policy_tokens(self) -> int:
        return sum(len(t.tokens) for t in self.turns)

    @property
    def calls(self) -> list[ToolResult]:
        return [t.result for t in self.turns if t.result is not None]


@dataclass(frozen=True)
class EpisodeBatch:
    """A step's episodes, ``groups[i][j]`` sample ``j`` of problem ``i``, and how long the
    tool calls took (seconds on their workers) and the driver waited for them."""

    groups: tuple[tuple[Episode, ...], ...]
    tool_wait_s: float = 0.0

    def num_tokens(self) -> int:
        return sum(e.policy_tokens for g in self.groups for e in g)

    def stats(self) -> dict[str, float]:
        """Turns per episode (mean, max), tool calls, the calls that ran (the others were
        identical to one that did), failed calls, tool seconds (mean over the calls that ran),
        and the driver's wait for tools: a step record's ``extra``."""
        episodes = [e for g in self.groups for e in g]
        calls = [r for e in episodes for r in e.calls]
        ran = [r for r in calls if not r.shared]
        return {
            "turns_mean": sum(len(e.turns) for e in episodes) / max(1, len(episodes)),
            "turns_max": float(max((len(e.turns) for e in episodes), default=0)),
            "tool_calls": float(len(calls)),
            "tool_runs": float(len(ran)),
            "tool_errors": float(sum(not r.ok for r in calls)),
            "tool_s_mean": sum(r.seconds for r in ran) / max(1, len(ran)),
            "tool_wait_s": self.tool_wait_s,
        }


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of turn ``turn`` of a step whose seed is ``seed``."""
    return (seed * 1_000_033 + turn * 7919) % 2**31


def turn_calls(
    texts: Sequence[str], tools: Mapping[str, Tool], last: bool
) -> tuple[list[ToolCall | None], dict[int, ToolResult]]:
    """The calls that turns ``texts`` end with (None: an answer; every one of the ``last``
    turn, whose calls would have no turn to read them) and, by index, the results of those
    whose call does not parse: an error observation, as a failed call's, which the
    conversation goes on with."""
    calls: list[ToolCall | None] = []
    failed: dict[int, ToolResult] = {}
    for k, text in enumerate(texts):
        try:
            calls.append(None if last else parse_call(text, tools))
        except InvalidToolCall as e:
            calls.append(None)
            failed[k] = ToolResult(str(e), type(e).__name__)
    return calls, failed


#: Seconds one turn's tool calls may take, together.
TOOL_TIMEOUT_S = 30.0


def episodes_timeout(max_turns: int) -> float:
    """The most :func:`run_episodes` waits, all its turns together (a sample and its tools
    each, with a little room for the driver's own work)."""
    return max_turns * (request_timeout() + TOOL_TIMEOUT_S + 5.0)


def run_episodes(
    sampler: Deployment,
    pool: ToolPool,
    problems: Sequence[Problem],
    params: SamplingParams,
    group_size: int,
    max_turns: int,
    observation_limit: int,
    tool_timeout_s: float = TOOL_TIMEOUT_S,
    stop: threading.Event | None = None,
) -> EpisodeBatch:
    """The step's episodes (see the module docstring): ``params`` is the step's sampling
    (its ``n`` is replaced by 1, its stops extended by the tools' closing tags). ``stop``:
    once set, no further turn starts (:class:`JobStopped`). Each turn waits at most a
    request timeout for its sample and ``tool_timeout_s`` for its tools: the whole, at most
    :func:`episodes_timeout`."""
    tools = check_tools(pool.tools)
    prompts = [
        tuple(sampler.tokenize(p.prompt)) if isinstance(p.prompt, (str, Chat)) else tuple(p.prompt)
        for p in problems
    ]
    n = len(prompts) * group_size
    # each conversation so far, with where its turns end (the replica's prefix cache)
    convs = [
        TurnPrompt(prompts[c // group_size], [len(prompts[c // group_size])]) for c in range(n)
    ]
    turns: list[list[Turn]] = [[] for _ in range(n)]
    live = list(range(n))
    stops = (*params.stop, *stop_strings(tools))
    waited = 0.0
    room = sampler.info.max_positions or None
    if room is not None:  # (the first turn must fit, as a single-turn prompt must)
        for p, prompt in zip(problems, prompts, strict=True):
            if len(prompt) + params.max_tokens > room:
                raise SequenceTooLong(
                    f"a prompt of {len(prompt)} tokens and max_tokens {params.max_tokens} are "
                    f"past the model's {room} positions ({str(p.prompt)[:60]!r}...)"
                )
    for t in range(max_turns):
        if stop is not None and stop.is_set():
            raise JobStopped("the job stopped: no further turn of its episodes starts")
        # (a conversation with no room for another whole turn ends with the turn it has)
        live = [c for c in live if room is None or len(convs[c]) + params.max_tokens <= room]
        if not live:
            break
        turn_params = replace(params, n=1, seed=turn_seed(params.seed, t), stop=stops)
        last = t == max_turns - 1
        # (tools run after every turn but the last: the next turn follows them)
        out = result(
            sampler.sample([convs[c] for c in live], turn_params, prompt_ids=live, holds=not last)
        )
        sampled = [group[0] for group in out.sequences]
        calls, failed = turn_calls([s.text for s in sampled], tools, last)
        t0 = time.perf_counter()
        results = pool.run(calls, tool_timeout_s)
        waited += time.perf_counter() - t0
        results = [failed.get(k, r) for k, r in enumerate(results)]
        still = []
        for c, s, call, res in zip(live, sampled, calls, results, strict=True):
            obs: tuple[int, ...] = ()
            if res is not None:
                text = res.observation(observation_limit)
                obs = tuple(sampler.tokenize(text, special_tokens=False))
                after = len(convs[c]) + len(s.tokens) + len(obs) + params.max_tokens
                if room is not None and after > room:
                    obs = ()  # (the episode ends here: see the module docstring, step 3)
                else:
                    still.append(c)
            turns[c].append(Turn(tuple(s.tokens), tuple(s.logprobs), s.text, call, res, obs))
            convs[c] = convs[c].then((*s.tokens, *obs))
        live = still
    groups = tuple(
        tuple(Episode(prompts[i], tuple(turns[i * group_size + j])) for j in range(group_size))
        for i in range(len(prompts))
    )
    return EpisodeBatch(groups, waited)


def transcript_datum(deployment: Deployment, problem: Problem) -> Datum:
    """A supervised datum of ``problem``'s reference transcript (its ``answer``): trained on
    the model's parts, the observations (``<out>...</out>``) masked out, each piece tokenized
    on its own as an episode builds it."""
    prompt = (
        deployment.tokenize(problem.prompt)
        if isinstance(problem.prompt, (str, Chat))
        else list(problem.prompt)
    )
    tokens, weights = list(prompt), [0.0] * len(prompt)
    rest = problem.answer
    while rest:
        start = rest.find(OUT_OPEN)
        end = rest.find(OUT_CLOSE, start) if start >= 0 else -1
        mine, obs = (rest, "") if end < 0 else (rest[:start], rest[start : end + len(OUT_CLOSE)])
        rest = "" if end < 0 else rest[end + len(OUT_CLOSE) :]
        for text, w in ((mine, 1.0), (obs, 0.0)):
            ids = deployment.tokenize(text, special_tokens=False) if text else []
            tokens += ids
            weights += [w] * len(ids)
    return Datum(tuple(tokens), tuple(weights))


def episode_data(
    episodes: Sequence[Episode],
) -> tuple[tuple[int, ...], list[tuple[int, ...]], list[tuple[float, ...]]]:
    """A group's prompt, completions and masks (what :func:`group_data` takes)."""
    return episodes[0].prompt, [e.completion for e in episodes], [e.mask for e in episodes]
