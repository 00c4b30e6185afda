"""Verifiable tasks, the multi-turn episode protocol, and rewards. Pure functions; no torch.

The request manager drives an episode with :func:`next_action` and never needs to know the
task: generate a turn, maybe call a tool, generate again, finish, :func:`score`.

Token layout of an episode (what the trainer sees, concatenated)::

    <bos> prompt text <eot> | assistant turn ... <eot>|<call> | <result> tool text <eot> | ...

Tool tasks ("lookup", "calc") are structured: the first assistant turn *is* the tool query,
whatever its stop reason. A random-init policy rarely emits ``<call>``, and the rollout-recovery
machinery (tool-turn prefixes) must be exercised from step 0, so every tool episode calls its
tool. The answer needs the tool result: the lookup value never appears in the prompt.
"""

from __future__ import annotations

import functools
import hashlib
import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from robustrl.errors import ConfigError
from robustrl.model.tokenizer import CharTokenizer

TASKS: tuple[str, ...] = ("reverse", "copy", "lookup", "calc")
TOOL_OF_TASK: Mapping[str, str] = MappingProxyType({"lookup": "lookup", "calc": "calc"})
#: Letters used by the string tasks and lookup keys; small so a tiny model can learn them fast.
LETTERS = "abcdef"
DIGITS = "0123456789"
#: Longest tool result text put back into the context (the rest is cut).
TOOL_RESULT_MAX_CHARS = 24
_LOOKUP_KEYS = 48


@dataclass(frozen=True)
class Prompt:
    """One task instance. ``meta`` holds the task's hidden facts (lookup key, calc expression)."""

    prompt_id: str
    task: str
    text: str
    answer: str
    needs_tool: bool
    tool: str | None
    meta: dict[str, Any] = field(default_factory=dict, hash=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (for Redis)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Prompt:
        """Inverse of :meth:`to_dict`."""
        return cls(**dict(raw))


@dataclass(frozen=True)
class Turn:
    """One turn of an episode. Tool turns have no logprobs and ``weights_version`` -1."""

    role: Literal["assistant", "tool"]
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    weights_version: int = -1
    stop_reason: str | None = None
    weights_checksum: str | None = None
    """Of the weights the turn was made with, as the replica served them (None: not said)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (for Redis)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Turn:
        """Inverse of :meth:`to_dict`."""
        return cls(**dict(raw))


@dataclass(frozen=True)
class Generate:
    """Generate the next assistant turn from the episode's prefix."""

    stop_on_call: bool


@dataclass(frozen=True)
class CallTool:
    """Run ``tool`` with ``arg``, append its result as a tool turn. ``error``: the call cannot
    run (it names a tool the episode does not offer); no tool is called and the tool turn is
    this error, as a serving stack answers a call to a tool it does not have."""

    tool: str
    arg: str
    error: str | None = None


@dataclass(frozen=True)
class Finish:
    """The episode is complete; score it."""

    reason: str


Action = Generate | CallTool | Finish


# --- task instances --------------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def lookup_table(seed: int) -> Mapping[str, str]:
    """The lookup service's key -> value table; shared by the task and the tool, fixed by ``seed``."""
    rng = random.Random(f"lookup-table:{seed}")
    keys: set[str] = set()
    while len(keys) < _LOOKUP_KEYS:
        keys.add("".join(rng.choice(LETTERS) for _ in range(3)))
    return MappingProxyType({k: "".join(rng.choice(DIGITS) for _ in range(3)) for k in sorted(keys)})


def _make_prompt(task: str, prompt_id: str, rng: random.Random, seed: int) -> Prompt:
    if task in ("reverse", "copy"):
        word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 5)))
        answer = word[::-1] if task == "reverse" else word
        return Prompt(prompt_id, task, f"{task} {word}:", answer, False, None, {"word": word})
    if task == "lookup":
        table = lookup_table(seed)
        key = rng.choice(sorted(table))
        return Prompt(prompt_id, task, f"lookup {key}:", table[key], True, "lookup", {"key": key})
    if task == "calc":
        a, b, op = rng.randint(1, 20), rng.randint(1, 20), rng.choice("+-*")
        value = a + b if op == "+" else a - b if op == "-" else a * b
        expr = f"{a}{op}{b}"
        return Prompt(prompt_id, task, f"calc {expr}:", str(value), True, "calc", {"expr": expr})
    raise ConfigError(f"unknown task {task!r} (known: {', '.join(TASKS)})", field="data.tasks")


def sample_prompts(tasks: Sequence[str], step: int, n: int, seed: int) -> list[Prompt]:
    """The ``n`` prompts of ``step``: tasks interleaved round-robin, deterministic in all args.

    Raises:
        ConfigError: an unknown task name or an empty task list.
    """
    if not tasks:
        raise ConfigError("at least one task is needed", field="data.tasks")
    for task in tasks:
        if task not in TASKS:
            raise ConfigError(f"unknown task {task!r} (known: {', '.join(TASKS)})", field="data.tasks")
    rng = random.Random(f"prompts:{seed}:{step}")
    return [_make_prompt(tasks[i % len(tasks)], f"s{step}-p{i}", rng, seed) for i in range(n)]


# --- episode protocol --------------------------------------------------------------------------


def initial_prompt_ids(prompt: Prompt, tokenizer: CharTokenizer) -> list[int]:
    """The prefix of the first assistant turn: ``<bos> text <eot>`` for the char tokenizer, the
    chat template's user message (with the tool's schema) for a Hugging Face one."""
    return tokenizer.prompt_ids(prompt.text, prompt.tool)


def episode_ids(prompt: Prompt, turns: Sequence[Turn], tokenizer: CharTokenizer) -> list[int]:
    """Prompt plus every turn: the prefix to generate the next turn from."""
    ids = initial_prompt_ids(prompt, tokenizer)
    for turn in turns:
        ids.extend(turn.token_ids)
    return ids


def request_seed(job_seed: int, episode_id: str, turn_index: int) -> int:
    """Sampling seed of one turn, stable across processes (unlike ``hash()`` of a str).

    A turn re-dispatched after a replica failure gets the same seed, so with the same weights
    it regenerates the same tokens.
    """
    digest = hashlib.blake2b(f"{job_seed}:{episode_id}:{turn_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & 0x7FFFFFFF


def tool_turn_ids(result_text: str, tokenizer: CharTokenizer,
                  max_chars: int = TOOL_RESULT_MAX_CHARS, after: Sequence[int] = ()) -> list[int]:
    """``<result> text <eot>`` (char tokenizer) or the chat template's tool message; text cut to
    ``max_chars``, unknown characters become ``?``. ``after``: the assistant turn's ids it
    follows (the chat frame does not end that turn twice)."""
    return tokenizer.tool_result_ids(result_text[:max_chars], after)


def tool_turn(result_text: str, tokenizer: CharTokenizer) -> Turn:
    """A ready tool :class:`Turn` for ``result_text``."""
    return Turn("tool", tool_turn_ids(result_text, tokenizer), [], -1, None)


def turn_text(turn: Turn, tokenizer: CharTokenizer) -> str:
    """The turn's text for scoring: the final eot/call dropped, other specials shown as NUL.

    Specials inside the text count as wrong characters (rather than vanishing), so a policy
    cannot pad its answers with them for free.
    """
    return tokenizer.turn_text(turn.token_ids)


def tool_call(prompt: Prompt, turn: Turn, tokenizer: CharTokenizer) -> CallTool:
    """The call an assistant turn makes to the episode's tool: its argument is the turn's text,
    specials dropped, stripped (a chat tokenizer reads it, and the tool's name, out of the
    template's tool-call JSON). A call naming another tool than the one the episode offers is
    answered with an error and runs nothing (before, it ran as the offered tool)."""
    name, arg = tokenizer.tool_call(turn.token_ids)
    assert prompt.tool is not None
    # (errors short: a tool turn keeps TOOL_RESULT_MAX_CHARS of its text)
    if name is not None and name != prompt.tool:
        return CallTool(prompt.tool, arg or "", error=f"no tool {name!r}")
    if arg is None:
        return CallTool(prompt.tool, "", error="no argument")
    return CallTool(prompt.tool, arg)


def next_action(prompt: Prompt, turns: Sequence[Turn], tokenizer: CharTokenizer, max_turns: int) -> Action:
    """Decide what the episode does next, from its turns so far.

    - no turn yet, or the last turn is a tool result: generate (unless ``max_turns`` assistant
      turns already exist);
    - the last turn is the first assistant turn of a tool task: call the tool with that turn's
      text, whatever its stop reason;
    - otherwise: finish.
    """
    assistant = sum(1 for t in turns if t.role == "assistant")
    called = any(t.role == "tool" for t in turns)
    if not turns or turns[-1].role == "tool":
        if assistant >= max_turns:
            return Finish("max_turns")
        return Generate(stop_on_call=prompt.needs_tool and not called)
    last = turns[-1]
    if prompt.needs_tool and prompt.tool and not called and assistant < max_turns:
        return tool_call(prompt, last, tokenizer)
    return Finish(last.stop_reason or "done")


# --- rewards ----------------------------------------------------------------------------------


def string_credit(output: str, target: str) -> float:
    """Partial credit in [0, 1] for ``output`` against ``target``.

    0.6 x fraction of positions right (over the longer length), 0.2 x character-multiset F1,
    0.2 x length agreement. The two soft terms give a random policy a gradient toward the right
    alphabet and the right length before it gets positions right; only an exact answer scores 1.
    """
    if not target and not output:
        return 1.0
    longest = max(len(output), len(target))
    positional = sum(1 for a, b in zip(output, target, strict=False) if a == b) / longest
    common = sum(min(output.count(c), target.count(c)) for c in set(target))
    f1 = 2 * common / (len(output) + len(target))
    length = min(len(output), len(target)) / longest
    return 0.6 * positional + 0.2 * f1 + 0.2 * length


def score(prompt: Prompt, turns: Sequence[Turn], tokenizer: CharTokenizer) -> float:
    """Reward in [0, 1] of a finished episode.

    String tasks: :func:`string_credit` of the last assistant turn. Tool tasks: 0.4 x credit of
    the query (first assistant turn vs. the key/expression: the argument of a call in the chat
    template's format, else the turn's text), 0.1 if that turn ended with the tool-call marker
    (neither for a call naming a tool the episode does not offer), 0.5 x credit of the first
    assistant turn after the tool result vs. the answer.
    """
    assistant = [t for t in turns if t.role == "assistant"]
    if not assistant:
        return 0.0
    if not prompt.needs_tool:
        return string_credit(turn_text(assistant[-1], tokenizer), prompt.answer)
    query_target = str(prompt.meta.get("key", prompt.meta.get("expr", "")))
    name, arg = tokenizer.tool_call(assistant[0].token_ids)
    if name is None:  # no call in the template's format (the char tokenizer's turns): the text is the query
        reward = 0.4 * string_credit(turn_text(assistant[0], tokenizer), query_target)
    elif name == prompt.tool:
        # A call in the chat template's format: its argument is the query. (Before, the turn's
        # whole text, JSON and all, was scored against the key: a perfect call scored 0.11 of
        # the 0.4 and the bare key 0.4, teaching the policy to drop the template's format.)
        reward = 0.4 * string_credit(arg or "", query_target)
    else:
        reward = 0.0  # a call to a tool the episode does not offer: no credit for its query
    if assistant[0].stop_reason == "tool_call" and name in (None, prompt.tool):
        reward += 0.1
    seen_tool = False
    for turn in turns:
        if turn.role == "tool":
            seen_tool = True
        elif seen_tool:
            reward += 0.5 * string_credit(turn_text(turn, tokenizer), prompt.answer)
            break
    return min(1.0, max(0.0, reward))
