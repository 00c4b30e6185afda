"""Character-level tokenizer built locally: printable ASCII plus the episode protocol's specials.

No torch here: the request manager's agent worker encodes tool results and decodes queries with
it, and that process never loads torch. One token per character keeps rewards and tool arguments
trivially aligned with token positions, and needs no download.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal

from robustrl.errors import ConfigError

#: Special tokens, in id order. ``eot`` ends any turn (user prompt, assistant answer, tool
#: result); ``call`` ends an assistant turn that is a tool call; ``result`` opens a tool result.
SPECIALS: tuple[str, ...] = ("<pad>", "<bos>", "<eot>", "<call>", "<result>")
#: Newline plus the printable ASCII range (space .. tilde).
CHARS: str = "\n" + "".join(chr(c) for c in range(32, 127))
_FILE = "tokenizer.json"
_FORMAT = "robustrl-char-v1"


class CharTokenizer:
    """Maps each character to one id; specials come first (``pad_id`` is 0)."""

    def __init__(self, chars: str = CHARS, specials: Iterable[str] = SPECIALS) -> None:
        specials = tuple(specials)
        if tuple(specials[: len(SPECIALS)]) != SPECIALS:
            raise ConfigError(f"tokenizer specials must start with {SPECIALS}", field="specials")
        if len(set(chars)) != len(chars):
            raise ConfigError("tokenizer characters must be unique", field="chars")
        self.chars = chars
        self.specials = specials
        self._char_to_id = {ch: len(specials) + i for i, ch in enumerate(chars)}
        self._id_to_text = list(specials) + list(chars)
        self.pad_id, self.bos_id, self.eot_id, self.call_id, self.result_id = range(len(SPECIALS))
        self.stop_ids: tuple[int, ...] = (self.eot_id,)  # (what ends a turn: as ChatTokenizer's)

    @classmethod
    def default(cls) -> CharTokenizer:
        """The tokenizer of the reference job (101 ids)."""
        return cls()

    @property
    def vocab_size(self) -> int:
        """Number of ids, specials included."""
        return len(self._id_to_text)

    def is_special(self, token_id: int) -> bool:
        """True for pad/bos/eot/call/result (and any extra special)."""
        return 0 <= token_id < len(self.specials)

    def encode(self, text: str, errors: Literal["strict", "replace"] = "strict") -> list[int]:
        """Encode ``text`` one id per character.

        Args:
            text: characters from ``CHARS``.
            errors: ``"strict"`` raises on an unknown character; ``"replace"`` maps it to ``?``
                (for text from outside the model's control, such as tool error messages).

        Raises:
            ConfigError: an unknown character in strict mode; ``char`` and ``position`` locate it.
        """
        out: list[int] = []
        for pos, ch in enumerate(text):
            tid = self._char_to_id.get(ch)
            if tid is None:
                if errors == "replace":
                    tid = self._char_to_id["?"]
                else:
                    raise ConfigError(f"character {ch!r} is not in the tokenizer vocabulary",
                                      field="text", char=ch, position=pos)
            out.append(tid)
        return out

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Decode ids; specials are written as their names unless ``skip_special``.

        Raises:
            ConfigError: an id outside ``[0, vocab_size)``.
        """
        parts: list[str] = []
        for tid in ids:
            tid = int(tid)
            if not 0 <= tid < len(self._id_to_text):
                raise ConfigError(f"token id {tid} is outside the vocabulary (size {self.vocab_size})",
                                  field="ids")
            if skip_special and tid < len(self.specials):
                continue
            parts.append(self._id_to_text[tid])
        return "".join(parts)

    # --- the episode-tokenizer interface (shared with hf.ChatTokenizer) -------------------

    kind = "char"

    def prompt_ids(self, text: str, tool: str | None) -> list[int]:
        """``<bos> text <eot>``: the prefix of the first assistant turn (``tool`` is not shown)."""
        return [self.bos_id, *self.encode(text), self.eot_id]

    def tool_result_ids(self, text: str, turn: Sequence[int] = ()) -> list[int]:
        """``<result> text <eot>``; unknown characters become ``?``. (``turn``, the assistant turn
        it follows, changes nothing here: the chat tokenizer's frame depends on how it ended.)"""
        return [self.result_id, *self.encode(text, errors="replace"), self.eot_id]

    def tool_call(self, ids: Iterable[int]) -> tuple[str | None, str | None]:
        """The tool call an assistant turn stands for: it names no tool (the task's runs), and its
        text, specials dropped, stripped, is the argument."""
        return None, self.decode(ids, skip_special=True).strip()

    def turn_text(self, ids: Iterable[int]) -> str:
        """The turn's text for scoring: the final eot/call dropped, other specials shown as NUL
        (so a policy cannot pad its answers with them for free)."""
        ids = list(ids)
        if ids and ids[-1] in (self.eot_id, self.call_id):
            ids.pop()
        return "".join("\x00" if self.is_special(t) else self.decode([t]) for t in ids)

    def save(self, directory: str | Path) -> Path:
        """Write ``tokenizer.json`` into ``directory`` (created if needed); return its path."""
        path = Path(directory) / _FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"format": _FORMAT, "specials": list(self.specials),
                                    "chars": self.chars}))
        return path

    @classmethod
    def load(cls, directory: str | Path) -> CharTokenizer:
        """Read a tokenizer written by :meth:`save`.

        Raises:
            ConfigError: the file is missing or not a RobustRL char tokenizer.
        """
        path = Path(directory) / _FILE
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read tokenizer at {path}: {exc}", field="tokenizer") from exc
        if not isinstance(raw, dict) or raw.get("format") != _FORMAT:
            raise ConfigError(f"{path} is not a {_FORMAT} tokenizer", field="format")
        return cls(chars=raw["chars"], specials=raw["specials"])

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, CharTokenizer) and self.chars == other.chars
                and self.specials == other.specials)

    def __hash__(self) -> int:
        return hash((self.chars, self.specials))

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"
