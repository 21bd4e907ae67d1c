"""Tools of agentic episodes: the call format (:mod:`.calls`), the calculator, the Python
sandbox, and the pool that runs calls off the model workers (:mod:`.pool`)."""

from plexrl_dask.tools.calculator import Calculator
from plexrl_dask.tools.calls import Tool, ToolCall, ToolResult, parse_call, run_call, stop_strings
from plexrl_dask.tools.pool import ToolPool, tool_workers
from plexrl_dask.tools.sandbox import PythonSandbox, SandboxLimits, isolation

__all__ = [
    "Calculator",
    "PythonSandbox",
    "SandboxLimits",
    "Tool",
    "ToolCall",
    "ToolPool",
    "ToolResult",
    "isolation",
    "parse_call",
    "run_call",
    "stop_strings",
    "tool_workers",
]
