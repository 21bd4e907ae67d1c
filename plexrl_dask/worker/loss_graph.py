"""Building and running a :class:`~plexrl_dask.shared.loss_graph.GraphLoss` on the worker.

The graph is checked again here (the worker trusts no client's checks: its constructor's
rules ran where it was made, and a pickled value arrives without running them), then built
from the allowed lists alone: every function is looked up by its allowed qualified name,
every method called on a tensor only, every ``to`` given dtypes only, every index a number,
slice or ``None``. Before the first datum of a length runs, the graph runs on shapes only
(tensors on torch's ``meta`` device): intermediates holding more than :func:`element_budget`
elements together (autograd keeps them all until the backward), a shape that does not
broadcast, or an operation that cannot tell its result's shape from its inputs' is refused
there, with nothing allocated; as every allowed operation's work is linear in its operands,
the budget bounds the time too. Python integers (shape arithmetic) are bounded to 2**62, so
no chain of operations grows one without bound. Whatever fails while it runs is
:class:`InvalidLoss` naming the node.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from plexrl_dask.errors import InvalidLoss, PlexRLError
from plexrl_dask.shared.loss_graph import ATTRIBUTES, DTYPES, FUNCTIONS, METHODS, GraphLoss
from plexrl_dask.shared.types import Datum

#: All of a datum's intermediates together may hold this many elements per predicted token,
#: plus :data:`MIN_ELEMENTS` (float32: 4 KiB a token, where the model's own logits take 4 bytes
#: per word of its vocabulary); no outer product of a long sequence with itself.
ELEMENTS_PER_TOKEN = 1024
MIN_ELEMENTS = 1 << 16
_MAX_INT = 2**62
_ROOTS = {"torch": torch, "operator": operator, "math": math}
_DTYPES = {name: getattr(torch, name) for name in DTYPES}
_FLOATS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
#: What a running graph may raise, turned into InvalidLoss naming its node.
_FAILURES = (
    TypeError, ValueError, RuntimeError, IndexError, KeyError, ZeroDivisionError,
    OverflowError, NotImplementedError, AttributeError,
)  # fmt: skip
_CACHE_SIZE = 64


def element_budget(tokens: int) -> int:
    """The most elements all the intermediates of a datum of ``tokens`` predicted tokens may
    hold together."""
    return ELEMENTS_PER_TOKEN * tokens + MIN_ELEMENTS


@dataclasses.dataclass(frozen=True)
class _Ref:
    name: str


@dataclasses.dataclass(frozen=True)
class _Step:
    name: str
    call: Any  # a callable, or a method's name (str)
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class _Program:
    """A graph built for running: its steps, its output, and the lengths it was checked at."""

    def __init__(self, loss: GraphLoss) -> None:
        self.name = loss.name
        self.inputs = loss.inputs
        self.steps: list[_Step] = []
        for node in loss.nodes[len(loss.inputs) : -1]:
            if node.op == "call_method" and node.target not in METHODS:
                raise InvalidLoss(f"{node.target!r} is not an allowed method")
            call = node.target if node.op == "call_method" else _function(node.target)
            args = tuple(_decode(a) for a in node.args)
            kwargs = {k: _decode(v) for k, v in node.kwargs}
            if node.target == "to" and not all(
                isinstance(a, torch.dtype) for a in (*args[1:], *kwargs.values())
            ):
                raise InvalidLoss(f"node {node.name!r}: to() takes a dtype only, no device")
            self.steps.append(_Step(node.name, call, args, kwargs))
        self.output = _decode(loss.nodes[-1].args[0])
        self.checked: set[int] = set()
        self.lock = threading.Lock()

    def check_shapes(self, tokens: int) -> None:
        """Run the graph on shapes only for a datum of ``tokens`` predicted tokens (once per
        length): :class:`InvalidLoss` for what would not run or would be too large."""
        if tokens in self.checked:
            return
        shapes = [(tokens,) if rank == 1 else () for _, rank in self.inputs]
        values = [torch.empty(s, device="meta") for s in shapes]
        self.run(values, element_budget(tokens))
        with self.lock:
            self.checked.add(tokens)

    def run(
        self, values: Sequence[Any], budget: int | None = None
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """The graph's loss and metrics (scalar tensors, detached, or numbers) on ``values``
        (its inputs, in order); with ``budget``, :class:`InvalidLoss` once its intermediates
        together hold more elements."""
        env: dict[str, Any] = {name: v for (name, _), v in zip(self.inputs, values, strict=True)}
        spent = 0
        for step in self.steps:
            args, kwargs = _bind(step.args, env), _bind(step.kwargs, env)
            try:
                if isinstance(step.call, str):
                    if not isinstance(args[0], torch.Tensor):
                        raise InvalidLoss(
                            f"node {step.name!r} calls {step.call}() on a "
                            f"{type(args[0]).__name__}, not a tensor"
                        )
                    out = getattr(args[0], step.call)(*args[1:], **kwargs)
                else:
                    out = step.call(*args, **kwargs)
            except (PlexRLError, torch.OutOfMemoryError):
                raise  # (out of memory: the holder's to handle, not the loss's fault)
            except _FAILURES as e:
                raise InvalidLoss(f"loss {self.name!r}, node {step.name!r}: {e}") from None
            spent += _elements(out, step.name)
            if budget is not None and spent > budget:
                raise InvalidLoss(
                    f"loss {self.name!r}: its intermediates hold more than {budget} elements "
                    f"for a datum of this length (node {step.name!r})"
                )
            env[step.name] = out
        try:
            return self._output(_bind(self.output, env))
        except (PlexRLError, torch.OutOfMemoryError):
            raise
        except _FAILURES as e:
            raise InvalidLoss(f"loss {self.name!r}, its output: {e}") from None

    def _output(self, out: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        loss, metrics = out
        if not (isinstance(loss, torch.Tensor) and loss.ndim == 0 and loss.is_floating_point()):
            raise InvalidLoss(f"loss {self.name!r} must return a floating scalar tensor")
        out_metrics = {}
        for key, value in metrics.items():
            if isinstance(value, torch.Tensor):
                if value.numel() != 1 or value.is_complex():
                    raise InvalidLoss(f"loss {self.name!r}: metric {key!r} is not a real scalar")
            elif isinstance(value, complex) or not isinstance(value, int | float):
                raise InvalidLoss(
                    f"loss {self.name!r}: metric {key!r} is a {type(value).__name__}, not a "
                    "real number"
                )
            # (kept on the device: read once per batch, not once per datum and metric)
            out_metrics[key] = value.detach() if isinstance(value, torch.Tensor) else value
        return loss, out_metrics


_PROGRAMS: OrderedDict[str, _Program] = OrderedDict()
_PROGRAMS_LOCK = threading.Lock()


def build(loss: GraphLoss) -> _Program:
    """``loss`` checked again (its constructor's rules, in this process) and built from the
    allowed lists; cached by its digest."""
    if not isinstance(loss, GraphLoss):
        raise InvalidLoss(f"a graph loss is a GraphLoss, got {type(loss).__name__}")
    key = loss.key
    with _PROGRAMS_LOCK:
        program = _PROGRAMS.get(key)
        if program is not None:
            _PROGRAMS.move_to_end(key)
            return program
    program = _Program(dataclasses.replace(loss))
    with _PROGRAMS_LOCK:
        _PROGRAMS[key] = program
        while len(_PROGRAMS) > _CACHE_SIZE:
            _PROGRAMS.popitem(last=False)
    return program


def graph_loss(
    loss: GraphLoss, batch: tuple[Datum, ...], logp: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of ``batch`` (the per-datum losses summed, divided by the normalizer) given
    log-probabilities ``logp`` (B, L-1) of its predicted tokens, and its metrics.

    Where ``logp`` carries a gradient, the graph runs on a detached copy and its gradient
    with respect to the log-probabilities is taken here, so that any failure of the graph's
    own backward is an :class:`InvalidLoss` before the model's backward (and a sharded
    model's collectives) starts; the loss returned has that gradient and the graph's value
    (the SDK's surrogate, computed on the worker)."""
    program = build(loss)
    leaf = logp.detach().requires_grad_(logp.requires_grad)
    total: torch.Tensor | None = None
    sums: dict[str, Any] = {}
    for i, datum in enumerate(batch):
        n = len(datum.tokens) - 1
        values = [leaf[i, :n]]
        for name, rank in loss.inputs[1:]:
            value = datum.input(name)
            if value is None:
                raise InvalidLoss(f"datum {i} has no input {name!r}, which {loss.name!r} reads")
            if (rank == 0) != (not isinstance(value, tuple)):
                want = "a number" if rank == 0 else "one value per token"
                raise InvalidLoss(f"datum {i}: input {name!r} of {loss.name!r} is {want}")
            data = value if rank == 0 else value[1:]
            values.append(torch.tensor(data, dtype=torch.float32, device=logp.device))
        program.check_shapes(n)
        value, metrics = program.run(values)
        total = value if total is None else total + value
        for key, m in metrics.items():
            m = m.to(torch.float64) if isinstance(m, torch.Tensor) else float(m)
            sums[key] = sums.get(key, 0.0) + m
    total = leaf.new_zeros(()) if total is None else total.to(torch.float32) / loss.normalizer
    if logp.requires_grad:
        grad = torch.zeros_like(leaf)
        if total.requires_grad:  # (a loss that reads no log-probability has a gradient of 0)
            try:
                (grad,) = torch.autograd.grad(total, leaf)
            except torch.OutOfMemoryError:
                raise
            except _FAILURES as e:
                raise InvalidLoss(f"loss {loss.name!r}: its gradient: {e}") from None
        surrogate = (logp * grad).sum()
        value = surrogate + (total.detach() - surrogate.detach())
    else:
        value = total.detach()
    out = {"num_tokens": float(valid.sum()), "total_weight": float(len(batch))}
    for key, s in sums.items():
        s = float(s)
        out[key] = s / len(batch) if key.endswith(":mean") else s
    out["loss"] = float(value.detach())
    return value, out


# --- decoding and checking ---------------------------------------------------------------------


def _function(qualified: str) -> Any:
    if qualified not in FUNCTIONS:
        raise InvalidLoss(f"{qualified!r} is not an allowed function")
    if qualified == "getattr":
        return _attribute
    root, *path = qualified.split(".")
    value: Any = _ROOTS[root]
    for part in path:
        value = getattr(value, part)
    if qualified == "operator.getitem":
        return _index
    if root == "operator":
        return _on_numbers(value)
    return value


def _index(container: Any, index: Any) -> Any:
    """``container[index]`` for an index of numbers, slices of numbers, ``None`` and ``...``
    only: a tensor or list index selects by values the shapes-only pass cannot see, and one
    out of range on a GPU fails the device, not the request."""
    parts = index if isinstance(index, tuple) else (index,)
    for part in parts:
        if isinstance(part, slice):
            ends = (part.start, part.stop, part.step)
            ok = all(e is None or (isinstance(e, int) and not isinstance(e, bool)) for e in ends)
        else:
            ok = part is None or part is Ellipsis or isinstance(part, int)
        if not ok:
            raise InvalidLoss(f"an index is a number, a slice, None or ..., not {part!r:.40}")
    return container[index]


def _on_numbers(fn: Any) -> Any:
    """Python's operator ``fn`` on tensors and numbers only (``[x] * n`` would build a list
    of any length), and no integer power past 2**62 computed first."""

    def call(*args: Any) -> Any:
        for a in args:
            if not isinstance(a, torch.Tensor | int | float | bool):
                raise InvalidLoss(f"{fn.__name__} of a {type(a).__name__}")
        if fn is operator.pow and all(isinstance(a, int) for a in args):
            base, power = args
            if power > 0 and abs(base) > 1 and power * math.log2(abs(base)) > 62:
                raise InvalidLoss(f"{base} ** {power} is past 2**62")
        return fn(*args)

    call.__name__ = fn.__name__
    return call


def _attribute(value: Any, name: str) -> Any:
    if not isinstance(value, torch.Tensor) or name not in ATTRIBUTES:
        raise InvalidLoss(f"getattr reads {sorted(ATTRIBUTES)} of a tensor, not {name!r}")
    return getattr(value, name)


def _decode(arg: Any) -> Any:
    """An encoded argument as Python values, with :class:`_Ref` for node references."""
    if isinstance(arg, list):
        return [_decode(a) for a in arg]
    if isinstance(arg, tuple):
        return tuple(_decode(a) for a in arg)
    if not isinstance(arg, dict):
        return arg
    ((kind, value),) = arg.items()
    if kind == "ref":
        return _Ref(value)
    if kind == "tuple":
        return tuple(_decode(a) for a in value)
    if kind == "dict":
        return {k: _decode(v) for k, v in value.items()}
    if kind == "slice":
        return slice(*(_decode(a) for a in value))
    if kind == "ellipsis":
        return Ellipsis
    if kind == "float":
        return _FLOATS[value]
    if kind == "dtype":
        return _DTYPES[value]
    raise InvalidLoss(f"an argument of an unknown encoding: {kind!r}")


def _bind(arg: Any, env: dict[str, Any]) -> Any:
    if isinstance(arg, _Ref):
        return env[arg.name]
    if isinstance(arg, list):
        return [_bind(a, env) for a in arg]
    if isinstance(arg, tuple):
        return tuple(_bind(a, env) for a in arg)
    if isinstance(arg, dict):
        return {k: _bind(v, env) for k, v in arg.items()}
    if isinstance(arg, slice):
        return slice(_bind(arg.start, env), _bind(arg.stop, env), _bind(arg.step, env))
    return arg


def _elements(value: Any, node: str) -> int:
    """The tensor elements ``value`` holds; :class:`InvalidLoss` for an integer past 2**62."""
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, int) and not isinstance(value, bool):
        if abs(value) > _MAX_INT:
            raise InvalidLoss(f"node {node!r} makes an integer past 2**62")
    elif isinstance(value, tuple | list):
        return sum(_elements(item, node) for item in value)
    return 0
