"""Tasks, episode protocol, rewards and the tool service (no torch needed)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from robustrl.errors import ConfigError
from robustrl.model.tokenizer import CharTokenizer
from robustrl.rl.tasks import (
    CallTool,
    Finish,
    Generate,
    Prompt,
    Turn,
    episode_ids,
    initial_prompt_ids,
    lookup_table,
    next_action,
    request_seed,
    sample_prompts,
    score,
    string_credit,
    tool_turn,
    tool_turn_ids,
)
from robustrl.rl.tools import ToolService, calculate, lookup, run_tool

TOK = CharTokenizer.default()
FAST = {"latency_s": 0.01, "timeout_s": 0.2, "retries": 2, "backoff_s": 0.01}


def assistant(text: str, stop: str = "eot") -> Turn:
    end = {"eot": [TOK.eot_id], "tool_call": [TOK.call_id], "length": []}[stop]
    ids = TOK.encode(text) + end
    return Turn("assistant", ids, [-1.0] * len(ids), 3, stop)


def test_sample_prompts_deterministic_and_interleaved() -> None:
    a = sample_prompts(["reverse", "lookup"], step=4, n=8, seed=1)
    assert a == sample_prompts(["reverse", "lookup"], step=4, n=8, seed=1)
    assert a != sample_prompts(["reverse", "lookup"], step=5, n=8, seed=1)
    assert [p.task for p in a] == ["reverse", "lookup"] * 4
    assert len({p.prompt_id for p in a}) == 8
    for p in a:
        if p.task == "reverse":
            assert p.text == f"reverse {p.answer[::-1]}:" and not p.needs_tool
        else:
            assert p.tool == "lookup" and p.needs_tool
            assert p.answer == lookup_table(1)[p.meta["key"]]
            assert p.answer not in p.text  # the value needs the tool
        assert Prompt.from_dict(p.to_dict()) == p
    calc = sample_prompts(["calc", "copy"], 0, 4, 0)
    assert calculate(calc[0].meta["expr"]) == calc[0].answer
    with pytest.raises(ConfigError):
        sample_prompts(["nope"], 0, 1, 0)


def test_string_credit_partial() -> None:
    assert string_credit("cba", "cba") == 1.0
    assert string_credit("", "cba") == 0.0
    assert string_credit("cbx", "cba") == pytest.approx(0.6 * 2 / 3 + 0.2 * 2 / 3 + 0.2)
    assert string_credit("abc", "cba") == pytest.approx(0.6 * 1 / 3 + 0.2 + 0.2)
    assert 0 < string_credit("cbaxyz", "cba") < string_credit("cba", "cba")


def test_reverse_episode() -> None:
    p = Prompt("p", "reverse", "reverse abc:", "cba", False, None, {"word": "abc"})
    assert initial_prompt_ids(p, TOK) == [TOK.bos_id, *TOK.encode("reverse abc:"), TOK.eot_id]
    assert next_action(p, [], TOK, 3) == Generate(stop_on_call=False)
    turns = [assistant("cba")]
    assert isinstance(next_action(p, turns, TOK, 3), Finish)
    assert score(p, turns, TOK) == 1.0
    assert score(p, [assistant("cbx")], TOK) == pytest.approx(string_credit("cbx", "cba"))
    # a special inside the answer counts as a wrong character
    bad = Turn("assistant", TOK.encode("cb") + [TOK.call_id], [0.0] * 3, 0, "length")
    assert score(p, [bad], TOK) < 1.0
    assert score(p, [], TOK) == 0.0


def test_lookup_episode_transitions_and_score() -> None:
    table = lookup_table(0)
    key = sorted(table)[0]
    p = Prompt("p", "lookup", f"lookup {key}:", table[key], True, "lookup", {"key": key})
    assert next_action(p, [], TOK, 3) == Generate(stop_on_call=True)
    # the first turn is the query whatever its stop reason
    for stop in ("tool_call", "eot", "length"):
        assert next_action(p, [assistant(key, stop)], TOK, 3) == CallTool("lookup", key)
    turns = [assistant(key, "tool_call"), tool_turn(run_tool("lookup", key, 0), TOK)]
    assert turns[1].token_ids == tool_turn_ids(table[key], TOK)
    assert next_action(p, turns, TOK, 3) == Generate(stop_on_call=False)
    assert score(p, turns, TOK) == pytest.approx(0.5)  # query right + call token, no answer yet
    turns.append(assistant(table[key]))
    assert isinstance(next_action(p, turns, TOK, 3), Finish)
    assert score(p, turns, TOK) == pytest.approx(1.0)
    wrong = [assistant("zz", "length"), tool_turn("error: timed out", TOK), assistant("12")]
    assert 0.0 <= score(p, wrong, TOK) < 0.5
    assert isinstance(next_action(p, [assistant(key)], TOK, max_turns=1), Finish)
    assert isinstance(next_action(p, turns[:2], TOK, max_turns=1), Finish)
    assert episode_ids(p, turns, TOK) == initial_prompt_ids(p, TOK) + sum((t.token_ids for t in turns), [])
    assert Turn.from_dict(turns[0].to_dict()) == turns[0]


def test_tool_turn_ids_sanitizes_and_cuts() -> None:
    ids = tool_turn_ids("err\u00e9" + "x" * 100, TOK)
    assert ids[0] == TOK.result_id and ids[-1] == TOK.eot_id
    assert TOK.decode(ids[1:5]) == "err?" and len(ids) == 24 + 2


def test_request_seed_stable() -> None:
    assert request_seed(0, "ep-1", 2) == request_seed(0, "ep-1", 2)
    assert request_seed(0, "ep-1", 2) != request_seed(0, "ep-1", 0)
    out = subprocess.run([sys.executable, "-c", "from robustrl.rl.tasks import request_seed;"
                          "print(request_seed(0, 'ep-1', 2))"], capture_output=True, text=True, check=True)
    assert int(out.stdout) == request_seed(0, "ep-1", 2)


def test_tools_pure() -> None:
    assert calculate("3+4*2") == "11" and calculate("-(7-10)") == "3" and calculate("7/2") == "3"
    for bad in ("__import__('os')", "2**99", "1/0", "a+1", "", "9" * 20):
        assert calculate(bad).startswith("error:"), bad
    table = lookup_table(3)
    key = sorted(table)[5]
    assert lookup(key, 3) == table[key]
    near = lookup(key[:2] + "z", 3)  # closest key answers (a search service, not an exact map)
    assert near in table.values()
    assert lookup_table(3) == lookup_table(3) and lookup_table(3) != lookup_table(4)


async def test_tool_call_ok_and_latency() -> None:
    svc = ToolService(seed=0)
    start = time.monotonic()
    res = await svc.call("calc", "6*7", **FAST)
    assert (res.text, res.ok, res.attempts, res.error) == ("42", True, 1, None)
    assert time.monotonic() - start >= 0.01 and res.elapsed_s >= 0.01
    bad = await svc.call("nope", "x", **FAST)
    assert not bad.ok and bad.attempts == 1 and "unknown tool" in (bad.error or "")


async def test_tool_outage_retries_then_reports() -> None:
    svc = ToolService(seed=0)
    svc.set_outage(time.monotonic() + 60)
    assert svc.in_outage()
    res = await svc.call("lookup", "abc", **FAST)
    assert not res.ok and res.attempts == 3 and "unavailable" in (res.error or "")
    assert res.text.startswith("error:")
    svc.clear_outage()
    ok = await svc.call("lookup", "abc", **FAST)
    assert ok.ok and ok.attempts == 1


async def test_tool_timeout_and_recovery_within_retries() -> None:
    svc = ToolService(seed=0)
    slow = await svc.call("calc", "1+1", latency_s=0.05, timeout_s=0.01, retries=1, backoff_s=0.0)
    assert not slow.ok and slow.attempts == 2 and "timed out" in (slow.error or "")
    # a hang outage shorter than the retry budget: the second attempt succeeds
    svc.set_outage(time.monotonic() + 0.2, mode="hang")
    res = await svc.call("calc", "1+1", latency_s=0.0, timeout_s=0.1, retries=3, backoff_s=0.15)
    assert res.ok and res.text == "2" and res.attempts >= 2


def test_agent_modules_do_not_import_torch() -> None:
    code = ("import sys; import robustrl.rl.tasks, robustrl.rl.tools, robustrl.model.tokenizer;"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
