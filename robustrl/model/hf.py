"""A Hugging Face model directory's own tokenizer and chat template, without torch.

The request manager renders prompts and tool results with it and never loads torch, so this
module uses the ``tokenizers`` library (the Rust tokenizer behind every fast HF tokenizer) and
renders the chat template with jinja2 the way ``transformers`` does (sandboxed, ``trim_blocks``,
``lstrip_blocks``, ``tojson``, ``raise_exception``). ``tests/test_hf_model.py`` checks that the
ids are those of ``AutoTokenizer.apply_chat_template`` on the same directory.

Episode layout (what the trainer sees, concatenated)::

    template(user prompt, tools) + generation prompt | assistant turn ... <eos>|</tool_call>
    | end of assistant turn + template(tool result) + generation prompt | assistant turn ...

A tool call is in the template's format, e.g. Qwen's
``<tool_call>{"name": "lookup", "arguments": {"key": "abc"}}</tool_call>``; the closing marker
must be one token (Qwen2.5/Qwen3 ship it as an added token), the engines stop on it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from robustrl.errors import ConfigError

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
_FIELD = "model.path"
_ASSISTANT_MARK = "\x01ASSISTANT\x01"
_RESULT_MARK = "\x01RESULT\x01"

#: JSON-schema descriptions of the job's tools, as chat templates expect them in ``tools``.
TOOL_SCHEMAS: Mapping[str, dict[str, Any]] = {
    "lookup": {"type": "function", "function": {
        "name": "lookup", "description": "Value stored under a three-letter key.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}},
    "calc": {"type": "function", "function": {
        "name": "calc", "description": "Evaluate integer arithmetic (+ - * // %).",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}},
}


THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def answer_text(text: str) -> str:
    """What a turn answers, its reasoning left out: the text after the last ``</think>`` (a
    reasoning model's, e.g. Qwen3 with thinking on), without the newlines that follow it (as
    Qwen3's template shows a past turn); nothing when a ``<think>`` block never closed (the turn
    ran out inside it); the text itself when it has no block."""
    end = text.rfind(THINK_CLOSE)
    if end >= 0:
        return text[end + len(THINK_CLOSE):].lstrip("\n")
    return "" if THINK_OPEN in text else text


def _token_text(raw: object) -> str | None:
    if isinstance(raw, dict):
        raw = raw.get("content")
    return raw if isinstance(raw, str) else None


def is_hf_dir(path: str | Path) -> bool:
    """True when ``path`` holds a Hugging Face tokenizer (not RobustRL's char tokenizer)."""
    tj = Path(path) / "tokenizer.json"
    if not tj.is_file():
        return False
    try:
        with tj.open() as f:
            head = f.read(200)
    except OSError:
        return False
    return '"robustrl-char-v1"' not in head


class ChatTokenizer:
    """The directory's tokenizer + chat template behind the episode-tokenizer interface.

    Attributes mirror :class:`~robustrl.model.tokenizer.CharTokenizer`: ``pad_id``, ``eot_id``
    (end of turn: the template's eos, e.g. ``<|im_end|>``), ``call_id`` (the closing tool-call
    marker), ``vocab_size``.

    Raises (constructor):
        ConfigError: (field ``model.path``) no tokenizer, no chat template, or no single-token
            tool-call marker in the directory.
    """

    kind = "hf"

    def __init__(self, path: str | Path, template_kwargs: Mapping[str, Any] | None = None) -> None:
        from tokenizers import Tokenizer  # no torch

        self.path = Path(path)
        self.template_kwargs = dict(template_kwargs or {})
        tj = self.path / "tokenizer.json"
        if not tj.is_file():
            raise ConfigError(f"{self.path} has no tokenizer.json (a fast Hugging Face tokenizer is needed)",
                              field=_FIELD)
        try:
            self._tok = Tokenizer.from_file(str(tj))
        except Exception as exc:  # the Rust side raises plain Exception subclasses
            raise ConfigError(f"cannot read tokenizer {tj}: {exc}", field=_FIELD) from exc
        cfg_path = self.path / "tokenizer_config.json"
        cfg: dict[str, Any] = {}
        if cfg_path.is_file():
            try:
                cfg = json.loads(cfg_path.read_text())
            except ValueError as exc:
                raise ConfigError(f"cannot read {cfg_path}: {exc}", field=_FIELD) from exc
        template = cfg.get("chat_template")
        jinja_file = self.path / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text()
        if isinstance(template, list):  # named templates: take "default"
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if not isinstance(template, str) or not template:
            raise ConfigError(f"{self.path} has no chat template (tokenizer_config.json chat_template "
                              "or chat_template.jinja)", field=_FIELD)
        self.chat_template = template
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        pad_token = _token_text(cfg.get("pad_token"))
        if self.eos_token is None or self._tok.token_to_id(self.eos_token) is None:
            raise ConfigError(f"{self.path}: tokenizer_config.json names no eos_token in the vocabulary",
                              field=_FIELD)
        self.eot_id = int(self._tok.token_to_id(self.eos_token))
        self.stop_ids: tuple[int, ...] = (self.eot_id, *self._generation_eos())
        """Ids that end a turn: the template's eos, then the model's own (``generation_config.json``
        ``eos_token_id``, e.g. a Qwen3 base model's ``<|endoftext|>`` beside ``<|im_end|>``), as
        vLLM stops on by default; both engines stop on every one of them."""
        call = self._tok.token_to_id(CALL_CLOSE)
        if call is None:
            raise ConfigError(f"{self.path}: {CALL_CLOSE!r} is not one token of this tokenizer; the "
                              "engines stop a tool call on it", field=_FIELD)
        self.call_id = int(call)
        pad = self._tok.token_to_id(pad_token) if pad_token else None
        self.pad_id = int(pad) if pad is not None else self.eot_id
        bos = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.bos_id = int(bos) if bos is not None else self.pad_id
        self.result_id = self.pad_id  # unused by the chat layout (tool results are templated)
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self._special = {int(i) for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        # longest first: a special whose text holds another's is replaced whole
        self._special_texts = sorted((t.content for t in self._tok.get_added_tokens_decoder().values() if t.special),
                                     key=len, reverse=True)
        self._template = self._compile(template)
        self._result_frame = self._tool_frame()

    def _generation_eos(self) -> list[int]:
        """``generation_config.json``'s ``eos_token_id`` (an id or a list), those in the vocabulary
        and other than the template's eos; none when the file is absent. A file that does not
        parse, or an id that is not an integer, is a ConfigError naming ``model.path``."""
        path = self.path / "generation_config.json"
        if not path.is_file():
            return []
        try:
            raw = json.loads(path.read_text()).get("eos_token_id")
        except (ValueError, AttributeError) as exc:
            raise ConfigError(f"cannot read {path}: {exc}", field=_FIELD) from exc
        ids = raw if isinstance(raw, list) else [] if raw is None else [raw]
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ConfigError(f"{path}: eos_token_id must be an id or a list of ids, got {raw!r}", field=_FIELD)
        size = self._tok.get_vocab_size(with_added_tokens=True)
        return list(dict.fromkeys(i for i in ids if 0 <= i < size and i != self.eot_id))

    # --- rendering -----------------------------------------------------------------------

    def _compile(self, template: str) -> Any:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ConfigError(f"chat template: {message}", field=_FIELD)

        def tojson(x: object, ensure_ascii: bool = False, indent: int | None = None,
                   separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)  # as transformers gives templates
        try:
            return env.from_string(template)
        except Exception as exc:
            raise ConfigError(f"chat template does not compile: {exc}", field=_FIELD) from exc

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True) -> str:
        """The template's text for ``messages`` (what ``apply_chat_template(tokenize=False)`` gives,
        with the job's ``model.chat_template_kwargs``, e.g. Qwen3's ``enable_thinking``)."""
        try:
            return str(self._template.render(**self.template_kwargs, messages=messages, tools=tools,
                                             add_generation_prompt=add_generation_prompt,
                                             bos_token=self.bos_token or "", eos_token=self.eos_token or ""))
        except ConfigError:
            raise
        except Exception as exc:  # jinja2's and the template's own errors, whatever their class
            field = "model.chat_template_kwargs" if self.template_kwargs else _FIELD
            raise ConfigError(f"chat template of {self.path} does not render: {exc!r}", field=field) from exc

    def _tool_frame(self) -> tuple[str, str]:
        """Text between the end of an assistant turn's content and a tool result, and after it.

        Rendered once with marker strings, so it holds for any template that shows the assistant
        content verbatim and then the tool message (the template's own turn end included).
        """
        text = self.render([{"role": "user", "content": "u"},
                            {"role": "assistant", "content": _ASSISTANT_MARK},
                            {"role": "tool", "content": _RESULT_MARK}], add_generation_prompt=True)
        a, r = text.find(_ASSISTANT_MARK), text.find(_RESULT_MARK)
        if a < 0 or r < a:
            raise ConfigError("chat template does not show assistant and tool messages verbatim", field=_FIELD)
        return text[a + len(_ASSISTANT_MARK):r], text[r + len(_RESULT_MARK):]

    # --- the episode-tokenizer interface -----------------------------------------------------

    def encode(self, text: str, errors: Literal["strict", "replace"] = "strict") -> list[int]:
        """Ids of ``text``; special-token text (``<|im_start|>``) becomes its one id. Never fails
        on unknown characters (byte fallback / unk), so ``errors`` is accepted and unused."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of ``ids``.

        Raises:
            ConfigError: an id outside the vocabulary.
        """
        ids = [int(t) for t in ids]
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise ConfigError(f"token id {t} is outside the vocabulary (size {self.vocab_size})", field="ids")
        return str(self._tok.decode(ids, skip_special_tokens=skip_special))

    def is_special(self, token_id: int) -> bool:
        """True for the template's special tokens (eos, markers, pad)."""
        return int(token_id) in self._special

    def prompt_ids(self, text: str, tool: str | None) -> list[int]:
        """The first assistant turn's prefix: the user message (with the tool's schema when the
        task has a tool) and the generation prompt, rendered by the chat template."""
        tools = [TOOL_SCHEMAS[tool]] if tool in TOOL_SCHEMAS else None
        return self.encode(self.render([{"role": "user", "content": text}], tools=tools))

    def tool_result_ids(self, text: str, turn: Sequence[int] = ()) -> list[int]:
        """The assistant turn's end, the tool message with ``text``, and the generation prompt.
        ``turn``: the assistant turn it follows; one that already ended with the end-of-turn
        token the frame begins with (a tool task's turn that stopped on eos, not on the call
        marker) does not get it twice (before: ``...<|im_end|><|im_end|>\n<|im_start|>user``,
        which no template renders)."""
        before, after = self._result_frame
        ids = self.encode(before + text + after)
        # (dropped from the ids, not the text: what follows a special token encodes differently
        # on its own, e.g. with SentencePiece's leading space)
        if turn and ids and turn[-1] in self.stop_ids and ids[0] == turn[-1]:
            ids = ids[1:]
        return ids

    def tool_call(self, ids: Iterable[int]) -> tuple[str | None, str | None]:
        """The tool call in an assistant turn: (the tool it names, its argument). A ``<tool_call>``
        JSON object names its ``name`` (None when it has none), and its argument is the first
        value of its ``arguments`` (an object, or a string holding one); a named call without a
        usable argument has None (it runs nothing). A turn without a call in the template's
        format names no tool and its plain text is the argument (as with the char tokenizer).
        (Before, a call without a usable argument passed for no call at all: a call naming
        another tool with empty arguments ran as the episode's tool.)"""
        text = answer_text(self.decode(ids, skip_special=False))
        start = text.find(CALL_OPEN)
        if start >= 0:
            body = text[start + len(CALL_OPEN):]
            body = body[:body.find(CALL_CLOSE)] if CALL_CLOSE in body else body
            try:
                call = json.loads(body.strip())
            except ValueError:
                call = None
            if isinstance(call, dict):
                name = None if call.get("name") is None else str(call["name"])
                args = call.get("arguments", {})
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except ValueError:
                        args = None
                if isinstance(args, dict) and args:
                    return name, str(next(iter(args.values()))).strip()
                if name is not None:
                    return name, None
        return None, self._without_specials(text).strip()

    def turn_text(self, ids: Iterable[int]) -> str:
        """A turn's text for scoring: the final eos / tool-call marker dropped, a reasoning block
        (``<think>...</think>``) dropped (:func:`answer_text`), other special tokens shown as NUL:
        wrong characters, as with the char tokenizer, so a policy cannot pad its answers with them
        for free (before, they were skipped)."""
        ids = list(ids)
        if ids and (ids[-1] in self.stop_ids or ids[-1] == self.call_id):
            ids.pop()
        return self._without_specials(answer_text(self.decode(ids, skip_special=False)), "\x00")

    def _without_specials(self, text: str, mark: str = "") -> str:
        for special in self._special_texts:
            text = text.replace(special, mark)
        return text

    def __repr__(self) -> str:
        return f"ChatTokenizer({self.path}, vocab_size={self.vocab_size})"


def load_tokenizer(spec: Any) -> Any:
    """The episode tokenizer of a ``ModelSpec``: the char tokenizer for random-init policies and
    directories written by ``save_policy``; the directory's own tokenizer + chat template for a
    Hugging Face model directory.

    Raises:
        ConfigError: (field ``model.path``) the directory is missing or holds no usable tokenizer.
    """
    from robustrl.model.tokenizer import CharTokenizer

    path = getattr(spec, "path", None)
    if not path:
        return CharTokenizer.default()
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"model directory {p} does not exist", field=_FIELD)
    if is_hf_dir(p):
        return ChatTokenizer(p, getattr(spec, "chat_template_kwargs", None))
    if (p / "tokenizer.json").is_file():
        return CharTokenizer.load(p)
    raise ConfigError(f"model directory {p} has no tokenizer (tokenizer.json)", field=_FIELD)
