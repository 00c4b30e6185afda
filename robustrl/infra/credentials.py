"""Least privilege on the bus, in Redis and in the object store: one set of credentials per role.

Every principal (``robustrl.subjects.Principal``: controller, detector, request_manager, trainer,
rollout, harness) gets

* a NATS user whose publish/subscribe permissions are ``robustrl.subjects.permissions(role)``:
  the subjects of the verbs it owns, its own event kinds, its inbox, and JetStream's API only for
  the controller (``render_nats_users``);
* a Redis ACL user limited to the key patterns and command categories it needs, or none at all
  (``REDIS_ACCESS``, ``render_redis_acl``);
* the S3 key pair only if it reads or writes checkpoints (``S3_ROLES``). ``rclone serve s3`` (the
  embedded S3 server) accepts several key pairs but every pair has full access to every bucket: it
  has no per-key policies, so the only S3 restriction here is who holds a key at all.

The embedded stack generates these per start (``generate``) and writes them 0600 under its run
directory; compose reads the passwords from ``compose/.env``. The controller hands each member the
credentials of its role through the member's environment (``credentials_for``); a service gets
only its own. On one host, processes of one user can read each other's environment: this confines
bugs and misbehaving members, it is not isolation from a local attacker.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict

from robustrl.config import Settings
from robustrl.errors import ConfigError
from robustrl.storage.redis_stores import Keys
from robustrl.subjects import Principal, permissions

S3_ROLES = frozenset({Principal.CONTROLLER, Principal.TRAINER})
"""Who holds an S3 key: the trainer writes checkpoints, the controller (and its auditor) reads them."""

_ANY = "*"


def _patterns(prefix: str, *keys: str) -> str:
    return " ".join(f"{prefix}{k}" for k in keys)


# What the request manager makes and collects: episodes, prefixes, step lists, batches, its
# dispatch records, its own keys (outbox, restart count, GC marker). The trainer's keys of a step
# (its batch fence, its trained-log entries) are the trainer's to collect (GangFence.collect):
# with write access here the request manager could delete a claim or forge a trained step.
_RM_KEYS_RW = _patterns("~", Keys.episode(_ANY, _ANY), Keys.prefix(_ANY, _ANY),
                        Keys.step_episodes(_ANY, _ANY), Keys.batch(_ANY, _ANY),  # type: ignore[arg-type]
                        Keys.dispatches(_ANY), Keys.rm_outbox(_ANY), Keys.step_restarts(_ANY),
                        Keys.rollout_gc(_ANY))
# What it only reads: the job registry (its specs), the gang record, the weights pointer, the
# trained log (a commit message lost on the bus is recovered from it: ``_wait_committed``) and the
# controller's fencing counter (a controller command's token is checked against the newest term's).
_RM_KEYS_R = _patterns("%R~", Keys.jobs(), Keys.gang(_ANY), Keys.weights_latest(_ANY), Keys.trained_log(_ANY),
                       Keys.controller_fence())
# The trainer writes its gang record, the batch fences, the trained log (and its GC marker for
# both), the weights pointer and its event outbox; it reads the episodes, their prefixes, the step lists and the batches.
_TRAINER_KEYS_RW = _patterns("~", Keys.fence(_ANY, _ANY), Keys.trained_log(_ANY),  # type: ignore[arg-type]
                             Keys.fence_gc(_ANY), Keys.weights_latest(_ANY), Keys.gang(_ANY), Keys.trainer_outbox(_ANY))
_TRAINER_KEYS_R = _patterns("%R~", Keys.episode(_ANY, _ANY), Keys.prefix(_ANY, _ANY),
                            Keys.step_episodes(_ANY, _ANY), Keys.batch(_ANY, _ANY))  # type: ignore[arg-type]
_SAFE_COMMANDS = "+@read +@write +@scripting +@transaction +@connection +select -@dangerous -@admin"

REDIS_ACCESS: dict[Principal, str | None] = {
    # The control plane keeps its state in Redis under rrl:* (job registry, lease, per-job state).
    Principal.CONTROLLER: f"~rrl:* {_SAFE_COMMANDS}",
    # The request manager: its own keys only, the rest read-only. With ``~rrl:*`` it could mark a
    # fault handled (the controller then never acted on it), move the controller fencing counter
    # or rewrite job records and the gang record (an outside review).
    Principal.REQUEST_MANAGER: f"{_RM_KEYS_RW} {_RM_KEYS_R} {_SAFE_COMMANDS}",
    # The trainer: its keys written, the request manager's read only (it could delete the
    # prefixes rollout recovery resumes from). A new key the trainer writes goes in _TRAINER_KEYS_RW.
    Principal.TRAINER: f"{_TRAINER_KEYS_RW} {_TRAINER_KEYS_R} {_SAFE_COMMANDS}",
    # A replica reads the weights pointer, and writes, reads and empties its job's rollout outbox
    # (its events until JetStream stored them: RPUSH, LRANGE, LREM), nothing else.
    Principal.ROLLOUT: (f"%R~{Keys.weights_latest(_ANY)} ~{Keys.rollout_outbox(_ANY)} +@read +rpush +lrem "
                        "+@connection +select -@dangerous -@admin"),
    # The detector: its event outbox of each job (written, read, emptied; SCANned at its start)
    # and its marks of each job's members, nothing else: neither the job registry nor any rollout
    # state. It reads the controller's fencing counter (a controller command's token is checked
    # against the newest lease term's).
    Principal.DETECTOR: (f"~{Keys.detector_outbox(_ANY)} ~{Keys.detector_marks(_ANY)} %R~{Keys.controller_fence()} "
                         "+@read +@write +@connection +select -@dangerous -@admin"),
    Principal.HARNESS: None,
}
"""Redis ACL rules per role (after ``on >password``); None: the role gets no Redis user."""

# Environment variables through which the controller receives the members' credentials.
MEMBER_ROLES = (Principal.TRAINER, Principal.ROLLOUT)
_FIELDS = {"nats_url": "NATS_URL", "redis_url": "REDIS_URL", "s3_access_key": "S3_ACCESS_KEY",
           "s3_secret_key": "S3_SECRET_KEY"}


class RoleCredentials(BaseModel):
    """One role's secrets. ``redis_password``/``s3`` None: the role gets no access there."""

    model_config = ConfigDict(frozen=True)
    nats_user: str
    nats_password: str
    redis_user: str | None = None
    redis_password: str | None = None
    s3_access_key: str | None = None
    s3_secret_key: str | None = None


class Credentials(BaseModel):
    """Every role's credentials, as written 0600 to ``credentials.json`` by the embedded stack."""

    model_config = ConfigDict(frozen=True)
    roles: dict[Principal, RoleCredentials]

    def of(self, role: Principal | str) -> RoleCredentials:
        return self.roles[Principal(role)]

    def save(self, path: Path) -> None:
        from robustrl.infra.binaries import write_private

        write_private(path, self.model_dump_json(indent=2))

    @classmethod
    def load(cls, path: Path | str) -> Credentials:
        try:
            return cls.model_validate_json(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read role credentials from {path}: {exc}",
                              field="credentials_file") from exc


def generate() -> Credentials:
    """Fresh random credentials for every role (hex secrets: safe in URLs and config files)."""
    roles = {}
    for role in Principal:
        redis = REDIS_ACCESS[role] is not None
        s3 = role in S3_ROLES
        roles[role] = RoleCredentials(
            nats_user=role.value, nats_password=secrets.token_hex(16),
            redis_user=role.value if redis else None, redis_password=secrets.token_hex(16) if redis else None,
            s3_access_key=f"rr{role.value.replace('_', '')[:10]}{secrets.token_hex(4)}" if s3 else None,
            s3_secret_key=secrets.token_hex(20) if s3 else None)
    return Credentials(roles=roles)


# --- server configuration ---------------------------------------------------------------------


def nats_user_entry(role: Principal, user: str, password: str) -> str:
    """One entry of ``authorization { users = [...] }``; ``password`` may be a ``$VARIABLE``."""
    publish, subscribe = permissions(role)
    pw = password if password.startswith("$") else json.dumps(password)
    return (f"    {{user: {json.dumps(user)}, password: {pw}, permissions: {{\n"
            f"      publish: {{allow: {json.dumps(publish)}}},\n"
            f"      subscribe: {{allow: {json.dumps(subscribe)}}},\n"
            # A responder may answer the requests it received, and nothing else on _INBOX.
            f"      allow_responses: true}}}}")


def render_nats_users(creds: Credentials, admin_user: str, admin_password: str) -> str:
    """The ``authorization`` block: an unrestricted operator user plus one user per role."""
    entries = [f"    {{user: {json.dumps(admin_user)}, password: {json.dumps(admin_password)}}}"]
    entries += [nats_user_entry(role, c.nats_user, c.nats_password) for role, c in creds.roles.items()]
    return "authorization {\n  users = [\n" + "\n".join(entries) + "\n  ]\n}\n"


def redis_acl_rule(role: Principal) -> str | None:
    return REDIS_ACCESS[role]


def render_redis_acl(creds: Credentials) -> list[str]:
    """``user`` lines for redis.conf (the default user keeps ``requirepass``: the operator's)."""
    lines = []
    for role, c in creds.roles.items():
        rule = REDIS_ACCESS[role]
        if rule is not None and c.redis_user and c.redis_password:
            lines.append(f"user {c.redis_user} on >{c.redis_password} resetchannels {rule}")
    return lines


# --- what each process gets -------------------------------------------------------------------


def _with_user(url: str, user: str | None, password: str | None) -> str:
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    netloc = f"{host}:{parts.port}" if parts.port else host
    if user is not None and password is not None:
        netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{netloc}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def role_settings(base: Settings, creds: Credentials, role: Principal | str) -> Settings:
    """``base`` (the operator's settings) with ``role``'s credentials in place of the operator's.

    A role without Redis gets an empty ``redis_url`` and one without S3 empty keys; no role gets
    the credentials file.
    """
    c = creds.of(role)
    redis_url = _with_user(base.redis_url, c.redis_user, c.redis_password) if c.redis_user else ""
    return base.model_copy(update={
        "nats_url": _with_user(base.nats_url, c.nats_user, c.nats_password), "redis_url": redis_url,
        "s3_access_key": c.s3_access_key or "", "s3_secret_key": c.s3_secret_key or "",
        "credentials_file": ""})


def service_env(base: Settings, role: Principal | str) -> dict[str, str]:
    """Environment overrides for a control-plane process of ``role``, started with ``base``.

    With no ``credentials_file`` in ``base`` (external servers, one set of credentials), empty:
    every process uses the shared credentials. The controller also gets the members' credentials
    (``ROBUSTRL_<ROLE>_NATS_URL`` ...), which it hands out with ``credentials_for``.
    """
    if not base.credentials_file:
        return {}
    creds = Credentials.load(base.credentials_file)
    env = role_settings(base, creds, role).to_env()
    if Principal(role) is Principal.CONTROLLER:
        for member in MEMBER_ROLES:
            settings = role_settings(base, creds, member)
            for field, suffix in _FIELDS.items():
                env[f"ROBUSTRL_{member.value.upper()}_{suffix}"] = str(getattr(settings, field))
    return env


def credentials_for(role: Principal | str, env: Mapping[str, str]) -> dict[str, str]:
    """The environment overrides that give a member of ``role`` its own credentials.

    Read from the controller's environment (``ROBUSTRL_TRAINER_NATS_URL``, ``..._REDIS_URL``,
    ``..._S3_ACCESS_KEY``, ``..._S3_SECRET_KEY``; compose sets them from ``compose/.env``, the
    embedded stack from its generated credentials). A variable left empty means no access there.
    If none is set for the role, returns {} and the member shares the controller's credentials
    (external servers with a single user).
    """
    prefix = f"ROBUSTRL_{Principal(role).value.upper()}_"
    if not any(prefix + suffix in env for suffix in _FIELDS.values()):
        return {}
    out = {f"ROBUSTRL_{suffix}": env.get(prefix + suffix, "") for suffix in _FIELDS.values()}
    out["ROBUSTRL_CREDENTIALS_FILE"] = ""
    return out


def without_role_credentials(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` minus every role's credential variables (what a launcher may pass on to anything)."""
    drop = {f"ROBUSTRL_{r.value.upper()}_{suffix}" for r in MEMBER_ROLES for suffix in _FIELDS.values()}
    return {k: v for k, v in env.items() if k not in drop and k != "ROBUSTRL_CREDENTIALS_FILE"}


CREDENTIAL_VARS = frozenset({f"ROBUSTRL_{suffix}" for suffix in _FIELDS.values()}
                            | {"ROBUSTRL_API_TOKEN", "ROBUSTRL_CREDENTIALS_FILE"})
"""The variables through which a process holds its own credentials (a member's are set by
``credentials_for``; the controller's are its own)."""


def without_credentials(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with no credential at all, neither any role's nor the holder's own: the environment
    of a process that gets its member's credentials later (a warm spare, the fork server), so
    that a member never holds the controller's (``/proc/<pid>/environ`` keeps what a process was
    started with, whatever it sets afterwards)."""
    return {k: v for k, v in without_role_credentials(env).items() if k not in CREDENTIAL_VARS}


# --- compose: the same rules, passwords from compose/.env ---------------------------------------


def compose_password_var(service: str, role: Principal) -> str:
    """The compose/.env variable holding ``role``'s password for ``service`` (NATS or REDIS)."""
    return f"{service}_{role.value.upper()}_PASSWORD"


def render_compose_nats_users() -> str:
    """compose/nats.conf's ``authorization`` block: nats-server resolves the ``$VARIABLES`` from the
    container's environment at load time."""
    entries = ["    {user: $NATS_USER, password: $NATS_PASSWORD}"]
    entries += [nats_user_entry(role, role.value, "$" + compose_password_var("NATS", role)) for role in Principal]
    return "authorization {\n  users = [\n" + "\n".join(entries) + "\n  ]\n}\n"


def render_compose_redis_acl() -> list[str]:
    """Shell lines for compose's redis command: one ``user`` line per role with Redis access,
    appended to the 0600 config with the password from the environment (not argv)."""
    lines = []
    for role in Principal:
        rule = REDIS_ACCESS[role]
        if rule is None:
            continue
        var = compose_password_var("REDIS", role)
        fmt = f"user {role.value} on >%s resetchannels {rule}".replace("%R", "%%R")
        lines.append(f"printf '{fmt}\\n' \"$${var}\" >> /tmp/redis.conf")
    return lines


def write_compose_nats_users(compose_dir: Path) -> bool:
    """Rewrite the generated users block of ``compose_dir/nats.conf``; return whether it changed."""
    conf = compose_dir / "nats.conf"
    text = conf.read_text()
    head, rest = text.split("# BEGIN generated users\n", 1)
    _, tail = rest.split("# END generated users", 1)
    updated = f"{head}# BEGIN generated users\n{render_compose_nats_users()}# END generated users{tail}"
    if updated != text:
        conf.write_text(updated)
    return updated != text


if __name__ == "__main__":  # python -m robustrl.infra.credentials [--write]
    import sys

    if "--write" in sys.argv[1:]:
        compose = Path(__file__).resolve().parents[2] / "compose"
        print("compose/nats.conf", "rewritten" if write_compose_nats_users(compose) else "already current")
        missing = [line for line in render_compose_redis_acl() if line not in (compose / "docker-compose.yml").read_text()]
        for line in missing:
            print("compose/docker-compose.yml lacks:", line)
        sys.exit(1 if missing else 0)
    print(render_compose_nats_users())
    print("\n".join(render_compose_redis_acl()))
