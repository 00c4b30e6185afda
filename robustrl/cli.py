"""The ``robustrl`` command: up, down, submit, status, demo, chaos run, testbed up/down/cut/partition/heal/list."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import typer
import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from robustrl.config import JobSpec, Settings
from robustrl.errors import ConfigError, RobustRLError

app = typer.Typer(add_completion=False, help="RobustRL: fault-tolerant RL post-training.")
chaos_app = typer.Typer(add_completion=False, help="Chaos harness: run a job through a fault scenario.")
app.add_typer(chaos_app, name="chaos")
testbed_app = typer.Typer(add_completion=False, help="Multi-host testbed: network namespaces with shaped links.")
app.add_typer(testbed_app, name="testbed")
k8s_app = typer.Typer(add_completion=False, help="Kubernetes manifests rendered from a job's member specs.")
app.add_typer(k8s_app, name="k8s")
console = Console(width=160)
DEFAULT_RUN_DIR = Path("runs/local")

# The demo's injected faults: a trainer machine loss, a rollout machine loss mid tool turn,
# and a tool outage; each recovered role-locally while the rest of the job keeps its state.
DEMO_SCENARIO = """
name: demo
seed: 1
faults:
  - {kind: crash, role: trainer, member: 1, at_step: 8, within_step: random}
  - {kind: crash, role: rollout, member: 0, at_step: 16, within_step: 3.3}
  - {kind: tool_outage, role: request_manager, at_step: 22, within_step: 0.1, duration_s: 13}
"""


def _fail(exc: Exception) -> None:
    console.print(f"[red]error:[/red] {exc}")
    raise typer.Exit(2)


def _external_settings(nats: str | None, redis: str | None, s3: str | None) -> Settings | None:
    if not (nats or redis or s3):
        return None
    if not (nats and redis and s3):
        _fail(ValueError("give all of --nats-url, --redis-url and --s3-endpoint, or none (embedded)"))
    env = {k: v for k, v in os.environ.items() if k.startswith("ROBUSTRL_")}
    env.update({"ROBUSTRL_NATS_URL": nats or "", "ROBUSTRL_REDIS_URL": redis or "",
                "ROBUSTRL_S3_ENDPOINT": s3 or ""})
    return Settings.from_env(env)


def _stack_client(run_dir: Path) -> Any:
    from robustrl.client import ApiClient

    path = run_dir / "stack.json"
    if not path.exists():
        _fail(FileNotFoundError(f"no running stack in {run_dir} (start one with: robustrl up --run-dir {run_dir})"))
    try:
        state = json.loads(path.read_text())
        return ApiClient(str(state["api_url"]), str(state["token"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        _fail(ConfigError(f"{path} is damaged ({type(exc).__name__}: {exc}); `robustrl down --run-dir "
                          f"{run_dir}` stops what it can still name", field="stack.json"))


@app.command()
def up(run_dir: Path = typer.Option(DEFAULT_RUN_DIR, help="Where logs, data and credentials go."),
       api_port: int = typer.Option(8321, help="REST API port (loopback)."),
       nats_url: str = typer.Option(None, help="External NATS instead of the embedded one."),
       redis_url: str = typer.Option(None, help="External Redis."),
       s3_endpoint: str = typer.Option(None, help="External S3/MinIO host:port (ROBUSTRL_S3_* for keys)."),
       launcher: str = typer.Option("local", help="How members start: local, docker or ray."),
       ray_address: str = typer.Option(None, help="GCS address (host:port) of the Ray cluster for --launcher ray.")) -> None:
    """Start the infrastructure (embedded unless URLs are given) and the control-plane services."""
    from robustrl.stack import Stack

    if launcher not in ("local", "docker", "ray"):
        _fail(ValueError(f"--launcher must be local, docker or ray, got {launcher!r}"))
    if (launcher == "ray") != bool(ray_address):
        _fail(ValueError("--launcher ray and --ray-address go together"))
    extra = {"ROBUSTRL_LAUNCHER": launcher} | ({"ROBUSTRL_RAY_ADDRESS": ray_address} if ray_address else {})
    try:
        stack = Stack(run_dir, external=_external_settings(nats_url, redis_url, s3_endpoint), api_port=api_port,
                      extra_env=extra)
        settings = stack.start()
        stack.detach()
    except RobustRLError as exc:
        _fail(exc)
    console.print(f"RobustRL is up: API {stack.api_url}  (token in {run_dir}/stack.json)")
    console.print(f"dashboard: {stack.api_url}/dashboard   stop with: robustrl down --run-dir {run_dir}")
    del settings


@app.command()
def down(run_dir: Path = typer.Option(DEFAULT_RUN_DIR)) -> None:
    """Stop what ``up`` started."""
    from robustrl.stack import stop_detached

    stopped = stop_detached(run_dir)
    console.print(f"stopped: {', '.join(stopped) or 'nothing was running'}")


@app.command()
def submit(spec_file: Path = typer.Argument(None, help="Job spec (YAML or JSON); default: the reference job."),
           run_dir: Path = typer.Option(DEFAULT_RUN_DIR), as_json: bool = typer.Option(False, "--json")) -> None:
    """Submit a job to the running stack."""
    raw: dict[str, Any] = {}
    if spec_file:
        try:
            raw = yaml.safe_load(spec_file.read_text()) or {}
            try:  # what the server will read: YAML has bytes, dates and sets that JSON has not
                raw = json.loads(json.dumps(raw))  # (NaN and infinities pass here: the parse names their field)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"{spec_file}: not a spec JSON can carry: {exc}") from exc
            JobSpec.parse(raw)
        except (OSError, yaml.YAMLError, RobustRLError) as exc:
            _fail(exc)
    try:
        job = _stack_client(run_dir).submit(raw)
    except RobustRLError as exc:
        _fail(exc)
    console.print_json(json.dumps(job)) if as_json else console.print(f"submitted {job['job_id']}")


@app.command()
def status(job_id: str = typer.Argument(None), run_dir: Path = typer.Option(DEFAULT_RUN_DIR),
           as_json: bool = typer.Option(False, "--json")) -> None:
    """Show jobs (or one job) of the running stack."""
    client = _stack_client(run_dir)
    try:
        jobs = [client.job(job_id)] if job_id else client.jobs()
    except RobustRLError as exc:
        _fail(exc)
    if as_json:
        console.print_json(json.dumps(jobs))
        return
    table = Table("job", "status", "policy", "step", "reward", "members", "faults")
    for j in jobs:
        reward = f"{j['reward_by_step'][-1]:.3f}" if j["reward_by_step"] else "-"
        live = sum(1 for m in j["members"] if m["state"] not in ("dead", "exited", "stopped"))
        table.add_row(j["job_id"], j["status"], j["policy"], f"{j['committed_step'] + 1}/{j['steps_total']}",
                      reward, str(live), str(len(j["faults"])))
    console.print(table)


@app.command()
def delete(job_id: str = typer.Argument(..., help="An ended job (finished, failed or stopped)."),
           checkpoints: bool = typer.Option(False, "--checkpoints", help="Also delete its checkpoints."),
           events: bool = typer.Option(False, "--events", help="Also delete its event log."),
           run_dir: Path = typer.Option(DEFAULT_RUN_DIR), as_json: bool = typer.Option(False, "--json")) -> None:
    """Delete an ended job: its state in Redis and its record; its checkpoints and event log on request."""
    try:
        out = _stack_client(run_dir).delete(job_id, checkpoints=checkpoints, events=events)
    except RobustRLError as exc:
        _fail(exc)
    if as_json:
        console.print_json(json.dumps(out))
        return
    console.print(f"deleted {job_id}: {out['redis_keys_deleted']} Redis keys, "
                  f"{out['checkpoint_objects_deleted']} checkpoint objects, {out['events_deleted']} events"
                  + ("" if not out["checkpoints_kept"] else "; checkpoints kept")
                  + ("" if not out["events_kept"] else "; event log kept"))


def _print_step_lines(printed: set[str], console: Console) -> Any:
    """One line per committed step (timings of the newest step), one per fault decision."""

    def on_status(status: dict[str, Any]) -> None:
        rewards = status["reward_by_step"]
        t = status.get("last_step_timings") or {}
        for k, reward in enumerate(rewards):
            if f"s{k}" in printed:
                continue
            printed.add(f"s{k}")
            line = f"step {k:3d}  reward {reward:.3f}"
            if k == len(rewards) - 1:
                line += (f"  gen {t.get('generation_s', 0):5.2f}s  tool {t.get('tool_wait_s', 0):5.2f}s  "
                         f"train {t.get('training_s', 0):5.2f}s  ckpt {t.get('checkpoint_blocking_s', 0) * 1e3:5.1f}ms"
                         f"  upload {t.get('upload_s', 0):5.2f}s  sync {t.get('weight_sync_s', 0):5.2f}s")
            console.print(line)
        for f in status["faults"]:
            if f["fault_id"] not in printed:
                printed.add(f["fault_id"])
                console.print(f"[yellow]fault[/yellow] {f['kind']} of {f['role']} {f['member_id']} at step "
                              f"{f['step']}: {(f.get('decision') or {}).get('reason', '')}")

    return on_status


def _write_report(out: Path, report: dict[str, Any], started: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    report["wall_s"] = time.time() - started
    (out / "report.json").write_text(json.dumps(report, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(report["reward_by_step"], marker="o", ms=3)
    for f in report.get("injected", []):
        ax.axvline(f["step"], color="red", alpha=0.3)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title(f"{report.get('policy')} — ETTR {report.get('ettr', 0):.2f}")
    fig.tight_layout()
    fig.savefig(out / "reward.png", dpi=100)
    plt.close(fig)


def _summary(report: dict[str, Any], console: Console) -> None:
    r = report["reward_by_step"]
    first, last = r[:5], r[-5:]
    console.print(f"\n[bold]report[/bold]: {report['status']}, {report['steps_completed']} steps in "
                  f"{report['wall_s']:.1f}s, ETTR {report['ettr']:.3f}")
    if first and last:
        console.print(f"mean reward first 5 steps {sum(first) / len(first):.3f} -> last 5 {sum(last) / len(last):.3f}")
    if report["faults"]:
        table = Table("fault", "role", "armed: struck after s", "detection s", "recovery s", "tokens regen",
                      "steps redone")
        for f in report["faults"]:
            fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
            armed = f.get("moment", "now") != "now"
            struck = (f"{f['moment']}: " + ("none logged" if f.get("struck_s") is None else f"{f['struck_s']:.2f}")
                      if armed else "-")
            table.add_row(f["kind"], f["role"], struck, fmt(f["detection_s"]), fmt(f["recovery_s"]),
                          str(f["tokens_regenerated"]), str(f["steps_redone"]))
        console.print(table)


def _run(out: Path, spec: dict[str, Any], scenario: Any, run_dir: Path | None,
         as_json: bool = False) -> dict[str, Any]:
    """Run one job on a fresh embedded stack with a progress bar; write and summarise its report.

    With ``as_json`` the progress, step lines and summary go to stderr and stdout gets only
    the report as JSON (for scripts).
    """
    from robustrl.chaos.runner import run_job
    from robustrl.client import ApiClient
    from robustrl.stack import Stack

    human = Console(stderr=True, width=160) if as_json else console
    started = time.time()
    run_dir = run_dir or out / "run"
    with Stack(run_dir) as stack:
        assert stack.settings
        human.print(f"stack up in {time.time() - started:.1f}s (run dir {run_dir}); API {stack.api_url}")
        api = ApiClient(stack.api_url, stack.settings.api_token)
        columns = (TextColumn("{task.description:<10}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("steps"), TimeElapsedColumn())
        with Progress(*columns, console=human, transient=True) as progress:
            bar = progress.add_task("starting", total=spec.get("steps"))
            print_lines = _print_step_lines(set(), human)

            def on_status(status: dict[str, Any]) -> None:
                print_lines(status)
                progress.update(bar, total=status["steps_total"], completed=status["committed_step"] + 1,
                                description=status["status"])

            report = asyncio.run(run_job(stack.settings, api, spec, scenario, on_status=on_status,
                                         local=stack))
    _write_report(out, report, started)
    _summary(report, human)
    human.print(f"wrote {out}/report.json and {out}/reward.png")
    if as_json:
        print(json.dumps(report))
    return report


@app.command()
def demo(out: Path = typer.Option(Path("out/demo"), help="Output directory."),
         steps: int = typer.Option(30, min=1), seed: int = typer.Option(0, min=0),
         faults: bool = typer.Option(True, help="Inject the demo faults."),
         policy: str = typer.Option("role_local", help="role_local or whole_job"),
         as_json: bool = typer.Option(False, "--json", help="Print only the report, as JSON, on stdout.")) -> None:
    """Run the reference job on embedded infrastructure with injected faults; print its report."""
    from robustrl.chaos.scenario import parse_scenario

    from robustrl.config import reference_job

    try:
        spec = reference_job(steps=steps, seed=seed, name="demo", recovery={"policy": policy}).model_dump(mode="json")
        scenario = parse_scenario(yaml.safe_load(DEMO_SCENARIO)) if faults else None
        report = _run(out, spec, scenario, None, as_json)
    except RobustRLError as exc:
        _fail(exc)
    if report["status"] != "finished":
        raise typer.Exit(1)


@chaos_app.command("run")
def chaos_run(scenario_file: Path = typer.Argument(..., help="Scenario YAML."),
              out: Path = typer.Option(Path("out/chaos")), steps: int = typer.Option(None),
              seed: int = typer.Option(None),
              as_json: bool = typer.Option(False, "--json", help="Print only the report, as JSON, on stdout.")) -> None:
    """Run a job through a fault scenario; write DIR/report.json."""
    from robustrl.chaos.runner import job_spec_for
    from robustrl.chaos.scenario import load_scenario

    try:
        scenario = load_scenario(scenario_file)
        spec = job_spec_for(scenario, {"name": scenario.name.replace(".", "-")[:60]})
        if steps:
            spec["steps"] = steps
        if seed is not None:
            spec["seed"] = seed
        JobSpec.parse(spec)
        _run(out, spec, scenario, None, as_json)
    except RobustRLError as exc:
        _fail(exc)


@chaos_app.command("campaign")
def chaos_campaign(out: Path = typer.Option(Path("out/campaign.json"), help="Where the JSON report goes."),
                   steps: int = typer.Option(100, min=3), faults: int = typer.Option(50, min=1),
                   seed: int = typer.Option(0, min=0), modes: str = typer.Option("sync,semi_sync,async"),
                   exclude: str = typer.Option("", help="Comma-separated kind or kind/role to leave out."),
                   run_dir: Path = typer.Option(None, help="Run directory (default: next to --out).")) -> None:
    """Randomized fault campaign: a seeded long job per mode, faults at random moments, phases and
    during recovery, then the independent auditor. Exit 1 unless every job completed soundly."""
    from robustrl.chaos.campaign import MODES, run_on_fresh_stack

    chosen = tuple(m for m in modes.split(",") if m)
    if any(m not in MODES for m in chosen):
        _fail(ValueError(f"modes must be among {MODES}, got {modes!r}"))
    try:
        report = run_on_fresh_stack(run_dir or out.parent / "campaign-run", modes=chosen, steps=steps,
                                    faults=faults, seed=seed, exclude=tuple(x for x in exclude.split(",") if x))
    except RobustRLError as exc:
        _fail(exc)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    table = Table("mode", "done", "faults", "twice", "lost steps", "lost eps", "bad ckpts", "bad weights",
                  "stuck s", "redis start/end", "ETTR")
    for mode, r in report["modes"].items():
        table.add_row(mode, str(r["job_completed"]), str(r["faults_injected"]), str(r["steps_trained_twice"]),
                      str(r["steps_lost"]), str(r["episodes_lost"]), str(r["checkpoints_unloadable"]),
                      str(r["replicas_served_bad_weights"]), str(r["max_stuck_s"]),
                      f"{r['redis_bytes_start']}/{r['redis_bytes_end']}", str(r["ettr"]))
    console.print(table)
    console.print(f"wrote {out}")
    if not all(r["job_completed"] and r["audit_ok"] for r in report["modes"].values()):
        raise typer.Exit(1)


def _infra_settings(run_dir: Path, nats: str | None, redis: str | None, s3: str | None) -> Settings:
    """Where the stores are: explicit URLs, else ROBUSTRL_* in the environment, else ``up``'s infra."""
    from robustrl.infra.embedded import EmbeddedInfra

    external = _external_settings(nats, redis, s3)
    if external is not None:
        return external
    if os.environ.get("ROBUSTRL_NATS_URL"):
        return Settings.from_env(os.environ)
    infra = EmbeddedInfra.load(run_dir / "infra")
    assert infra.settings is not None
    return infra.settings


@app.command()
def export(job_id: str = typer.Argument(..., help="The job whose trained policy to write."),
           out: Path = typer.Argument(..., help="A new (or empty) directory."),
           step: int = typer.Option(None, min=0, help="The checkpoint's step (default: the newest complete one)."),
           run_dir: Path = typer.Option(DEFAULT_RUN_DIR, help="Stack started by `robustrl up` (its infra)."),
           nats_url: str = typer.Option(None), redis_url: str = typer.Option(None),
           s3_endpoint: str = typer.Option(None, help="S3 host:port (ROBUSTRL_S3_* for keys).")) -> None:
    """Write a job's trained policy from its checkpoint as a model directory (Hugging Face format
    with the job's tokenizer and chat template; loadable as a later job's model.path)."""
    from robustrl.export import export_model

    try:
        settings = _infra_settings(run_dir, nats_url, redis_url, s3_endpoint)
        record = export_model(settings, job_id, out, step)
    except RobustRLError as exc:
        _fail(exc)
    console.print(f"wrote {out}: step {record['step']} (weights version {record['weights_version']}, "
                  f"checksum {record['weights_checksum'][:16]})")


@app.command()
def audit(job_id: str = typer.Argument(..., help="The job to audit."),
          run_dir: Path = typer.Option(DEFAULT_RUN_DIR, help="Stack started by `robustrl up` (its infra)."),
          nats_url: str = typer.Option(None), redis_url: str = typer.Option(None),
          s3_endpoint: str = typer.Option(None, help="S3 host:port (ROBUSTRL_S3_* for keys)."),
          max_stuck_s: float = typer.Option(None, help="Fail if progress stopped longer than this (default: "
                                                     "the job's step_deadline_s or commit_deadline_s, the longer, "
                                                     "+ 2 x recovery.deadline_s)."),
          running: bool = typer.Option(False, "--running", help="The job still runs: its log need not end."),
          redis_bound: bool = typer.Option(True, help="Judge Redis growth."),
          as_json: bool = typer.Option(False, "--json", help="Print only the report, as JSON.")) -> None:
    """Check a job's invariants from the raw stores (S3, Redis, event log); exit 1 on a violation."""
    from robustrl.audit import AuditOptions
    from robustrl.audit import audit as run_audit

    try:
        settings = _infra_settings(run_dir, nats_url, redis_url, s3_endpoint)
        report = asyncio.run(run_audit(settings, job_id, AuditOptions(redis_bound=redis_bound,
                                                                      max_stuck_s=max_stuck_s,
                                                                      require_ended=not running)))
    except RobustRLError as exc:
        _fail(exc)
    if as_json:
        print(report.model_dump_json(indent=1))
    else:
        table = Table("check", "result", "violations")
        for name, check in report.checks.items():
            table.add_row(name, "[green]pass[/green]" if check.passed else "[red]FAIL[/red]",
                          "\n".join(check.violations[:5]) + (" ..." if len(check.violations) > 5 else ""))
        console.print(table)
        console.print(" ".join(f"{k}={v}" for k, v in {**report.counters(), **report.facts}.items()))
    if not report.ok:
        raise typer.Exit(1)


@testbed_app.command("up")
def testbed_up(hosts: int = typer.Option(3, min=1, help="Number of hosts (namespaces h0..hN-1)."),
               link: str = typer.Option(None, help="Each host's link rate, tc units (2gbit, 200mbit); default unshaped."),
               delay: str = typer.Option(None, help="Added per link crossing (0.2ms); needs the kernel's netem."),
               subnet: str = typer.Option(None, help="The hosts' /24; default: a free one in 10.213.0.0/16.")) -> None:
    """Build a testbed that stays up after this command (until `robustrl testbed down`); print its
    state as JSON."""
    from robustrl.testbed import Testbed

    try:
        tb = Testbed(hosts=hosts, link=link, delay=delay, subnet=subnet, detached=True)
        tb.up()
    except RobustRLError as exc:
        _fail(exc)
    print(json.dumps(tb.describe(), indent=1))


@testbed_app.command("down")
def testbed_down(tags: list[str] = typer.Argument(None, help="Testbeds to remove (default: every detached one "
                                                            "and every one whose owner died)."),
                 everything: bool = typer.Option(False, "--all", help="Remove every testbed, even those whose "
                                                                      "owner process still runs.")) -> None:
    """Remove testbeds: their processes, links, qdiscs, namespaces and state files."""
    from robustrl.testbed import sweep
    from robustrl.testbed.state import read_states
    from robustrl.testbed.teardown import teardown

    removed: list[str] = []
    try:
        if tags:
            known = {s.tag: s for s in read_states()}
            for tag in tags:
                if tag not in known:
                    _fail(ValueError(f"no testbed {tag!r} (known: {', '.join(sorted(known)) or 'none'})"))
                teardown(known[tag])
                removed.append(tag)
        else:
            report = sweep(detached=True, everything=everything)
            removed = report.testbeds + report.orphans
    except RobustRLError as exc:
        _fail(exc)
    console.print(f"removed: {', '.join(removed) or 'nothing'}")


def _attached(tag: str) -> Any:
    from robustrl.testbed import Testbed

    try:
        return Testbed.attach(tag)
    except RobustRLError as exc:
        _fail(exc)


@testbed_app.command("cut")
def testbed_cut(tag: str = typer.Argument(..., help="The testbed."),
                host: str = typer.Argument(..., help="The host to take off the network (h0, h1, ...)."),
                mode: str = typer.Option("drop", help="drop: packets vanish silently; down: the link goes down.")) -> None:
    """Cut a host's link until `robustrl testbed heal`."""
    from robustrl.testbed import CutMode

    try:
        _attached(tag).cut(host, CutMode(mode))
    except (RobustRLError, ValueError) as exc:
        _fail(exc)
    console.print(f"cut {host} ({mode}) on {tag}")


@testbed_app.command("partition")
def testbed_partition(tag: str = typer.Argument(..., help="The testbed."),
                      group_a: str = typer.Argument(..., help="Hosts on one side, comma-separated (h0,h1)."),
                      group_b: str = typer.Argument(..., help="Hosts on the other side.")) -> None:
    """Drop all traffic between two groups of hosts until `robustrl testbed heal`."""
    try:
        _attached(tag).partition(group_a.split(","), group_b.split(","))
    except RobustRLError as exc:
        _fail(exc)
    console.print(f"partitioned {group_a} | {group_b} on {tag}")


@testbed_app.command("heal")
def testbed_heal(tag: str = typer.Argument(..., help="The testbed.")) -> None:
    """Undo every cut and partition of a testbed (the link shaping stays)."""
    try:
        _attached(tag).heal()
    except RobustRLError as exc:
        _fail(exc)
    console.print(f"healed {tag}")


@testbed_app.command("list")
def testbed_list() -> None:
    """Print every testbed's state as JSON, each with whether its owner is alive."""
    from robustrl.testbed.state import read_states

    print(json.dumps([{**s.to_json(), "owner_alive": s.owner_alive()} for s in read_states()], indent=1))


if __name__ == "__main__":
    app()


@k8s_app.command("render")
def k8s_render(job: Path = typer.Argument(..., help="Job spec (YAML or JSON), as for submit."),
               image: str = typer.Option("robustrl:latest", help="The RobustRL image the pods run."),
               namespace: str = typer.Option("default", help="Namespace of every manifest."),
               out: Path = typer.Option(None, help="Write the manifests here instead of stdout."),
               network_policy: bool = typer.Option(
                   True, help="Render the job's NetworkPolicies (turn off where the network plugin does not "
                   "enforce them).")) -> None:
    """Render the job's trainer gang (pods + rendezvous Service), rollout pool (Deployment +
    Service) and NetworkPolicies as Kubernetes manifests (multi-document YAML). Nothing is applied
    to a cluster."""
    from robustrl.k8s import render_job

    try:
        spec = JobSpec.parse(yaml.safe_load(job.read_text()) or {})
        docs = render_job(spec, image=image, namespace=namespace, network_policy=network_policy)
    except (OSError, yaml.YAMLError, RobustRLError) as exc:
        _fail(exc)
    text = yaml.safe_dump_all(docs, sort_keys=False)
    if out is None:
        typer.echo(text, nl=False)
    else:
        out.write_text(text)
        console.print(f"wrote {len(docs)} manifests to {out}")
