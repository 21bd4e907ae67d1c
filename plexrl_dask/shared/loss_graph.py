"""A loss given as data: a graph of allowed tensor operations, run once per datum on the
worker that trains (Tinker's uploaded custom losses, ``create_custom_loss``; and any PlexRL
caller's :class:`GraphLoss`).

The graph is what ``torch.fx`` records of a traced loss function, node by node, in the Tinker
SDK's encoding (``tinker.types.CustomLossGraph``): placeholders (``logprobs``, then the named
inputs the loss reads), calls of functions and tensor methods, and one output, the pair
``(loss, {metric: value})``. Arguments are JSON values, ``{"ref": node}`` for an earlier
node's value, and one-key objects for the rest (``tuple``, ``dict``, ``slice``, ``ellipsis``,
``float`` for non-finite numbers, ``dtype``).

Nothing in it is code. This module checks its structure (node kinds, names, references,
encodings, sizes) and that every function, method and attribute it names is on the lists
below; the worker then builds it from those lists alone (:mod:`plexrl_dask.worker.loss_graph`),
checks them again, and runs it first on shapes only (torch's ``meta`` device) so that a graph
whose intermediates together pass the datum's element budget is refused before anything is
allocated. The lists leave out whatever takes a size (``torch.zeros(n)``, ``repeat``,
``expand``), leaves torch (``item``, ``numpy``), changes a tensor in place (``out=``,
``inplace=``), moves it to a device, or does more than linear work in its operands (``matmul``,
``norm``); an index is a number, a slice or ``None``, never a tensor or a list (whose values the
shapes-only pass cannot see, and which a GPU would check only by failing the device).

Its value: the sum over data of the per-datum loss, divided by ``normalizer`` (1: Tinker's
sum). Metrics are scalars keyed ``custom/<name>:sum`` (summed over data) or ``:mean``
(averaged over them).
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from plexrl_dask.errors import InvalidLoss

#: The node kinds a loss graph may have (``get_attr``, a captured tensor, and ``call_module``
#: are refused: a loss reads only its inputs and calls only functions).
NODE_OPS = ("placeholder", "call_function", "call_method", "output")

_ELEMENTWISE = (
    "exp", "log", "log1p", "expm1", "log2", "log10", "exp2", "sqrt", "rsqrt", "square",
    "abs", "neg", "sign", "sigmoid", "tanh", "relu", "erf", "clamp", "clip", "clamp_min",
    "clamp_max", "minimum", "maximum", "pow", "mul", "add", "sub", "div", "true_divide",
    "where", "masked_fill", "isfinite", "isnan", "nan_to_num", "logical_and", "logical_or",
    "logical_not", "lt", "le", "gt", "ge", "eq", "ne",
)  # fmt: skip
_REDUCTIONS = (
    "sum", "mean", "prod", "min", "max", "amin", "amax", "cumsum", "logsumexp", "softmax",
    "log_softmax", "std", "var", "dot", "numel",
)  # fmt: skip
# (no matmul, no norm (an SVD for some p): every allowed operation's work is linear in its
# operands' sizes, so the element budget bounds a graph's time as well as its memory)
_OPERATORS = (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos", "abs", "getitem",
    "lt", "le", "gt", "ge", "eq", "ne", "and_", "or_", "xor", "invert",
)  # fmt: skip
_LIKE = ("zeros_like", "ones_like", "full_like", "stack", "cat", "flip", "detach")
_MATH = ("exp", "log", "log1p", "expm1", "sqrt", "tanh", "fabs", "floor", "ceil")

#: Functions a loss may call, by the qualified names the Tinker SDK sends.
FUNCTIONS: frozenset[str] = frozenset(
    {f"torch.{name}" for name in (*_ELEMENTWISE, *_REDUCTIONS, *_LIKE)}
    | {f"torch._C._nn.{name}" for name in ("log_sigmoid", "softplus")}
    | {f"torch.nn.functional.{name}" for name in ("softmax", "log_softmax")}
    | {f"operator.{name}" for name in _OPERATORS}
    | {f"math.{name}" for name in _MATH}
    | {"getattr"}
)
#: Tensor methods a loss may call.
METHODS: frozenset[str] = frozenset(
    {*_ELEMENTWISE, *_REDUCTIONS}
    | {"float", "double", "long", "int", "bool", "to", "type_as", "detach", "unsqueeze",
       "squeeze", "reshape", "view", "flatten", "flip", "size", "dim", "contiguous", "clone",
       "t", "transpose"}  # fmt: skip
)
#: Tensor attributes ``getattr`` may read.
ATTRIBUTES = frozenset({"shape", "ndim", "dtype"})
#: The dtypes an argument may name.
DTYPES = ("float16", "bfloat16", "float32", "float64", "int32", "int64", "bool")
#: Keyword arguments no call may take: they write in place, or place or keep a tensor
#: elsewhere than the loss's own computation.
REFUSED_KWARGS = frozenset(
    {"out", "inplace", "requires_grad", "device", "memory_format", "layout", "pin_memory",
     "non_blocking", "copy"}  # fmt: skip
)
#: At most this many constants and references in all of a graph's arguments.
MAX_LEAVES = 8192

MAX_NODES = 1024
MAX_INPUTS = 16
_MAX_DEPTH = 8
_MAX_ITEMS = 64
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_INPUT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
_METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")
_ENCODED = ("ref", "tuple", "dict", "slice", "ellipsis", "float", "dtype")


@dataclass(frozen=True)
class LossNode:
    """One node: ``op`` (one of :data:`NODE_OPS`), its unique ``name``, ``target`` (the
    placeholder's input name, the function's qualified name or the method's), and its
    encoded ``args`` and ``kwargs``."""

    op: str
    name: str
    target: str
    args: tuple[Any, ...] = ()
    kwargs: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "args", tuple(self.args))
        kwargs = self.kwargs.items() if isinstance(self.kwargs, Mapping) else self.kwargs
        object.__setattr__(self, "kwargs", tuple((str(k), v) for k, v in kwargs))


@dataclass(frozen=True)
class GraphLoss:
    """A per-datum loss graph (see the module docstring). ``inputs``: ``(name, rank)`` of
    each placeholder in order, ``("logprobs", 1)`` first (the datum's target
    log-probabilities, ``[T]``), then the :attr:`Datum.inputs <plexrl_dask.Datum.inputs>` it
    reads: rank 0 (a number) or 1 (one per predicted token). :class:`InvalidLoss` when any
    rule is broken."""

    name: str
    inputs: tuple[tuple[str, int], ...]
    nodes: tuple[LossNode, ...]
    normalizer: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple((str(n), r) for n, r in self.inputs))
        object.__setattr__(self, "nodes", tuple(self.nodes))
        if not (isinstance(self.name, str) and 0 < len(self.name) <= 128):
            raise InvalidLoss("a graph loss's name is a string of 1 to 128 characters")
        n = self.normalizer
        if (
            isinstance(n, bool)
            or not isinstance(n, int | float)
            or not (math.isfinite(n) and n > 0)
        ):
            raise InvalidLoss(f"normalizer must be finite and > 0, got {n!r}")
        self._check_inputs()
        self._check_nodes()

    @property
    def input_names(self) -> tuple[str, ...]:
        """The datum inputs the loss reads, in the order it takes them."""
        return tuple(name for name, _ in self.inputs[1:])

    @property
    def key(self) -> str:
        """A digest of the graph and its inputs (what the worker caches a build under)."""
        # (repr: a tuple and a list differ, as they do as arguments; the name too, so a
        # worker's cached build never speaks of another loss's name)
        text = repr((self.name, self.inputs, [_plain(n) for n in self.nodes]))
        return hashlib.sha256(text.encode()).hexdigest()

    @classmethod
    def from_tinker(cls, name: Any, inputs: Any, graph: Any, normalizer: float = 1.0) -> GraphLoss:
        """A graph loss of a Tinker ``create_custom_loss`` request's JSON fields (``inputs``:
        ``[{"name", "rank"}]``, ``graph``: ``{"format": 1, "nodes": [...]}``)."""
        if not isinstance(graph, Mapping) or graph.get("format", 1) != 1:
            raise InvalidLoss("graph is {'format': 1, 'nodes': [...]}")
        nodes, pairs = graph.get("nodes"), []
        if not isinstance(inputs, list) or not isinstance(nodes, list):
            raise InvalidLoss("inputs and graph.nodes are lists")
        for item in inputs:
            if not isinstance(item, Mapping):
                raise InvalidLoss("each input is {'name': ..., 'rank': ...}")
            pairs.append((item.get("name"), item.get("rank")))
        built = []
        for node in nodes[: MAX_NODES + 1]:
            if not isinstance(node, Mapping):
                raise InvalidLoss("each node is an object")
            args, kwargs = node.get("args", []), node.get("kwargs", {})
            if not isinstance(args, list) or not isinstance(kwargs, Mapping):
                raise InvalidLoss("a node's args are a list and its kwargs an object")
            fields = (node.get("op"), node.get("name"), node.get("target"))
            if not all(isinstance(f, str) for f in fields):
                raise InvalidLoss("a node's op, name and target are strings")
            node_args, node_kwargs = tuple(args), tuple(kwargs.items())
            built.append(LossNode(*fields, node_args, node_kwargs))  # type: ignore[arg-type]
        return cls(str(name), tuple(pairs), tuple(built), normalizer)

    # --- the rules --------------------------------------------------------------------------

    def _check_inputs(self) -> None:
        if not 1 <= len(self.inputs) <= MAX_INPUTS:
            raise InvalidLoss(f"a graph loss takes 1 to {MAX_INPUTS} inputs, logprobs first")
        if self.inputs[0] != ("logprobs", 1):
            raise InvalidLoss(
                "a graph loss's first input is logprobs, of rank 1 (rank 2, [T, K], is not "
                "supported here)"
            )
        seen = {"logprobs"}
        for name, rank in self.inputs[1:]:
            if not _INPUT_NAME.fullmatch(name) or name in seen or name == "target_tokens":
                raise InvalidLoss(
                    f"input {name!r}: a lowercase name of letters, digits and underscores, "
                    "once, and not logprobs or target_tokens"
                )
            if isinstance(rank, bool) or rank not in (0, 1):
                raise InvalidLoss(
                    f"input {name!r} has rank {rank!r}: 0 (a number) or 1 (one per token) "
                    "are supported"
                )
            seen.add(name)

    def _check_nodes(self) -> None:
        nodes = self.nodes
        if not 2 <= len(nodes) <= MAX_NODES:
            raise InvalidLoss(f"a loss graph has 2 to {MAX_NODES} nodes, got {len(nodes)}")
        defined: set[str] = set()
        placeholders = []
        leaves = [0]
        for i, node in enumerate(nodes):
            if not isinstance(node, LossNode):
                raise InvalidLoss(f"node {i} is a LossNode, got {type(node).__name__}")
            if node.op not in NODE_OPS:
                raise InvalidLoss(
                    f"node {node.name!r} is a {node.op!r}: a loss may only read its inputs "
                    f"and call functions ({', '.join(NODE_OPS)})"
                )
            if not _NAME.fullmatch(node.name) or node.name in defined:
                raise InvalidLoss(f"node {i}: its name {node.name!r} is missing or repeated")
            if (node.op == "output") != (i == len(nodes) - 1):
                raise InvalidLoss("a loss graph has one output node, its last")
            if node.op == "placeholder":
                if i != len(placeholders) or node.args or node.kwargs:
                    raise InvalidLoss("placeholders come first and take no arguments")
                placeholders.append(node.target)
            else:
                self._check_call(node, defined, leaves)
            defined.add(node.name)
        if tuple(placeholders) != tuple(name for name, _ in self.inputs):
            raise InvalidLoss(
                f"the graph's placeholders {placeholders} are not its inputs "
                f"{[name for name, _ in self.inputs]}"
            )
        self._check_output(nodes[-1])

    def _check_call(self, node: LossNode, defined: set[str], leaves: list[int]) -> None:
        if node.op == "call_function" and node.target not in FUNCTIONS:
            raise InvalidLoss(f"node {node.name!r} calls {node.target!r}, which is not allowed")
        if node.op == "call_method" and node.target not in METHODS:
            raise InvalidLoss(
                f"node {node.name!r} calls method {node.target!r}, which is not allowed"
            )
        if node.op == "call_method" and not node.args:
            raise InvalidLoss(f"node {node.name!r}: a method call names its tensor first")
        if node.target == "getattr" and (
            len(node.args) != 2
            or node.kwargs
            or not isinstance(node.args[1], str)
            or node.args[1] not in ATTRIBUTES
        ):
            raise InvalidLoss(
                f"node {node.name!r}: getattr reads one of {sorted(ATTRIBUTES)} of a tensor"
            )
        refused = sorted(k for k, _ in node.kwargs if k in REFUSED_KWARGS)
        if refused:
            raise InvalidLoss(f"node {node.name!r}: no call may take {refused}")
        for arg in (*node.args, *(v for _, v in node.kwargs)):
            _check_arg(arg, defined, node.name, 0, leaves)

    def _check_output(self, node: LossNode) -> None:
        out = node.args[0] if len(node.args) == 1 and not node.kwargs else None
        pair = out.get("tuple") if isinstance(out, Mapping) else out
        if not (isinstance(pair, list | tuple) and len(pair) == 2):
            raise InvalidLoss("a loss graph returns (loss, metrics)")
        loss, metrics = pair
        if not (isinstance(loss, Mapping) and "ref" in loss):
            raise InvalidLoss("a loss graph returns its loss as a tensor it computed")
        metrics = metrics.get("dict") if isinstance(metrics, Mapping) else None
        if not isinstance(metrics, Mapping):
            raise InvalidLoss("a loss graph returns its metrics as a dict")
        for key, value in metrics.items():
            if not _METRIC_KEY.fullmatch(str(key)) or not (
                isinstance(value, Mapping) and "ref" in value
            ):
                raise InvalidLoss(
                    f"metric {key!r}: named custom/<name>:sum or custom/<name>:mean in "
                    "lowercase, a tensor the graph computed"
                )


def _check_arg(arg: Any, defined: set[str], where: str, depth: int, leaves: list[int]) -> None:
    """Raise unless ``arg`` is a well-formed encoded argument whose references are to
    ``defined`` nodes (``leaves[0]``: the graph's constants and references so far)."""
    if depth > _MAX_DEPTH:
        raise InvalidLoss(f"node {where!r}: an argument nested more than {_MAX_DEPTH} deep")
    leaves[0] += 1
    if leaves[0] > MAX_LEAVES:
        raise InvalidLoss(f"a loss graph's arguments hold at most {MAX_LEAVES} values")
    if arg is None or isinstance(arg, bool | int):
        if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > 2**62:
            raise InvalidLoss(f"node {where!r}: an integer argument past 2**62")
        return
    if isinstance(arg, float):
        if not math.isfinite(arg):
            raise InvalidLoss(f"node {where!r}: a non-finite number is sent as {{'float': ...}}")
        return
    if isinstance(arg, str):
        if len(arg) > 64:
            raise InvalidLoss(f"node {where!r}: a string argument past 64 characters")
        return
    items: Sequence[Any] = ()
    if isinstance(arg, list | tuple):
        items = arg
    elif isinstance(arg, Mapping) and len(arg) == 1 and next(iter(arg)) in _ENCODED:
        ((kind, value),) = arg.items()
        if kind in ("ref", "float", "dtype") and not isinstance(value, str):
            raise InvalidLoss(f"node {where!r}: {{{kind!r}: ...}} holds a string")
        if kind == "ref":
            if value not in defined:
                raise InvalidLoss(f"node {where!r} refers to {value!r}, not an earlier node")
            return
        if kind == "float":
            if value not in ("inf", "-inf", "nan"):
                raise InvalidLoss(f"node {where!r}: {{'float': {value!r}}}")
            return
        if kind == "dtype":
            if value not in DTYPES:
                raise InvalidLoss(f"node {where!r}: dtype {value!r} is not one of {DTYPES}")
            return
        if kind == "ellipsis":
            return
        if kind == "slice" and not (isinstance(value, list) and len(value) == 3):
            raise InvalidLoss(f"node {where!r}: a slice is [start, stop, step]")
        if kind == "dict":
            if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
                raise InvalidLoss(f"node {where!r}: a dict argument has string keys")
            value = list(value.values())
        if not isinstance(value, list | tuple):
            raise InvalidLoss(f"node {where!r}: {{{kind!r}: ...}} holds a list")
        items = value
    else:
        raise InvalidLoss(f"node {where!r}: an argument of an unknown encoding: {arg!r:.80}")
    if len(items) > _MAX_ITEMS:
        raise InvalidLoss(f"node {where!r}: an argument of more than {_MAX_ITEMS} items")
    for item in items:
        _check_arg(item, defined, where, depth + 1, leaves)


def _plain(node: LossNode) -> list[Any]:
    return [node.op, node.name, node.target, list(node.args), [list(kv) for kv in node.kwargs]]
