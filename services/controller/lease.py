"""The controller's leader lease: one controller acts at a time, a second waits as hot standby.

The lease is a Redis key holding ``<owner>:<token>`` with an expiry (SET NX PX). Each term gets a
fencing token from a counter (INCR) in the same Lua script, so tokens only grow: every action the
leader takes carries its token, and a receiver that has seen a larger one refuses it (a controller
that was frozen past its lease cannot act on stale state). Renewal is a compare-and-extend; a
leader that finds the key gone re-acquires with a new, larger token; one that finds another
owner's value has lost the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from robustrl.aio import wait_event, within
from robustrl.storage.redis_stores import Keys

log = logging.getLogger(__name__)

LEASE_TTL_S = 5.0
"""How long a lease lives without renewal: a standby takes over at most this long after the
leader stopped renewing (killed, frozen, partitioned). 3 s expired every ~10 s on a shared 2-core
machine at load 40-75 (a starved event loop misses its renewals); ROBUSTRL_LEASE_TTL_S overrides."""
RENEW_FRACTION = 1 / 3
"""The leader renews every ``ttl * RENEW_FRACTION``."""
ACQUIRE_POLL_FRACTION = 1 / 6
"""A standby tries to acquire every ``ttl * ACQUIRE_POLL_FRACTION``."""
REDIS_OP_TIMEOUT_S = 1.0
"""One lease operation on Redis; a slower answer counts as a failed renewal."""

_ACQUIRE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local t = redis.call('INCR', KEYS[2])
  redis.call('SET', KEYS[1], ARGV[1] .. ':' .. t, 'PX', ARGV[2])
  return t
end
return 0
"""
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class LeaseLost(Exception):
    """Another controller holds the lease now."""


class LeaderLease:
    """Acquire, renew and release the controller lease.

    Args:
        redis: an asyncio Redis client.
        owner: this controller's unique name (host, pid, random suffix).
        ttl_s: lease lifetime without renewal.
    """

    def __init__(self, redis: Any, owner: str, ttl_s: float = LEASE_TTL_S) -> None:
        self.r = redis
        self.owner = owner
        self.ttl_ms = max(100, int(ttl_s * 1000))
        self.token = 0
        self.lost = False  # set once ``keep`` found the lease lost: no term of this one's is newest

    @property
    def ttl_s(self) -> float:
        return self.ttl_ms / 1000

    @property
    def value(self) -> str:
        return f"{self.owner}:{self.token}"

    async def try_acquire(self) -> bool:
        """One attempt; True (and a new ``token``) if this controller is the leader now."""
        token = int(await within(
            self.r.eval(_ACQUIRE, 2, Keys.controller_lease(), Keys.controller_fence(), self.owner,
                        self.ttl_ms),
            REDIS_OP_TIMEOUT_S, "redis: the lease's acquisition"))
        if token > 0:
            self.token = token
            return True
        return False

    async def acquire(self, stop: asyncio.Event | None = None) -> int:
        """Wait (as hot standby) until this controller holds the lease; return the token."""
        while stop is None or not stop.is_set():
            try:
                if await self.try_acquire():
                    log.warning("controller %s is the leader (fencing token %d)", self.owner, self.token)
                    return self.token
            except Exception as exc:  # Redis briefly away: keep waiting, it is a standby's job
                log.warning("lease: acquire failed: %s", exc)
            await _pause(stop, self.ttl_s * ACQUIRE_POLL_FRACTION)
        raise asyncio.CancelledError("stopped while waiting for the lease")

    async def renew(self) -> bool:
        """Extend the lease; False if this controller does not hold it any more."""
        ok = await within(
            self.r.eval(_RENEW, 1, Keys.controller_lease(), self.value, self.ttl_ms), REDIS_OP_TIMEOUT_S,
            "redis: the lease's renewal")
        return bool(int(ok))

    async def own_newer_term(self) -> bool:
        """Whether the lease key names this controller with a newer token than ``token``: its own
        re-acquisition (``keep``: the key had expired) ran in Redis and its reply is still on the
        way, so the fencing counter is already above ``token``. The token is taken from the key
        then (it is this controller's term) if it is the very next one; False if another
        controller holds the lease, none does, or another term came in between. The token the
        key is compared with is the one held before the look: the acquisition's own reply, handled
        while the look was on its way, may have taken the newer token up already (then it is
        this controller's too)."""
        base = self.token
        holder = await self.holder()
        if holder is None or self.lost:
            return False
        owner, _, token = holder.rpartition(":")
        # The very next term only: a larger gap means another controller held a term in between
        # (this one's late acquisition landing after it), whose actions this one never saw.
        if owner != self.owner or not token.isdigit() or int(token) != base + 1:
            return False
        self.token = max(self.token, int(token))
        return True

    async def newest_term(self) -> bool:
        """Whether no newer lease term than this controller's has begun: the fencing counter in
        Redis is not above its token (one read), or it is, by this controller's own
        re-acquisition in flight (``own_newer_term``). True without a term (no token).

        The counter is compared with the token held when the read was sent: a reply of the
        keeper's re-acquisition handled meanwhile raises the token, and the counter read before it
        must not pass for that newer term's."""
        if self.lost:
            return False
        if not self.token:
            return True
        token = self.token
        newest = await within(self.r.get(Keys.controller_fence()), REDIS_OP_TIMEOUT_S,
                              "redis: the read of the lease's fencing counter")
        newest_ok = int(newest or 0) <= token or await self.own_newer_term()
        return newest_ok and not self.lost  # (the keeper may have found it lost meanwhile)

    async def holder(self) -> str | None:
        raw = await within(self.r.get(Keys.controller_lease()), REDIS_OP_TIMEOUT_S, "redis: the read of the lease's holder")
        return None if raw is None else raw.decode()

    async def keep(self, stop: asyncio.Event, on_new_token: Callable[[int], Awaitable[None]]) -> None:
        """Renew until ``stop``; raise LeaseLost when another controller holds the lease.

        A renewal that finds the key expired (this process was frozen, or Redis restarted) takes
        the lease again with a new, larger token and tells ``on_new_token``.
        """
        loop = asyncio.get_running_loop()
        renewed_at = loop.time()
        while not stop.is_set():
            await _pause(stop, self.ttl_s * RENEW_FRACTION)
            if stop.is_set():
                return
            try:
                if await self.renew():
                    renewed_at = loop.time()
                    continue
                if await self.own_newer_term():  # taken again by this controller meanwhile
                    renewed_at = loop.time()
                    await on_new_token(self.token)
                    continue
                holder = await self.holder()
                if holder == self.value:
                    # This controller's term, taken up meanwhile by another look (a start's
                    # ``newest_term``) while this renewal, sent under the older token, was on its
                    # way: not another's (the flake of test_controller_runtime's re-acquisition
                    # test: the leader deposed itself).
                    renewed_at = loop.time()
                    await on_new_token(self.token)
                    continue
                if holder is not None:
                    raise LeaseLost(f"lease held by {holder} (this controller had token {self.token})")
                before = self.token
                if await self.try_acquire():
                    if self.token != before + 1:
                        # Another controller held a term in between (it took the expired lease
                        # and lost it in turn): it may have started, stopped or recorded members
                        # this controller never saw. Acting on its old view would undo them. The
                        # token goes back to the old one (every fenced write and command of this
                        # controller refused from now on) and the key is given up at once.
                        taken, self.token = self.token, before
                        self.lost = True
                        with contextlib.suppress(Exception):
                            await within(self.r.eval(_RELEASE, 1, Keys.controller_lease(), f"{self.owner}:{taken}"),
                                         REDIS_OP_TIMEOUT_S)
                        raise LeaseLost(f"lease re-acquired with token {taken}, but token {before} "
                                        "was this controller's: another term came in between")
                    renewed_at = loop.time()
                    log.warning("lease had expired; re-acquired with fencing token %d", self.token)
                    await on_new_token(self.token)
                    continue
                if await self.own_newer_term():
                    # Taken by this controller between the look and the attempt (an earlier
                    # acquisition of its own whose reply was lost): not another's (seen once under
                    # load in test_controller_runtime: the leader deposed itself).
                    renewed_at = loop.time()
                    await on_new_token(self.token)
                    continue
                raise LeaseLost("lease taken by another controller while re-acquiring")
            except LeaseLost:
                # Before anything else runs: a start between this raise and the controller's own
                # stop must not pass ``newest_term`` (the token may be one taken after another term).
                self.lost = True
                raise
            except Exception as exc:  # one failed renewal is not a loss; the ttl decides
                log.warning("lease: renewal failed: %s", exc)
                if loop.time() - renewed_at > self.ttl_s:
                    # One look first: an acquisition of this controller's whose reply came too
                    # late for its timeout may have taken the lease (after an expiry the first
                    # slow answer lands here).
                    before = self.token
                    with contextlib.suppress(Exception):
                        # (a renewal that succeeds extends the key: the clock may start again)
                        if await self.own_newer_term() or await self.renew():
                            renewed_at = loop.time()
                            if self.token != before:
                                await on_new_token(self.token)
                            continue
                    # Redis unreachable for a lease lifetime: another controller may lead now.
                    self.lost = True
                    raise LeaseLost(f"lease not renewed for {loop.time() - renewed_at:.1f}s "
                                    f"(ttl {self.ttl_s:g}s): {exc}") from exc

    async def release(self) -> None:
        """Give the lease up at once (graceful stop), so a standby need not wait for the expiry."""
        if self.token:
            try:
                await within(self.r.eval(_RELEASE, 1, Keys.controller_lease(), self.value), REDIS_OP_TIMEOUT_S)
            except Exception as exc:
                log.warning("lease: release failed: %s", exc)


async def _pause(stop: asyncio.Event | None, seconds: float) -> None:
    """Wait ``seconds`` or until ``stop`` is set (a periodic timer, not a wait for a condition)."""
    if stop is None:
        await asyncio.sleep(seconds)
        return
    await wait_event(stop, seconds)
