#!/usr/bin/env bash
# One-shot check of the GPU path on a lent accelerator machine; finishes within ~8 minutes and
# writes one JSON summary ($OUT/gpu-check.json, default out/gpu-check/gpu-check.json).
#
#   bash scripts/gpu-check.sh
#
# Steps (each bounded; a failed step is recorded and the next still runs):
#   1. environment: nvidia-smi, torch with CUDA, NCCL, cupy (imported only here, on the GPU path)
#   2. DLPack: a cupy view of a CUDA weight buffer shares its device memory (no copy)
#   3. weight pull throughput: a 512 MiB version flattened on the GPU, served by a RobustRL
#      weight server and pulled by a puller into GPU memory (GiB/s end to end)
#   4. a short job with model.device cuda and trainer.backend nccl (1 rank per GPU), a trainer
#      crash injected at step 3, recovered from its checkpoint, finished
#
# NOT RUN YET: no accelerator was lent to the session that wrote it, so every line below is
# untested on a GPU. Known limits, stated in the JSON too:
#   - the TCP / UCX transports move host bytes: step 3 stages the GPU buffer in host memory
#     (device -> host copy, then device <- host after the pull). UCX from device memory (cupy
#     views handed to ucxx) is not implemented; step 2 only shows the zero-copy view it would use.
#   - the machine must already have a Python with CUDA torch and RobustRL's dependencies
#     (the device machine reaches no package registry): PYTHON=... selects it; without one the
#     JSON says what is missing and the script exits 1.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
summary="$OUT/gpu-check.json"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/nvidia-smi.txt" 2>&1 || true

timeout 460 "$PY" - "$summary" <<'PYEOF'
import json, os, sys, time, traceback
summary_path = sys.argv[1]
res = {"ok": False, "steps": {}, "untested_before": "written without a GPU; first real run",
       "limits": ["pull path stages GPU bytes through host memory (TCP/UCX send host buffers)",
                  "UCX from device memory (cupy views to ucxx) not implemented"]}
t_start = time.monotonic()

def save():
    res["wall_s"] = round(time.monotonic() - t_start, 2)
    with open(summary_path, "w") as f:
        json.dump(res, f, indent=2)

def step(name, fn, budget_s):
    t = time.monotonic()
    if time.monotonic() - t_start > 440 - budget_s:
        res["steps"][name] = {"ok": False, "skipped": "no time left in the 8-minute budget"}
        save()
        return None
    try:
        out = fn()
        res["steps"][name] = {"ok": True, **(out or {}), "s": round(time.monotonic() - t, 2)}
    except Exception as exc:
        res["steps"][name] = {"ok": False, "error": repr(exc)[-800:], "trace": traceback.format_exc()[-2000:],
                              "s": round(time.monotonic() - t, 2)}
    save()
    return res["steps"][name]

def env():
    missing = []
    try:
        import torch
    except ImportError:
        raise RuntimeError("no torch in this Python: set PYTHON to one with CUDA torch")
    for mod in ("transformers", "nats", "redis", "minio", "fastapi", "xxhash", "robustrl"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    import torch.distributed as dist
    info = {"torch": torch.__version__, "cuda": torch.cuda.is_available(),
            "devices": torch.cuda.device_count(), "nccl": dist.is_nccl_available(), "missing": missing}
    if torch.cuda.is_available():
        info["device_name"] = torch.cuda.get_device_name(0)
    try:
        import cupy  # GPU path only
        info["cupy"] = cupy.__version__
    except ImportError:
        info["cupy"] = None
    if not info["cuda"] or missing:
        raise RuntimeError(f"GPU path cannot run here: {info}")
    return info

def dlpack():
    import torch
    import cupy
    buf = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    view = cupy.from_dlpack(buf)
    return {"zero_copy": int(view.data.ptr) == buf.data_ptr(), "bytes": buf.numel()}

def pull_throughput():
    import asyncio
    import torch
    from robustrl.model.policy import weights_checksum
    from robustrl.weights.flat import flatten_state_dict, unflatten
    from robustrl.weights.puller import pull
    from robustrl.weights.server import WeightServer
    n = 512 << 20
    state = {f"layer{i}.weight": torch.randn(n // 4 // 8, device="cuda") for i in range(8)}
    t = time.monotonic()
    flat, manifest = flatten_state_dict(state, 1, 8 << 20)  # device -> host staging (see limits)
    stage_s = time.monotonic() - t

    async def run():
        server = WeightServer("tcp", host="127.0.0.1")
        addr = await server.start()
        server.add_version(manifest, flat.numpy())
        t0 = time.monotonic()
        buffer, stats = await pull(manifest, [addr], transport="tcp", timeout_s=120)
        pulled = time.monotonic() - t0
        t1 = time.monotonic()
        on_gpu = {k: v.to("cuda", non_blocking=True) for k, v in unflatten(torch.from_numpy(buffer), manifest).items()}
        torch.cuda.synchronize()
        upload = time.monotonic() - t1
        await server.close()
        return pulled, upload, on_gpu

    pulled, upload, on_gpu = asyncio.run(run())
    same = weights_checksum(on_gpu) == weights_checksum(state)
    total = stage_s + pulled + upload
    return {"bytes": manifest.total_bytes, "verified": same, "stage_to_host_s": round(stage_s, 3),
            "pull_s": round(pulled, 3), "to_device_s": round(upload, 3),
            "gib_per_s_end_to_end": round(manifest.total_bytes / total / 2**30, 3),
            "gib_per_s_pull": round(manifest.total_bytes / pulled / 2**30, 3)}

def short_job():
    import torch
    sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
    from robustrl.client import ApiClient
    from robustrl.stack import Stack
    from jobs import kinds, small_job, wait_done, wait_step
    st = Stack(os.path.join(os.environ.get("OUT", "out/gpu-check"), "stack"))
    st.start()
    try:
        api = ApiClient(st.api_url, st.settings.api_token)
        workers = max(1, min(2, torch.cuda.device_count()))  # NCCL: one rank per GPU
        spec = small_job("gpu", steps=6, model={"device": "cuda", "hidden_size": 256, "num_layers": 4,
                                                "intermediate_size": 512},
                         trainer={"backend": "nccl", "workers": workers}, rollout={"replicas": 2})
        jid = api.submit(spec)["job_id"]
        wait_step(api, jid, 2, timeout=180)
        api.fault(jid, kind="crash", role="trainer", member=0)
        status = wait_done(api, jid, timeout=240)
        events = api.events(jid)
        recovered = [f for f in api.report(jid)["faults"] if f["role"] == "trainer"]
        return {"status": status["status"], "committed_step": status["committed_step"], "workers": workers,
                "trainer_faults": len(recovered),
                "recovery_s": [f.get("recovery_s") for f in recovered],
                "steps_committed": len(kinds(events, "step_committed"))}
    finally:
        st.stop()

ok = step("environment", env, 30)
if ok and ok["ok"]:
    if res["steps"]["environment"].get("cupy"):
        step("dlpack_view", dlpack, 20)
    step("gpu_weight_pull", pull_throughput, 90)
    step("short_job_with_trainer_crash", short_job, 300)
res["ok"] = all(s.get("ok") for s in res["steps"].values())
save()
print(json.dumps(res, indent=2))
sys.exit(0 if res["ok"] else 1)
PYEOF
rc=$?
echo "summary: $summary (exit $rc)"
exit $rc
