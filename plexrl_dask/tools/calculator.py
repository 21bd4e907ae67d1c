"""The calculator tool: exact integer arithmetic on an expression.

Input: an expression of non-negative integer literals, ``+ - * // %``, unary minus and
parentheses (``/`` is taken as ``//``: an exact answer, never a float). Output: its value in
decimal. Evaluated from the parsed syntax tree (never ``eval``), with bounds so that no input
can make it slow: at most :data:`MAX_INPUT` characters, literals of at most :data:`MAX_DIGITS`
digits, results of at most :data:`MAX_DIGITS` digits. Anything else is an
:class:`~plexrl_dask.errors.InvalidToolCall` (division by zero included): the turn's
observation then says why.
"""

from __future__ import annotations

import ast
import operator
import threading

from plexrl_dask.errors import InvalidToolCall

MAX_INPUT = 200
MAX_DIGITS = 40
#: One parse at a time per process: CPython 3.11's parser raised ``SystemError("AST constructor
#: recursion depth mismatch")`` when a tool worker's threads parsed at once (bench.agentic).
_PARSING = threading.Lock()

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Div: operator.floordiv,
    ast.Mod: operator.mod,
}


class Calculator:
    """The ``calc`` tool (see the module docstring)."""

    name = "calc"

    def run(self, text: str) -> str:
        if len(text) > MAX_INPUT:
            raise InvalidToolCall(f"an expression has at most {MAX_INPUT} characters")
        try:
            with _PARSING:
                tree = ast.parse(text.strip(), mode="eval")
        except SyntaxError:
            raise InvalidToolCall(f"not an expression: {text!r:.60}") from None
        return str(_value(tree.body))


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if right == 0 and type(node.op) in (ast.FloorDiv, ast.Div, ast.Mod):
            raise InvalidToolCall("division by zero")
        return _bounded(_BINARY[type(node.op)](left, right))
    raise InvalidToolCall(f"only integers, + - * / // % and parentheses: {ast.dump(node)[:60]}")


def _bounded(value: int) -> int:
    if len(str(abs(value))) > MAX_DIGITS:
        raise InvalidToolCall(f"a number of more than {MAX_DIGITS} digits")
    return value
