"""A Hugging Face model directory with its own BPE tokenizer and chat template, end to end.

The directory is made offline (``robustrl.model.tiny``): ``save_pretrained`` of a random-init
Qwen3 model and of a fast tokenizer converted from the SentencePiece BPE model that the
``mistral-common`` package ships, with Qwen's chat specials and a tool-calling template.
"""

from __future__ import annotations

import json

import copy
from pathlib import Path

import pytest
import torch
from jobs import kinds, small_job, wait_done
from support import audit_sampled, sample_batches

from robustrl.config import JobSpec, ModelSpec
from robustrl.errors import ConfigError
from robustrl.model.engine import GenerationEngine, GenRequest
from robustrl.model.engines import make_engine
from robustrl.model.hf import TOOL_SCHEMAS, ChatTokenizer, load_tokenizer
from robustrl.model.policy import build_policy, weights_checksum
from robustrl.model.tiny import make_tiny_hf_model
from robustrl.rl import tasks


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny-hf"))


def test_tokenizer_is_real_bpe_and_matches_autotokenizer(hf_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = load_tokenizer(ModelSpec(path=str(hf_dir)))
    assert isinstance(tok, ChatTokenizer) and tok.vocab_size > 32000
    ids = tok.encode("lookup abc: the quick brown fox")
    assert len(ids) < len("lookup abc: the quick brown fox") / 2  # merges, not characters
    ref = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    for tool in ("lookup", None):
        got = tok.prompt_ids("lookup abc:", tool)
        want = ref.apply_chat_template([{"role": "user", "content": "lookup abc:"}], add_generation_prompt=True,
                                       tools=[TOOL_SCHEMAS[tool]] if tool else None, tokenize=True)
        want = list(want["input_ids"]) if hasattr(want, "keys") else list(want)
        assert got == want
    # A whole tool episode laid out turn by turn is the template's rendering of the conversation.
    call = '<tool_call>{"name": "lookup", "arguments": {"key": "abc"}}</tool_call>'
    episode = tok.prompt_ids("lookup abc:", "lookup") + tok.encode(call) + tok.tool_result_ids("123")
    text = ref.apply_chat_template([{"role": "user", "content": "lookup abc:"},
                                    {"role": "assistant", "content": call},
                                    {"role": "tool", "content": "123"}],
                                   tools=[TOOL_SCHEMAS["lookup"]], add_generation_prompt=True, tokenize=False)
    assert episode == ref.encode(text, add_special_tokens=False)
    # A tool task's turn that stopped on eos (no call marker) is ended once, not twice (before:
    # "abc<|im_end|><|im_end|>\n<|im_start|>user", which no template renders); one that stopped on
    # the call marker gets the frame's end of turn.
    plain = tok.encode("abc") + [tok.eot_id]
    framed = tasks.tool_turn_ids("123", tok, after=tok.encode(call))
    assert framed[0] == tok.eot_id and framed == tok.tool_result_ids("123")
    assert tasks.tool_turn_ids("123", tok, after=plain) == framed[1:]
    assert tok.decode(plain + framed[1:], skip_special=False).count("<|im_end|>") == 2  # the turn's, the tool's


def test_tool_call_in_the_templates_format_drives_the_episode(hf_dir: Path) -> None:
    tok = ChatTokenizer(hf_dir)
    prompt = tasks.sample_prompts(["lookup"], 0, 1, seed=0)[0]
    call = tok.encode('<tool_call>{"name": "lookup", "arguments": {"key": "cab"}}</tool_call>')
    assert call[-1] == tok.call_id
    turn = tasks.Turn("assistant", call, [0.0] * len(call), 0, "tool_call")
    assert tasks.next_action(prompt, [turn], tok, 3) == tasks.CallTool("lookup", "cab")
    # A call naming a tool the episode does not offer runs nothing: it is answered with an error.
    other = tok.encode('<tool_call>{"name": "calc", "arguments": {"key": "cab"}}</tool_call>')
    wrong = tasks.Turn("assistant", other, [0.0] * len(other), 0, "tool_call")
    assert tasks.next_action(prompt, [wrong], tok, 3) == tasks.CallTool("lookup", "cab", error="no tool 'calc'")
    # ... also without a usable argument (before, such a call passed for plain text and ran the
    # episode's tool with the JSON as its argument); a call to the right tool without one runs nothing.
    for body, error in (({"name": "calc", "arguments": {}}, "no tool 'calc'"),
                        ({"name": "calc", "arguments": "x"}, "no tool 'calc'"),
                        ({"name": "lookup", "arguments": {}}, "no argument")):
        ids = tok.encode("<tool_call>" + json.dumps(body) + "</tool_call>")
        action = tasks.next_action(prompt, [tasks.Turn("assistant", ids, [0.0] * len(ids), 0, "tool_call")], tok, 3)
        assert isinstance(action, tasks.CallTool) and action.error == error, (body, action)
    # Not a well-formed call: the turn's plain text is the argument (as with the char tokenizer).
    plain = tasks.Turn("assistant", tok.encode(" abd ") + [tok.eot_id], [], 0, "eot")
    assert tasks.next_action(prompt, [plain], tok, 3) == tasks.CallTool("lookup", "abd")
    result = tasks.tool_turn("417", tok)
    assert "<tool_response>\n417\n</tool_response>" in tok.decode(result.token_ids)
    assert tok.decode(result.token_ids).endswith("<|im_start|>assistant\n")
    answer = tasks.Turn("assistant", tok.encode(prompt.answer) + [tok.eot_id], [], 0, "eot")
    assert tasks.score(prompt, [turn, result, answer], tok) > 0.5
    # The query credit is the call's argument against the key: a perfect call in the template's
    # format earns all of it and the marker's bonus (before: 0.11, and the bare key 0.4, which
    # taught the policy to drop the format); a call naming another tool earns neither.
    key = str(prompt.meta["key"])
    perfect = tok.encode("<tool_call>" + json.dumps({"name": "lookup", "arguments": {"key": key}}) + "</tool_call>")
    wrong_tool = tok.encode("<tool_call>" + json.dumps({"name": "calc", "arguments": {"key": key}}) + "</tool_call>")
    bare = tok.encode(key) + [tok.eot_id]
    no_answer = tasks.Turn("assistant", tok.encode("zz") + [tok.eot_id], [], 0, "eot")

    def query_reward(ids: list[int], stop: str) -> float:
        return tasks.score(prompt, [tasks.Turn("assistant", ids, [], 0, stop), result, no_answer], tok)

    base = query_reward(bare, "eot") - 0.4  # the answer turn's share, the same in all three
    assert query_reward(perfect, "tool_call") == pytest.approx(base + 0.5)
    assert query_reward(bare, "eot") == pytest.approx(base + 0.4)
    assert query_reward(wrong_tool, "tool_call") == pytest.approx(base)
    empty_wrong = tok.encode("<tool_call>" + json.dumps({"name": "calc", "arguments": {}}) + "</tool_call>")
    assert query_reward(empty_wrong, "tool_call") == pytest.approx(base)  # no marker bonus either


def test_the_jobs_template_variables_and_reasoning_blocks(hf_dir: Path) -> None:
    """``model.chat_template_kwargs`` reach the template as apply_chat_template's keyword arguments
    do (Qwen3's ``enable_thinking``: False opens the turn with an empty think block); scoring reads
    a turn's answer, not its reasoning; other specials count as wrong characters."""
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    quiet = load_tokenizer(ModelSpec(path=str(hf_dir), chat_template_kwargs={"enable_thinking": False}))
    assert isinstance(quiet, ChatTokenizer) and quiet.template_kwargs == {"enable_thinking": False}
    want = ref.apply_chat_template([{"role": "user", "content": "reverse abc:"}], add_generation_prompt=True,
                                   tokenize=False, enable_thinking=False)
    assert want.endswith("<think>\n\n</think>\n\n")
    assert quiet.prompt_ids("reverse abc:", None) == ref.encode(want, add_special_tokens=False)
    plain = ChatTokenizer(hf_dir)
    assert plain.prompt_ids("reverse abc:", None) != quiet.prompt_ids("reverse abc:", None)
    # The answer after the reasoning is scored; a turn cut inside its reasoning answered nothing.
    thought = plain.encode("<think>\nthe key is abc</think>\n\ncba") + [plain.eot_id]
    assert plain.turn_text(thought) == "cba"
    assert plain.turn_text(plain.encode("<think>\nstill thinking")) == ""
    call = plain.encode('<think>\nuse lookup</think>\n\n<tool_call>{"name": "lookup", "arguments": '
                        '{"key": "abc"}}</tool_call>')
    assert plain.tool_call(call) == ("lookup", "abc")
    # A special token inside an answer is a wrong character, not nothing.
    assert plain.turn_text(plain.encode("cb<|im_start|>a") + [plain.eot_id]) == "cb\x00a"


def test_bad_model_input_names_the_field(hf_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_tokenizer(ModelSpec(path=str(tmp_path / "nope")))
    assert e.value.fields.get("field") == "model.path"
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((hf_dir / "config.json").read_text())
    with pytest.raises(ConfigError, match="no tokenizer"):
        load_tokenizer(ModelSpec(path=str(bare)))
    no_template = tmp_path / "no-template"
    no_template.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (no_template / f).write_text((hf_dir / f).read_text())
    with pytest.raises(ConfigError, match="chat template"):
        load_tokenizer(ModelSpec(path=str(no_template)))
    # A template that fails to render with the job's variables: a ConfigError naming them, in
    # every role that loads the tokenizer (before, a raw TypeError from jinja2).
    calls = tmp_path / "calls-a-variable"
    calls.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (calls / f).write_text((hf_dir / f).read_text())
    (calls / "chat_template.jinja").write_text((hf_dir / "chat_template.jinja").read_text()
                                               if (hf_dir / "chat_template.jinja").is_file() else
                                               json.loads((hf_dir / "tokenizer_config.json").read_text())["chat_template"])
    (calls / "chat_template.jinja").write_text("{{ greeting() }}" + (calls / "chat_template.jinja").read_text())
    with pytest.raises(ConfigError) as e:
        load_tokenizer(ModelSpec(path=str(calls), chat_template_kwargs={"greeting": "hello"}))
    assert e.value.fields.get("field") == "model.chat_template_kwargs" and "does not render" in str(e.value)
    with pytest.raises(ConfigError, match="rollout.engine"):
        JobSpec.parse({"rollout": {"engine": "tgi"}})
    with pytest.raises(ConfigError, match="model.path"):
        make_engine(JobSpec.parse({"rollout": {"engine": "vllm"}}))  # vllm needs an HF directory


def _marker_tokenizer(tok: ChatTokenizer, call_id: int) -> ChatTokenizer:
    """The same tokenizer with another token as the tool-call marker: a random model never emits
    ``</tool_call>`` on its own, but it does emit its greedy tokens."""
    other = copy.copy(tok)
    other.call_id = call_id
    return other


def test_torch_engine_on_the_hf_model_stops_on_the_marker_and_loads_in_place(hf_dir: Path) -> None:
    tok = ChatTokenizer(hf_dir)
    model = build_policy(ModelSpec(path=str(hf_dir)), tok, 0)
    engine = GenerationEngine(model, tok, max_batch=4)
    prompt = tok.prompt_ids("lookup abc:", "lookup")
    greedy = engine.generate([GenRequest("g", prompt, 8, temperature=0.0, stop_on_call=False)])[0]
    assert greedy.stop_reason == "length" and len(greedy.token_ids) == 8
    k = next(i for i in range(2, 8) if greedy.token_ids[i] not in greedy.token_ids[:i])
    marked = GenerationEngine(model, _marker_tokenizer(tok, greedy.token_ids[k]), max_batch=4)
    got = marked.generate([GenRequest("m", prompt, 8, temperature=0.0, stop_on_call=True)])[0]
    assert got.stop_reason == "tool_call" and got.token_ids == greedy.token_ids[:k + 1]
    # In place: other weights change the output; the old ones restore it exactly.
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        other = {n: t + 0.05 * torch.randn_like(t) for n, t in before.items()}
    engine.load_weights(other)  # copies only; the checksum is computed explicitly
    assert weights_checksum(engine.model) == weights_checksum(other)
    assert engine.generate([GenRequest("g", prompt, 8, temperature=0.0, stop_on_call=False)])[0].token_ids \
        != greedy.token_ids
    engine.load_weights(before, checksum=weights_checksum(before))  # the optional read-back check passes
    assert engine.generate([GenRequest("g", prompt, 8, temperature=0.0, stop_on_call=False)])[0].token_ids \
        == greedy.token_ids


def test_both_engines_take_the_jobs_context_limit(hf_dir: Path) -> None:
    """model.max_positions bounds prompt + response in the torch engine as it does vLLM's
    max_model_len. Before, the torch engine took the directory's own limit (the tiny model's 512,
    Qwen3's 40,960) where vLLM cut the same turns at model.max_positions."""
    spec = JobSpec.parse({"model": {"path": str(hf_dir), "max_positions": 128}})
    engine, tok = make_engine(spec)
    assert engine.max_positions == 128
    prompt = tok.prompt_ids("lookup abc:", "lookup")
    assert 64 < len(prompt) < 128, len(prompt)
    out = engine.generate([GenRequest("g", prompt, 200, temperature=0.0, stop_on_call=False)])[0]
    assert out.stop_reason == "length" and len(prompt) + len(out.token_ids) == 128


def test_torch_engine_abort_ends_the_generation_in_flight(hf_dir: Path) -> None:
    import threading

    from robustrl.model.engine import GenerationAborted

    tok = ChatTokenizer(hf_dir)
    engine = GenerationEngine(build_policy(ModelSpec(path=str(hf_dir)), tok, 0), tok, max_batch=2)
    prompt = tok.prompt_ids("reverse abc:", None)
    produced: list[int] = []

    def on_token(n: int) -> None:
        produced.append(n)
        if len(produced) == 3:  # in flight: abort from another thread, as the replica would
            t = threading.Thread(target=engine.abort)
            t.start()
            t.join()

    with pytest.raises(GenerationAborted):
        engine.generate([GenRequest("long", prompt, 400, stop_on_call=False)], on_token=on_token)
    assert len(produced) == 3  # stopped before the next decode step, not at the length limit
    # The next call is not aborted (abort ends what is in flight, nothing later).
    assert len(engine.generate([GenRequest("next", prompt, 4, stop_on_call=False)])[0].token_ids) == 4


def test_a_job_trains_the_hf_model_through_trainer_rm_and_replicas(stack, api, infra, hf_dir: Path,
                                                                    tmp_path: Path) -> None:
    """Two steps of GRPO on the HF directory: the request manager renders the chat template, the
    replicas generate with the torch engine, the trainer gang trains and publishes, the replicas
    load every version."""

    spec = small_job("hf", steps=2, model={"path": str(hf_dir), "max_positions": 512},
                     data={"tasks": ["lookup", "reverse"], "prompts_per_step": 2, "group_size": 2},
                     rollout={"replicas": 1, "max_new_tokens": 8})
    job = api.submit(spec)
    sampler = sample_batches(infra.redis_url, job["job_id"])
    status = wait_done(api, job["job_id"], timeout=240.0)
    events = api.events(job["job_id"])
    assert status["committed_step"] == 1
    checksums = [e["checksum"] for e in kinds(events, "step_committed")]
    assert len(set(checksums)) == 2  # each step trained the model into new weights
    loaded = {d["version"] for d in kinds(events, "weights_loaded")}
    assert {0, 1} <= loaded
    assert any(d["tool_wait_s"] > 0 for d in kinds(events, "batch_ready")), "no tool turn"
    audit_sampled(infra, job["job_id"], sampler)  # raises naming every violation

    # The trained policy out of the job's checkpoint, as a user gets it (`robustrl export`): a
    # model directory transformers loads, with the weights the trainer committed last, and the
    # job's tokenizer and chat template.
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from robustrl.cli import app

    out = tmp_path / "exported"
    run = CliRunner().invoke(app, ["export", job["job_id"], str(out)], env=infra.to_env())
    assert run.exit_code == 0, run.output
    exported = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    assert weights_checksum(exported) == checksums[-1]
    assert json.loads((out / "robustrl-export.json").read_text())["step"] == 1
    assert ChatTokenizer(out).prompt_ids("lookup abc:", "lookup") == ChatTokenizer(hf_dir).prompt_ids("lookup abc:", "lookup")
    # Bad input: clear errors, nothing overwritten.
    before = sorted(p.name for p in out.iterdir())
    again = CliRunner().invoke(app, ["export", job["job_id"], str(out)], env=infra.to_env())
    assert again.exit_code == 2 and "nothing is overwritten" in again.output
    assert sorted(p.name for p in out.iterdir()) == before
    no_step = CliRunner().invoke(app, ["export", job["job_id"], str(tmp_path / "s"), "--step", "99"], env=infra.to_env())
    assert no_step.exit_code == 2 and "no checkpoint of step 99" in no_step.output
    no_job = CliRunner().invoke(app, ["export", "nope-job", str(tmp_path / "n")], env=infra.to_env())
    assert no_job.exit_code == 2 and "no job 'nope-job'" in no_job.output


def test_the_models_own_eos_ends_a_turn_in_the_torch_engine_as_in_vllm(hf_dir: Path, tmp_path: Path) -> None:
    """A model whose ``generation_config.json`` names eos ids beside the template's (a Qwen3 base
    model: ``<|endoftext|>`` and ``<|im_end|>``): vLLM stops on them by default, and the torch
    engine went on past them, so the two engines made different turns of one model. Both stop
    on every one now (``stop_ids``), and a bad value names the field."""
    import json
    import shutil

    tok = ChatTokenizer(hf_dir)
    model = build_policy(ModelSpec(path=str(hf_dir)), tok, 0)
    engine = GenerationEngine(model, tok, max_batch=4)
    prompt = tok.prompt_ids("lookup abc:", "lookup")
    greedy = engine.generate([GenRequest("g", prompt, 8, temperature=0.0, stop_on_call=False)])[0]
    k = next(i for i in range(2, 8) if greedy.token_ids[i] not in greedy.token_ids[:i])
    other = tmp_path / "with-eos"
    shutil.copytree(hf_dir, other)
    (other / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eot_id, greedy.token_ids[k]]}))
    with_eos = ChatTokenizer(other)
    assert with_eos.stop_ids == (tok.eot_id, greedy.token_ids[k])
    got = GenerationEngine(model, with_eos, max_batch=4).generate(
        [GenRequest("e", prompt, 8, temperature=0.0, stop_on_call=False)])[0]
    assert got.stop_reason == "eot" and got.token_ids == greedy.token_ids[:k + 1], got
    assert with_eos.turn_text(got.token_ids) == with_eos.turn_text(greedy.token_ids[:k])
    (other / "generation_config.json").write_text(json.dumps({"eos_token_id": "<|endoftext|>"}))
    with pytest.raises(ConfigError) as err:
        ChatTokenizer(other)
    assert err.value.field == "model.path" and "eos_token_id" in str(err.value)
