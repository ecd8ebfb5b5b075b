"""Countdown: the completion's equation uses each given number exactly once and reaches the target (d1's rule)."""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Sequence
from fractions import Fraction

from steadyrl.reward.math_answers import MAX_COMPLETION_CHARS, last_boxed, last_tag


COUNTDOWN_CHARS = re.compile(r"[0-9+\-*/()\s]+")
MAX_EQUATION_CHARS = 200
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _evaluate(node: ast.AST) -> Fraction:
    """Exact value of an arithmetic AST: int literals, + - * / and unary +/-, nothing else."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"disallowed expression node {type(node).__name__}")


def evaluate_equation(equation: str) -> Fraction | None:
    """The exact value of an equation made of digits, + - * / ( ) and whitespace (parsed with `ast`, only
    arithmetic nodes allowed; never Python's eval), or None if it is not one or divides by zero."""
    try:
        if len(equation) > MAX_EQUATION_CHARS or not COUNTDOWN_CHARS.fullmatch(equation):
            return None
        return _evaluate(ast.parse(equation.strip(), mode="eval"))
    except Exception:  # noqa: BLE001 - SyntaxError, ZeroDivisionError, RecursionError, ...
        return None


def _find_equation(completion: str) -> tuple[str | None, bool]:
    """(equation, whether it was marked by <answer> tags or \\boxed{}); see extract_equation."""
    text = completion[-MAX_COMPLETION_CHARS:]
    for found in (last_tag(text, "answer"), last_boxed(text)):
        if found is not None and found.strip():
            return found.strip(), True
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return (lines[-1] if lines else None), False


def extract_equation(completion: str) -> str | None:
    """The countdown equation: the content of the last <answer>...</answer>, else of the last \\boxed{},
    else the last non-empty line; stripped. None if there is none."""
    try:
        return _find_equation(completion)[0]
    except Exception:  # noqa: BLE001
        return None


def _countdown_numbers(numbers: Sequence[int | str] | str) -> list[int]:
    items = numbers.split(",") if isinstance(numbers, str) else list(numbers)
    try:
        out = [int(str(n).strip()) for n in items]
    except ValueError:
        raise ValueError(f"countdown numbers must be integers, got {numbers!r}") from None
    if not out:
        raise ValueError("countdown numbers are empty")
    return out


def verify_countdown(completion: str, numbers: Sequence[int | str] | str, target: int | float | str,
                     format_score: float = 0.0) -> float:
    """d1's countdown reward: 1.0 if the equation (extract_equation) consists of digits, + - * / ( ) and
    whitespace, its numbers (maximal digit runs) are exactly `numbers` as a multiset (each used once, all
    used), and its value equals `target` within 1e-5. A wrong equation inside <answer> tags or \\boxed{}
    scores `format_score` (d1: 0.1 for a wrong <answer>; default 0.0), anything else 0.0. `numbers` may
    be a list or "3,5,7"; `target` a number or its text."""
    wanted = sorted(_countdown_numbers(numbers))
    try:
        goal = float(target)
    except (TypeError, ValueError):
        raise ValueError(f"countdown target must be a number, got {target!r}") from None
    try:
        equation, marked = _find_equation(completion)
        if equation is None:
            return 0.0
        value = None
        if len(equation) <= MAX_EQUATION_CHARS and COUNTDOWN_CHARS.fullmatch(equation) \
                and sorted(int(n) for n in re.findall(r"\d+", equation)) == wanted:
            value = evaluate_equation(equation)
        if value is not None and abs(float(value) - goal) < 1e-5:
            return 1.0
        return float(format_score) if marked else 0.0
    except Exception:  # noqa: BLE001 - model output never raises
        return 0.0
