"""Upstream's module path of ``ToolManager`` (``from twinkle_agentic.tools.tool_manager import
ToolManager``); the class lives in ``twinkle_agentic.tools.manager``."""

from twinkle_agentic.tools.manager import ToolManager

__all__ = ["ToolManager"]
