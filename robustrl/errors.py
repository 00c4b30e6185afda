"""One error tree for RobustRL.

Every error says whether retrying can help (``retryable``) and carries the fields that
locate it (subject, member, step, field). Errors from nats, redis and minio are
translated into this tree at the edge (``robustrl.bus``, ``robustrl.storage``) with
``raise ... from exc``.
"""

from __future__ import annotations


class RobustRLError(Exception):
    """Root of every error raised by RobustRL code."""

    retryable: bool = False

    def __init__(self, message: str, **fields: object) -> None:
        super().__init__(message)
        self.message = message
        self.fields = fields
        for key, value in fields.items():
            setattr(self, key, value)

    def __str__(self) -> str:
        if not self.fields:
            return self.message
        extras = ", ".join(f"{k}={v!r}" for k, v in self.fields.items() if v is not None)
        return f"{self.message} ({extras})" if extras else self.message


class ConfigError(RobustRLError):
    """A configuration value or job spec is invalid; ``field`` names it."""


class SubjectError(RobustRLError):
    """A NATS subject token is invalid."""


class MessageError(RobustRLError):
    """A wire message could not be parsed; ``subject`` and ``field`` say where."""


class TransportError(RobustRLError):
    """A connection to NATS, Redis, the object store or a weight source failed."""

    retryable = True


class RequestTimeout(TransportError, TimeoutError):
    """A request got no answer in time; the message says how long it waited."""


class StorageError(RobustRLError):
    """The object store or Redis refused an operation or returned bad data."""

    retryable = True


class CheckpointError(StorageError):
    """A checkpoint is missing or corrupt; ``name`` says which."""

    retryable = False


class CheckpointLost(CheckpointError):
    """Steps are committed but no checkpoint can reproduce them (``step``: the newest committed,
    ``durable``: the newest checkpoint once durable). Training on from random weights would
    silently rewrite a committed history, so the job must fail instead."""


class CheckpointStalled(CheckpointError):
    """No checkpoint has become durable for more steps than ``trainer.max_undurable_steps``
    (uploads failing: the object store refusing manifests, a rank's shards never landing). Going
    on would make every later fault redo all of them, and the request manager keeps every batch
    since in Redis; the rank stops instead, named."""


EXIT_CHECKPOINT_STALLED = 67
"""Exit status of a trainer rank that stopped on ``CheckpointStalled``: the controller names the
cause in the fault's evidence (with the rank's last output) and restarts the gang from the newest
durable checkpoint, as after a crash (a store that recovers is recovered from; one that refuses
for good ends the job through ``recovery.max_restarts``)."""


EXIT_CHECKPOINT_LOST = 65
"""Exit status (EX_DATAERR) of a trainer that refuses to start because of ``CheckpointLost``: the
controller fails the job at once instead of restarting gangs that would refuse again."""

EXIT_DIVERGED = 66
"""Exit status of a trainer rank whose step's loss or gradient norm is not finite
(``TrainingDiverged``), before anything of the step is kept. The controller restarts the gang from
the newest checkpoint once (a transient fault, e.g. silent data corruption on one machine, does
not come again) and fails the job if it diverges again with no step committed in between (then
it is the data, the model or the settings: each restart would end the same way)."""


class StaleEpoch(RobustRLError):
    """A write by an older trainer-gang epoch was refused: a newer gang (``newest``) has taken
    over. The stale gang (``epoch``) must stop; retrying cannot help."""


class Superseded(RobustRLError):
    """A guarded write refused: the state it was begun under changed before it could land (a
    request manager's hand-over overtaken by a restart of its step). Nothing of it was written
    (unless an earlier attempt ran and only its reply was lost); retrying cannot help."""


class WeightSyncError(RobustRLError):
    """A weight version could not be pulled or failed verification."""

    retryable = True


class LaunchError(RobustRLError):
    """A role member could not be started, stopped or killed."""


class JobError(RobustRLError):
    """A job is in a state that does not allow the requested operation."""


class JobActive(JobError):
    """The operation needs the job to have ended (finished, failed or stopped) and it has not."""


class ScenarioError(ConfigError):
    """A chaos scenario file or fault request is malformed."""


class TestbedError(RobustRLError):
    """An ``ip``/``tc`` command of the network-namespace testbed failed; ``command`` and
    ``stderr`` say which and why."""

    __test__ = False  # not a pytest test class despite the name


class TestbedUnavailable(TestbedError):
    """The testbed cannot run here (not root, no ``ip``/``tc``, a kernel without a needed qdisc);
    the message says which. Retrying cannot help."""
