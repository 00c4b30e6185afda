"""CharTokenizer: exact round trip, specials, unknown characters, save/load."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from robustrl.errors import ConfigError
from robustrl.model.tokenizer import CHARS, CharTokenizer


def test_round_trip_every_printable_char() -> None:
    tok = CharTokenizer.default()
    text = CHARS + "reverse abc: cba\n"
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert all(not tok.is_special(i) for i in ids)


def test_special_ids_are_distinct_and_decode() -> None:
    tok = CharTokenizer.default()
    specials = [tok.pad_id, tok.bos_id, tok.eot_id, tok.call_id, tok.result_id]
    assert specials == [0, 1, 2, 3, 4]
    assert tok.vocab_size == len(CHARS) + 5
    ids = [tok.bos_id, *tok.encode("ab"), tok.call_id, tok.result_id, *tok.encode("7"), tok.eot_id]
    assert tok.decode(ids) == "<bos>ab<call><result>7<eot>"
    assert tok.decode(ids, skip_special=True) == "ab7"


def test_unknown_character_is_named() -> None:
    tok = CharTokenizer.default()
    with pytest.raises(ConfigError) as info:
        tok.encode("abc\u00e9d")
    assert "'\u00e9'" in str(info.value)
    assert info.value.position == 3
    assert tok.encode("a\u00e9", errors="replace") == tok.encode("a?")
    with pytest.raises(ConfigError):
        tok.decode([tok.vocab_size])


def test_save_load(tmp_path: Path) -> None:
    tok = CharTokenizer.default()
    tok.save(tmp_path)
    loaded = CharTokenizer.load(tmp_path)
    assert loaded == tok
    assert loaded.encode("hello") == tok.encode("hello")
    with pytest.raises(ConfigError):
        CharTokenizer.load(tmp_path / "missing")


def test_tokenizer_module_does_not_need_torch() -> None:
    # The agent worker imports the tokenizer (through tasks) without torch.
    import robustrl.model.tokenizer as mod

    assert "torch" not in mod.__dict__
    src = Path(mod.__file__).read_text()
    assert "import torch" not in src
    assert sys.modules.get("robustrl.model.tokenizer") is mod
