"""Tools the model calls, and the formats its chat template writes the calls in.

Public names: ``Tool``, ``FunctionTool``, ``ToolOutcome``, ``ToolManager``, ``ToolCallFormat``,
``TOOL_FORMATS``, ``get_format``, ``parse_tool_calls``, ``validate_arguments``."""

from twinkle_agentic.tools.base import FunctionTool, Tool, ToolOutcome
from twinkle_agentic.tools.formats import TOOL_FORMATS, ToolCallFormat, get_format, parse_tool_calls
from twinkle_agentic.tools.manager import ToolManager
from twinkle_agentic.tools.schema import validate_arguments

__all__ = [
    "Tool",
    "FunctionTool",
    "ToolOutcome",
    "ToolManager",
    "ToolCallFormat",
    "TOOL_FORMATS",
    "get_format",
    "parse_tool_calls",
    "validate_arguments",
]
