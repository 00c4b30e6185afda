"""Tool calls in a chat model's own format, through the real request manager (real NATS, Redis,
the request manager's own users), judged from the raw episode records and the event log.

A call naming a tool the episode does not offer is answered with an error and runs nothing;
before, it ran as the episode's tool, so a policy was rewarded for a call it got wrong.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from rm_harness import Harness, rm_spec
from support import eventually_async

from robustrl.messages import GenerateTurn, TurnResult
from robustrl.model.hf import ChatTokenizer
from robustrl.model.tiny import make_tiny_hf_model
from robustrl.rl.tools import lookup
from robustrl.subjects import Verb, subject

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny-hf-tools"))


def _call(tok: ChatTokenizer, name: str, key: str) -> list[int]:
    return tok.encode("<tool_call>" + json.dumps({"name": name, "arguments": {"key": key}}) + "</tool_call>")


async def test_a_call_naming_a_tool_the_episode_does_not_offer_is_answered_with_an_error_and_runs_nothing(
        servers: Any, hf_dir: Path) -> None:
    spec = rm_spec("wrong-tool")
    spec["data"] = {"tasks": ["lookup"], "prompts_per_step": 2, "group_size": 2}
    spec["model"] = {"path": str(hf_dir)}
    spec["rollout"] = {"max_new_tokens": 32}  # room for the call in the template's JSON
    tok = ChatTokenizer(hf_dir)
    async with Harness(servers, spec) as h:
        rep = await h.replica("rollout-0-i0")
        named: dict[str, str] = {}  # episode -> the tool its first turn called

        async def answer(msg: GenerateTurn) -> None:
            if msg.turn == 0:
                # Every other episode calls "calc" (not offered by a lookup task) with the key.
                name = named.setdefault(msg.episode_id, "calc" if len(named) % 2 else "lookup")
                ids, stop = _call(tok, name, "abc"), "tool_call"
            else:
                ids, stop = tok.encode("done") + [tok.eot_id], "eot"
            await h.bus.publish(subject(h.job_id, Verb.TURN), TurnResult(
                job_id=h.job_id, request_id=msg.request_id, episode_id=msg.episode_id, member_id=rep.member_id,
                token_ids=ids, logprobs=[-1.0] * len(ids), stop_reason=stop, weights_version=rep.version))

        rep.answer = answer  # type: ignore[method-assign]
        await h.start_rm()
        await eventually_async(lambda: 0 in h.batches, timeout=60, what="step 0 handed over")
        episodes = await h.episodes.get_many(h.batches[0].episode_ids)
        assert {named[ep.episode_id] for ep in episodes} == {"calc", "lookup"}
        for ep in episodes:
            assert ep.status == "finished", ep
            roles = [t.role for t in ep.turns]
            assert roles == ["assistant", "tool", "assistant"], roles
            result = tok.decode(ep.turns[1].token_ids, skip_special=True)
            if named[ep.episode_id] == "lookup":
                assert lookup("abc", spec["seed"]) in result  # the job's table (the tool service's seed)
                assert "error" not in result
            else:
                # Answered as a serving stack answers a call to a tool it does not have; the
                # lookup table's value for the key is nowhere in it.
                assert "error: no tool 'calc'" in result, result
                assert lookup("abc", spec["seed"]) not in result
        # The policy's mistake is no tool fault: the detector's tool-outage rule reads those.
        assert await h.events("tool_fault") == []
