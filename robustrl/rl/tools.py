"""The tool service the agent worker calls: lookup and calculator, with latency, retries, outages.

No torch. A tool fault (outage, timeout) is never an exception to the caller: after the retries
the call returns ``ok=False`` with the reason, and the episode continues with an error text as
its tool turn (DESIGN section 3: a slow or dead tool is a tool fault, not a rollout fault).
"""

from __future__ import annotations

import ast
import asyncio
import operator
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from robustrl.aio import within
from robustrl.errors import RobustRLError
from robustrl.rl.tasks import lookup_table

TOOLS: tuple[str, ...] = ("lookup", "calc")
_MAX_EXPR_CHARS = 64
_MAX_MAGNITUDE = 10**12


class ToolError(RobustRLError):
    """A tool attempt failed; ``retryable`` says whether another attempt can help."""

    retryable = True


class ToolUnavailable(ToolError):
    """The tool service refused the call (outage)."""


class BadToolCall(ToolError):
    """Unknown tool name; retrying cannot help."""

    retryable = False


@dataclass(frozen=True)
class ToolResult:
    """Outcome of a call. ``text`` is what goes into the tool turn (an error text when not ok)."""

    text: str
    ok: bool
    attempts: int
    elapsed_s: float
    error: str | None = None


# --- the tools themselves (pure) ---------------------------------------------------------------

_BINOPS: dict[type[ast.operator], Callable[[int, int], int]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
}


def _calc_node(node: ast.AST) -> int:
    # A whitelist walk over the parsed tree: integers, + - * // % and unary minus, nothing else
    # (no names, calls, attributes or powers), so no input can run code or blow up memory.
    if isinstance(node, ast.Expression):
        return _calc_node(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        value = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        inner = _calc_node(node.operand)
        value = -inner if isinstance(node.op, ast.USub) else inner
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _calc_node(node.left), _calc_node(node.right)
        if isinstance(node.op, ast.FloorDiv | ast.Mod) and right == 0:
            raise ValueError("division by zero")
        value = _BINOPS[type(node.op)](left, right)
    else:
        raise ValueError("only integers and + - * // % are allowed")
    if abs(value) > _MAX_MAGNITUDE:
        raise ValueError("number too large")
    return value


def calculate(expression: str) -> str:
    """Evaluate integer arithmetic safely; return the result, or ``error: ...`` for bad input.

    ``/`` is integer division (``//``); the calculator never evaluates Python.
    """
    expr = expression.strip().replace("/", "//").replace("////", "//")
    if not expr or len(expr) > _MAX_EXPR_CHARS:
        return "error: bad expression"
    try:
        tree = ast.parse(expr, mode="eval")
        return str(_calc_node(tree))
    except (SyntaxError, ValueError, RecursionError) as exc:
        reason = exc.msg if isinstance(exc, SyntaxError) else str(exc)
        return f"error: {reason or 'bad expression'}"


def lookup(key: str, seed: int) -> str:
    """Value of ``key`` in the job's table; a missing key gets the value of the closest key.

    Closest = most positions equal, then closest length, then alphabetical. Like a search
    service it always answers something, so a policy whose query is almost right still sees a
    value to copy, and the reward (which checks the *true* value) improves as the query does.
    """
    table = lookup_table(seed)
    key = key.strip()
    if key in table:
        return table[key]
    best = min(table, key=lambda k: (-sum(a == b for a, b in zip(k, key, strict=False)),
                                     abs(len(k) - len(key)), k))
    return table[best]


def run_tool(name: str, arg: str, seed: int) -> str:
    """Run a tool with no latency or faults (the pure answer).

    Raises:
        BadToolCall: unknown tool name.
    """
    if name == "lookup":
        return lookup(arg, seed)
    if name == "calc":
        return calculate(arg)
    raise BadToolCall(f"unknown tool {name!r} (known: {', '.join(TOOLS)})", tool=name)


# --- the service -------------------------------------------------------------------------------


class ToolService:
    """Tools behind a simulated remote service: latency, per-attempt timeout, retries, outages.

    Args:
        seed: the job seed; the lookup table is the one the lookup task samples from.
        clock: monotonic clock (injectable so outage windows can be tested without sleeping).
    """

    def __init__(self, seed: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.seed = seed
        self._clock = clock
        self._outage_until: float | None = None
        self._outage_mode: Literal["error", "hang"] = "error"
        self.calls = 0
        self.failed_attempts = 0

    def set_outage(self, until_monotonic: float, mode: Literal["error", "hang"] = "error") -> None:
        """Make attempts fail until ``until_monotonic`` (the chaos harness's ``tool_outage``).

        ``mode="error"`` refuses each attempt after its latency; ``"hang"`` leaves it unanswered
        until the window closes, so it usually runs into the per-attempt timeout.
        """
        self._outage_until = until_monotonic
        self._outage_mode = mode

    def clear_outage(self) -> None:
        """End any outage now."""
        self._outage_until = None

    def in_outage(self) -> bool:
        """True while an outage window is open."""
        return self._outage_until is not None and self._clock() < self._outage_until

    async def _attempt(self, name: str, arg: str, latency_s: float) -> str:
        if latency_s > 0:
            await asyncio.sleep(latency_s)
        if self.in_outage():
            if self._outage_mode == "error":
                raise ToolUnavailable(f"tool {name!r} unavailable (outage)", tool=name)
            assert self._outage_until is not None
            await asyncio.sleep(max(0.0, self._outage_until - self._clock()))
        return run_tool(name, arg, self.seed)

    async def call(self, name: str, arg: str, *, latency_s: float, timeout_s: float, retries: int,
                   backoff_s: float) -> ToolResult:
        """Call a tool; never raises for tool faults.

        Args:
            name, arg: the tool and its argument.
            latency_s: service latency of every attempt.
            timeout_s: limit of one attempt.
            retries: attempts after the first; waits ``backoff_s * 2**i`` before retry ``i + 1``.

        Returns:
            ``ok=True`` with the tool's answer, or ``ok=False`` with ``error: <reason>`` as text.
        """
        self.calls += 1
        start = self._clock()
        attempts = 0
        last_error = "no attempt made"
        for attempt in range(retries + 1):
            attempts += 1
            try:
                text = await within(self._attempt(name, arg, latency_s), timeout_s)
                return ToolResult(text, True, attempts, self._clock() - start, None)
            except TimeoutError:
                last_error = f"timed out after {timeout_s:g}s"
            except BadToolCall as exc:
                last_error = exc.message
                self.failed_attempts += 1
                break
            except ToolError as exc:
                last_error = exc.message
            self.failed_attempts += 1
            if attempt < retries and backoff_s > 0:
                await asyncio.sleep(backoff_s * (2**attempt))
        return ToolResult(f"error: {last_error}", False, attempts, self._clock() - start, last_error)
