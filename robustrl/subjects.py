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
    if not _TOKEN.fullmatch(text):  # (match would let a trailing newline through $)
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


class Principal(str, Enum):
    """Who holds bus credentials: the roles of a job plus the chaos harness (and CLI)."""

    CONTROLLER = "controller"
    DETECTOR = "detector"
    REQUEST_MANAGER = "request_manager"
    TRAINER = "trainer"
    ROLLOUT = "rollout"
    HARNESS = "harness"


_C, _D, _RM, _T, _R, _H = (Principal.CONTROLLER, Principal.DETECTOR, Principal.REQUEST_MANAGER,
                          Principal.TRAINER, Principal.ROLLOUT, Principal.HARNESS)

EVENT_OWNERS: dict[str, frozenset[Principal]] = {
    kind: frozenset(owners) for kind, owners in {
        "job_submitted": (_C,), "job_started": (_C,), "job_finished": (_C,), "job_failed": (_C,),
        "job_stopped": (_C,), "job_deleted": (_C,), "member_started": (_C,), "member_exited": (_C,), "member_stopped": (_C,),
        "fault_injected": (_C, _H), "decision": (_C,), "action": (_C,), "recovered": (_C,), "note": (_C,),
        "fault_detected": (_D, _C, _RM), "phase": (_D,),
        "job_ready": (_RM,), "step_started": (_RM,), "batch_ready": (_RM,), "episode_redispatched": (_RM,),
        "tool_fault": (_RM,), "turn_regenerated": (_RM,), "turn_dropped": (_RM,), "turn_rejected": (_RM,),
        "turn_refused": (_RM,),
        "deadline_passed": (_RM,), "rm_resumed": (_RM,),
        "work_lost": (_RM, _C),
        "member_ready": (_T,), "step_committed": (_T,), "weights_published": (_T,),
        "weights_loaded": (_R,), "weights_rejected": (_R,), "fault_struck": (_R,),
        # warm standby from the rollout pool (issue 13)
        "replica_borrowed": (_C,), "replica_restocked": (_C,), "restock_failed": (_C,),
        "role_switched": (_T,), "stale_turns_dropped": (_T,),
    }.items()
}
"""Which principals may write each event kind. The writer (``Bus.emit_event``) refuses a kind its
role does not own, the NATS permissions (``robustrl.infra.credentials``) let a role publish only on
its own kinds' subjects, and readers refuse an envelope whose subject names a non-owner."""


def event_owner(kind: str, role: str | None = None) -> Principal:
    """The principal that writes ``kind``: ``role`` if it owns the kind, the sole owner if ``role``
    is None and there is only one. Raises SubjectError otherwise."""
    owners = EVENT_OWNERS.get(kind)
    if owners is None:
        raise SubjectError(f"unknown event kind {kind!r}", field="kind")
    if role is None:
        if len(owners) == 1:
            return next(iter(owners))
        raise SubjectError(f"event kind {kind!r} has several owners; the writer must say which",
                           field="role")
    try:
        principal = Principal(role)
    except ValueError as exc:
        raise SubjectError(f"unknown role {role!r}", field="role") from exc
    if principal not in owners:
        raise SubjectError(f"{principal.value} may not write {kind!r} events "
                           f"(owners: {sorted(o.value for o in owners)})", field="kind")
    return principal


def events(job_id: str, kind: str, role: str | None = None) -> str:
    """Event-log subject ``rrl.events.<job>.<role>.<kind>``, captured by the stream ``EVENTS_STREAM``.

    The writer's role is a subject level so that NATS permissions can say who may write what.
    """
    owner = event_owner(kind, role)
    return ".".join([ROOT, "events", token(job_id, "job_id"), owner.value, token(kind, "event kind")])


def events_kind(job_id: str, kind: str) -> str:
    """Subscription subject for one event kind of a job, whoever wrote it."""
    return ".".join([ROOT, "events", token(job_id, "job_id"), "*", token(kind, "event kind")])


def events_of(job_id: str) -> str:
    return ".".join([ROOT, "events", token(job_id, "job_id"), ">"])


def events_of_kind(kind: str) -> str:
    """Event-log subject of one event kind across every job (a JetStream consumer's filter)."""
    return ".".join([ROOT, "events", "*", "*", token(kind, "event kind")])


def parse_event_subject(subject_text: str) -> tuple[str, str, str]:
    """Split ``rrl.events.<job>.<role>.<kind>`` into (job_id, role, kind); SubjectError if it is
    not one, or if ``role`` does not own ``kind``."""
    parts = subject_text.split(".")
    if len(parts) != 5 or parts[:2] != [ROOT, "events"]:
        raise SubjectError(f"not an event subject: {subject_text[:200]!r}", field="subject")
    job_id, role, kind = parts[2:]
    event_owner(kind, role)
    return token(job_id, "job_id"), role, kind


EVENTS_ALL = f"{ROOT}.events.>"

# --- who may publish and subscribe what (rendered into NATS permissions) ---------------------

EXACT, MEMBER = "exact", "member"
"""Subject shapes of a verb: ``rrl.<job>.<verb>`` (EXACT) and ``rrl.<job>.<verb>.<token>`` (MEMBER)."""
_BOTH = (EXACT, MEMBER)

# verb -> (publishers, subscribers), each principal with the shapes it may use. A requester needs
# only to publish (replies come to its _INBOX); a responder only to subscribe (its reply is allowed
# by ``allow_responses``).
VERB_ACCESS: dict[Verb, tuple[dict[Principal, tuple[str, ...]], dict[Principal, tuple[str, ...]]]] = {
    Verb.HELLO: ({_T: (MEMBER,), _R: (MEMBER,)}, {_C: (MEMBER,), _D: (MEMBER,), _RM: (MEMBER,)}),
    Verb.SPEC: ({_T: (EXACT,), _R: (EXACT,), _D: (EXACT,), _RM: (EXACT,)}, {_C: (EXACT,)}),
    # The harness reads phases and metrics (read-only telemetry) to time a fault to a replica's
    # decoding (chaos scenario ``within_step: decoding``).
    Verb.PHASE: ({_T: (MEMBER,), _R: (MEMBER,)}, {_C: (MEMBER,), _D: (MEMBER,), _H: (MEMBER,)}),
    Verb.METRICS: ({_T: (MEMBER,), _R: (MEMBER,), _RM: (MEMBER,)},
                   {_D: (MEMBER,), _RM: (MEMBER,), _C: (MEMBER,), _H: (MEMBER,)}),
    # The controller probes the replicas it could borrow for a trainer gang (a frozen one is not).
    Verb.PROBE: ({_D: (MEMBER,), _C: (MEMBER,)}, {_T: (MEMBER,), _R: (MEMBER,), _RM: (MEMBER,)}),
    Verb.EXIT: ({_C: (MEMBER,)}, {_D: (MEMBER,)}),
    Verb.FAULT: ({_D: (EXACT,), _RM: (EXACT,)}, {_C: (EXACT,)}),  # RM: a deadline passed (stuck step)
    Verb.GENERATE: ({_RM: (MEMBER,)}, {_R: (MEMBER,)}),
    Verb.TURN: ({_R: (EXACT,)}, {_RM: (EXACT,)}),
    Verb.BATCH: ({_RM: (EXACT,)}, {_T: (EXACT,)}),
    Verb.BATCH_GET: ({_T: (EXACT,)}, {_RM: (EXACT,)}),
    Verb.COMMIT: ({_T: (EXACT,)}, {_C: (EXACT,), _RM: (EXACT,), _H: (EXACT,)}),
    Verb.WEIGHTS: ({_T: (EXACT,)}, {_R: (EXACT,)}),
    Verb.HAVE: ({_R: (MEMBER,)}, {_R: (MEMBER,), _C: (MEMBER,), _RM: (MEMBER,)}),
    Verb.CONTROL: ({_C: _BOTH}, {_T: _BOTH, _R: _BOTH, _RM: _BOTH, _D: _BOTH}),
    # The harness asks the controller (EXACT); only the controller reaches a member (MEMBER).
    Verb.CHAOS: ({_H: (EXACT,), _C: (MEMBER,)}, {_C: (EXACT,), _T: (MEMBER,), _R: (MEMBER,),
                                                  _RM: (MEMBER,)}),
    Verb.STATE: ({_RM: (EXACT,), _C: (EXACT,)}, {_RM: (EXACT,), _C: (EXACT,)}),
}

INBOX = "_INBOX.>"
JS_API = "$JS.API.>"
JS_ACK = f"$JS.ACK.{EVENTS_STREAM}.>"
_EVENT_READERS = (_D, _H)  # core subscriptions on the log; the controller reads it through JetStream
_JETSTREAM_USERS = (_C,)  # creates the stream, reads the log with pull consumers (fault inbox)
# Whoever starts first creates the event stream (ensure_event_stream): that much JetStream API only.
_STREAM_CREATORS = (_RM,)
JS_STREAM_ENSURE = (f"$JS.API.STREAM.INFO.{EVENTS_STREAM}", f"$JS.API.STREAM.CREATE.{EVENTS_STREAM}")
JS_DIRECT_GET = f"$JS.API.DIRECT.GET.{EVENTS_STREAM}"
"""Reading one stored event at a time (``Bus.stored_msg_ids``): read-only, no consumer made or
changed. Every role that appends another life's outbox entries (the trainer's next gang, the
request manager, the detector, a replica) drops those the log already holds."""
_DIRECT_READERS = (_T, _RM, _D, _R)
JS_EVENTS_PURGE = f"$JS.API.STREAM.PURGE.{EVENTS_STREAM}"
"""Purging a job's events (a deleted job's log): the controller's, under its JS_API."""


def _shape_subject(verb: Verb, shape: str) -> str:
    return ".".join([ROOT, "*", verb.value] + ([">"] if shape == MEMBER else []))


def permissions(principal: Principal | str) -> tuple[list[str], list[str]]:
    """(publish, subscribe) subject patterns ``principal`` may use, least privilege.

    Every principal may publish its own event kinds (through JetStream, whose acks come to its
    inbox) and subscribe to its inbox for replies.
    """
    who = Principal(principal)
    publish: list[str] = []
    subscribe: list[str] = [INBOX]
    for verb, (pubs, subs) in VERB_ACCESS.items():
        publish += [_shape_subject(verb, shape) for shape in pubs.get(who, ())]
        subscribe += [_shape_subject(verb, shape) for shape in subs.get(who, ())]
    publish += [f"{ROOT}.events.*.{who.value}.{kind}"
                for kind, owners in EVENT_OWNERS.items() if who in owners]
    if who in _EVENT_READERS:
        subscribe.append(EVENTS_ALL)
    if who in _JETSTREAM_USERS:
        publish += [JS_API, JS_ACK]
    elif who in _STREAM_CREATORS:
        publish += list(JS_STREAM_ENSURE)
    if who in _DIRECT_READERS:
        publish.append(JS_DIRECT_GET)
    return sorted(set(publish)), sorted(set(subscribe))


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
