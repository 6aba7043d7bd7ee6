"""``ArithmeticEnv``: a bundled tool task, a product of two numbers that the model works out
with a ``calculator`` tool; ``answer_reward`` scores the final reply.

A small model cannot multiply two-digit numbers in its head, so the task is solved by calling
the tool and copying its result into the answer: success measures tool use, and it runs
anywhere without downloads."""

import ast
import operator
import random
import re
from typing import Any

from twinkle_agentic.envs.base import Environment, StepResult
from twinkle_agentic.tools.base import function_info

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def calculate(expression: str) -> float | int:
    """The value of an arithmetic expression (numbers, + - * / // %, parentheses); anything
    else is a ``ValueError`` (no names, calls or powers: an expression cannot run code or
    allocate without bound)."""

    def value(node: ast.AST) -> Any:
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, int | float)
            and not isinstance(node.value, bool)
        ):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        raise ValueError(f"only numbers and + - * / // % are allowed, not {ast.dump(node)[:40]}")

    try:
        tree = ast.parse(str(expression).replace("x", "*").replace("×", "*"), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"cannot read {expression!r} as arithmetic") from exc
    result = value(tree.body)
    return int(result) if isinstance(result, float) and result.is_integer() else result


def answer_reward(reply: str, answer: Any) -> float:
    """1.0 when the last number in ``reply`` equals ``answer``, else 0.0."""
    numbers = _NUMBER.findall(reply.replace(",", ""))
    return float(bool(numbers) and float(numbers[-1]) == float(answer))


class ArithmeticEnv(Environment):
    """Each episode asks for ``a * b`` with ``a``, ``b`` in ``[low, high]`` (drawn from the
    reset's seed); ``info['answer']`` holds the product. The ``calculator`` tool evaluates an
    expression; a bad one is an error observation."""

    def __init__(self, low: int = 11, high: int = 99):
        self.low, self.high = low, high
        self.rng = random.Random(0)
        self.answer: int | None = None

    def reset(self, trajectory: Any = None, seed: int | None = None) -> StepResult:
        if seed is not None:
            self.rng = random.Random(seed)
        a, b = self.rng.randint(self.low, self.high), self.rng.randint(self.low, self.high)
        self.answer = a * b
        return StepResult(f"What is {a} * {b}?", info={"answer": self.answer, "question": (a, b)})

    def step(self, tool_name: str, arguments: dict[str, Any]) -> StepResult:
        try:
            return StepResult(str(calculate(arguments.get("expression", ""))))
        except (ValueError, ZeroDivisionError) as exc:
            return StepResult(f"Error: {exc}")

    def tools(self) -> list[dict[str, Any]]:
        parameters = {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 12 * 34"}},
            "required": ["expression"],
        }
        return [function_info("calculator", "Evaluate an arithmetic expression.", parameters)]
