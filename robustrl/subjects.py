"""Every NATS subject RobustRL uses, built in one place.

Subjects have the shape ``rrl.<job>.<verb>[.<token>...]``. Tokens are validated so that a
job or member id can never inject wildcards or extra levels. No service writes a subject
as an f-string; they call the builders here.
"""

from __future__ import annotations

import re
from enum import Enum

from robustrl.errors import SubjectError

ROOT = "rrl"
EVENTS_STREAM = "RRL_EVENTS"
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class Verb(str, Enum):
    """The verbs of the RobustRL protocol (second level after the job id)."""

    HELLO = "hello"  # member -> all: I am up (MemberHello)
    SPEC = "spec"  # member -> controller request: give me the job spec (SpecRequest/SpecReply)
    PHASE = "phase"  # member -> detector/controller: phase change (PhaseChange)
    METRICS = "metrics"  # member -> detector: periodic sample (MetricsSample)
    PROBE = "probe"  # detector -> member request: heartbeat probe (ProbeRequest/ProbeReply)
    EXIT = "exit"  # launcher -> detector: a member's process ended (MemberExited)
    FAULT = "fault"  # detector -> controller: fault report (FaultReport)
    GENERATE = "gen"  # request manager -> replica: generate one turn (GenerateTurn)
    TURN = "turn"  # replica -> request manager: the generated turn (TurnResult)
    BATCH = "batch"  # request manager -> trainer: step's batch is ready (BatchReady)
    BATCH_GET = "batchget"  # trainer -> request manager request: re-fetch a step's batch
    COMMIT = "commit"  # trainer -> all: step committed (StepCommitted)
    WEIGHTS = "weights"  # trainer -> replicas: new version announced (WeightsAnnounce)
    HAVE = "have"  # replica -> all: I hold a version completely (WeightsHave)
    CONTROL = "control"  # controller -> member/role: command (ControlCommand)
    CHAOS = "chaos"  # harness -> member: in-process fault (ChaosCommand)
    STATE = "state"  # request manager <-> controller request: step state query


def token(value: str | int, what: str = "token") -> str:
    """Validate one subject token (job id, member id, role)."""
    text = str(value)
    if not _TOKEN.match(text):
        raise SubjectError(f"invalid {what} for a subject: {text!r}", field=what)
    return text


def subject(job_id: str, verb: Verb, *tokens: str | int) -> str:
    """Build ``rrl.<job>.<verb>[.<tokens>]`` with every token validated."""
    parts = [ROOT, token(job_id, "job_id"), Verb(verb).value]
    parts.extend(token(t) for t in tokens)
    return ".".join(parts)


def wildcard(job_id: str, verb: Verb) -> str:
    """Subscription subject for every message of ``verb`` in a job, any member."""
    return ".".join([ROOT, token(job_id, "job_id"), Verb(verb).value, ">"])


def all_jobs(verb: Verb) -> str:
    """Subscription subject for ``verb`` across every job (control plane services)."""
    return ".".join([ROOT, "*", Verb(verb).value, ">"])


def all_jobs_exact(verb: Verb, *tokens: str) -> str:
    """Subscription subject for ``verb`` (plus fixed tokens) across every job."""
    return ".".join([ROOT, "*", Verb(verb).value, *(token(t) for t in tokens)])


def events(job_id: str, kind: str) -> str:
    """Event-log subject, captured by the JetStream stream ``EVENTS_STREAM``."""
    return ".".join([ROOT, "events", token(job_id, "job_id"), token(kind, "event kind")])


def events_of(job_id: str) -> str:
    return ".".join([ROOT, "events", token(job_id, "job_id"), ">"])


def events_of_kind(kind: str) -> str:
    """Event-log subject of one event kind across every job (a JetStream consumer's filter)."""
    return ".".join([ROOT, "events", "*", token(kind, "event kind")])


EVENTS_ALL = f"{ROOT}.events.>"


def parse(subject_text: str) -> tuple[str, Verb, list[str]]:
    """Split a RobustRL subject into (job_id, verb, tokens); raise SubjectError if foreign."""
    parts = subject_text.split(".")
    if len(parts) < 3 or parts[0] != ROOT:
        raise SubjectError(f"not a RobustRL subject: {subject_text!r}", field="subject")
    try:
        verb = Verb(parts[2])
    except ValueError as exc:
        raise SubjectError(f"unknown verb {parts[2]!r} in {subject_text!r}", field="verb") from exc
    return token(parts[1], "job_id"), verb, [token(t) for t in parts[3:]]
