"""What a trainer trained in one step, in a form the auditor can recompute from the raw stores.

The trainer's ``step_committed`` event carries ``trained``: the ids of the episodes it trained
and a digest of what it read of them (``batch_digest``). The auditor recomputes the digest from
the episode records it reads raw from Redis (or sampled live), so it can tell that the trainer
trained exactly the batch the request manager recorded, and, once Redis has collected a step's
keys, still judge that step: how many distinct episodes it trained, that no episode was trained in
two steps, and that a redo trained the same batch.

Only what training reads is digested: the prompt (its record, from which training builds the
prompt's tokens and groups episodes by prompt id, and its tokens), the reward and each turn's
role, tokens, behaviour logprobs, weights version and stop reason. Numbers of the turns and the
reward are normalised (a reward of ``1`` and of ``1.0`` are one reward), so a record that went
through another JSON encoder digests the same.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any


def _num(value: Any) -> Any:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else value


def episode_view(record: Mapping[str, Any]) -> list[Any]:
    """The parts of one episode record (as stored in Redis: a JSON object) that training reads."""
    turns = record.get("turns")
    return [record.get("episode_id"), record.get("prompt"), record.get("prompt_ids"), _num(record.get("reward")),
            [[t.get("role"), t.get("token_ids"), [_num(x) for x in t.get("logprobs") or []],
              t.get("weights_version", -1), t.get("stop_reason")] if isinstance(t, Mapping) else t
             for t in (turns if isinstance(turns, list) else [])]]


def batch_digest(records: Iterable[Mapping[str, Any]]) -> str:
    """sha256 (hex) of the episodes' views, in episode id order (an episode given twice counts twice)."""
    views = sorted((episode_view(r) for r in records), key=lambda v: str(v[0]))
    blob = json.dumps(views, separators=(",", ":"), sort_keys=True)  # (non-finite numbers: JSON's Infinity, NaN)
    return hashlib.sha256(blob.encode()).hexdigest()
