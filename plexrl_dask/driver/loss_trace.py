"""A Python loss function as a :class:`~plexrl_dask.shared.loss_graph.GraphLoss`: traced with
``torch.fx`` in the driver, sent as data, run by the workers from their allowed operations.

    def clipped(logprobs, old, advantages):
        ratio = torch.exp(logprobs - old)
        loss = -torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages).sum()
        return loss, {"custom/ratio:mean": ratio.mean()}

    loss = trace_loss(clipped, {"logprobs": 1, "old": 1, "advantages": 1})
    policy.forward_backward([plexrl.Datum(tokens, inputs={"old": ..., "advantages": ...})], loss)

The function takes ``logprobs`` (the datum's target log-probabilities, one per predicted
token) and then one argument per :attr:`Datum.inputs <plexrl_dask.Datum.inputs>` it reads,
and returns ``(loss, metrics)``, as a Tinker ``create_custom_loss`` function does; the
encoding is the Tinker SDK's, so a graph either side made runs on both.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

from plexrl_dask.errors import InvalidLoss
from plexrl_dask.shared.loss_graph import GraphLoss, LossNode


def trace_loss(
    fn: Callable[..., Any], input_ranks: Mapping[str, int], normalizer: float = 1.0
) -> GraphLoss:
    """``fn`` traced into a :class:`GraphLoss` (``input_ranks``: the rank of each of its
    parameters, 1 for ``logprobs``); :class:`InvalidLoss` when it cannot be traced or calls
    what a loss may not."""
    import torch.fx

    names = list(inspect.signature(fn).parameters)
    if set(names) != set(input_ranks):
        raise InvalidLoss(f"input_ranks gives a rank for each parameter of the loss: {names}")
    try:
        graph = torch.fx.symbolic_trace(fn)
    except Exception as e:  # (fx raises whatever the traced code does on a proxy)
        raise InvalidLoss(
            f"{getattr(fn, '__name__', fn)!r} cannot be traced: {e} (a loss may not branch "
            "on tensor values or call libraries other than torch and math)"
        ) from None
    nodes = [
        LossNode(
            node.op,
            node.name,
            _target(node),
            tuple(_encode(a) for a in node.args),
            tuple((k, _encode(v)) for k, v in node.kwargs.items()),
        )
        for node in graph.graph.nodes
    ]
    inputs = tuple((name, input_ranks[name]) for name in names)
    return GraphLoss(getattr(fn, "__name__", "loss"), inputs, tuple(nodes), normalizer)


def _target(node: Any) -> str:
    from torch.fx.node import _get_qualified_name

    if node.op != "call_function":
        return str(node.target)
    name = _get_qualified_name(node.target)
    # (fx names Python's operators by CPython's private module; the wire, by the public one)
    return "operator." + name.removeprefix("_operator.") if name.startswith("_operator.") else name


def _encode(arg: Any) -> Any:
    import torch
    import torch.fx

    if isinstance(arg, torch.fx.Node):
        return {"ref": arg.name}
    if isinstance(arg, float) and not math.isfinite(arg):
        return {"float": str(arg)}
    if arg is None or isinstance(arg, bool | int | float | str):
        return arg
    if isinstance(arg, list):
        return [_encode(a) for a in arg]
    if isinstance(arg, tuple):
        return {"tuple": [_encode(a) for a in arg]}
    if isinstance(arg, dict):
        return {"dict": {str(k): _encode(v) for k, v in arg.items()}}
    if isinstance(arg, slice):
        return {"slice": [_encode(arg.start), _encode(arg.stop), _encode(arg.step)]}
    if arg is Ellipsis:
        return {"ellipsis": True}
    if isinstance(arg, torch.dtype):
        return {"dtype": str(arg).removeprefix("torch.")}
    raise InvalidLoss(f"a loss graph cannot carry a {type(arg).__name__} argument")
