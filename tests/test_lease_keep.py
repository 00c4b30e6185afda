"""The controller's lease keeper against a real Redis (servers of this module's own: the lease key
is the one every controller of a Redis uses)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from support import eventually_async

from robustrl.services.controller.lease import _ACQUIRE, LeaderLease, LeaseLost
from robustrl.storage.redis_stores import Keys, connect


@contextlib.asynccontextmanager
async def _leader(servers: Any, owner: str) -> AsyncIterator[tuple[LeaderLease, Any]]:
    """A lease of ``owner``'s (0.6 s), held, and the Redis client it uses."""
    redis = connect(servers.redis_url)
    lease = LeaderLease(redis, owner, ttl_s=0.6)
    try:
        await redis.delete(Keys.controller_lease())  # (another test's lease, not yet expired)
        assert await lease.try_acquire()
        yield lease, redis
    finally:
        await redis.aclose()


async def _taken_in_redis(redis: Any, owner: str, expired: bool = True) -> int:
    """The key expired (``expired``: deleted first), then an acquisition for ``owner`` ran in
    Redis as the keeper's runs, its reply unseen by the lease; returns its token."""
    if expired:
        await redis.delete(Keys.controller_lease())
    return int(await redis.eval(_ACQUIRE, 2, Keys.controller_lease(), Keys.controller_fence(), owner, 60_000))


async def _keeper_verdict(lease: LeaderLease) -> list[int]:
    """Run the lease keeper until it reports a new token of its own or ends; return the tokens
    (raises what the keeper raised)."""
    tokens: list[int] = []

    async def on_new_token(token: int) -> None:
        tokens.append(token)

    stop = asyncio.Event()
    keeper = asyncio.create_task(lease.keep(stop, on_new_token))
    await eventually_async(lambda: tokens or keeper.done(), timeout=10, what="the keeper's verdict")
    stop.set()
    await keeper
    return tokens


async def test_a_lease_its_own_earlier_acquisition_took_meanwhile_is_kept_not_taken_for_another(servers) -> None:
    """The key expired (a starved event loop); the keeper's renewal fails, it finds no holder and
    tries to take the lease again, but an acquisition of its own whose reply was lost (or one
    whose reply is still on the way) took it in between: its attempt fails, the key names this
    controller. The keeper raised LeaseLost ("taken by another controller") and the leader
    deposed itself (seen once under load: test_controller_runtime's re-acquisition test failed
    with a start refused). It keeps leading under the newer token."""
    async with _leader(servers, "keeper-under-test") as (lease, redis):
        first = lease.token
        await redis.delete(Keys.controller_lease())  # expired
        real = lease.try_acquire

        async def raced() -> bool:
            # its own acquisition lands first (the keeper's look found no holder before it)
            await _taken_in_redis(redis, lease.owner, expired=False)
            return await real()

        lease.try_acquire = raced  # type: ignore[method-assign]
        tokens = await _keeper_verdict(lease)  # (LeaseLost raised here before)
        assert tokens == [lease.token] and lease.token > first
        assert (await redis.get(Keys.controller_lease())).decode() == lease.value


async def test_a_late_acquisition_of_its_own_after_another_controllers_term_is_not_taken_for_its_own(
        servers) -> None:
    """The keeper's acquisition timed out but was in flight; meanwhile another controller took a
    term and lost it; then the late acquisition landed, two terms on. Taken for this controller's
    own next term, it led on without ever seeing what the other did as leader (an outside review).
    Only the very next term is its own: it stops leading (LeaseLost) and takes over anew."""
    async with _leader(servers, "keeper-late") as (lease, redis):
        other = await _taken_in_redis(redis, "another")
        late = await _taken_in_redis(redis, lease.owner)  # the other's term ended too
        assert late == other + 1 == lease.token + 2

        async def on_new_token(token: int) -> None:
            raise AssertionError(f"took token {token} for its own")

        with pytest.raises(LeaseLost):
            await asyncio.wait_for(lease.keep(asyncio.Event(), on_new_token), 10)
        assert not await lease.newest_term()  # nor does a start's check take it for its own


async def test_a_renewal_sent_under_the_older_token_while_a_start_took_up_the_newer_one_is_no_loss(
        servers) -> None:
    """The key expired and this controller's own acquisition took it again (the next token); a
    start's check (``newest_term``) took that token up while the keeper's renewal, sent under the
    older token, was on its way: the renewal fails, the look for a newer term of its own finds
    none (taken up already), and the key names this controller's current term. The keeper raised
    LeaseLost and the leader deposed itself (the flake of test_controller_runtime's re-acquisition
    test, seen again in suite43)."""
    from robustrl.services.controller.lease import _RENEW

    async with _leader(servers, "keeper-racing") as (lease, redis):
        new = await _taken_in_redis(redis, lease.owner)
        real = lease.renew
        raced: list[bool] = []

        async def renewal_under_the_older_token() -> bool:
            if raced:
                return await real()
            older = lease.value
            raced.append(await lease.newest_term())  # a start's check takes the new term up meanwhile
            return bool(int(await redis.eval(_RENEW, 1, Keys.controller_lease(), older, lease.ttl_ms)))

        lease.renew = renewal_under_the_older_token  # type: ignore[method-assign]
        tokens = await _keeper_verdict(lease)  # (LeaseLost raised here before)
        assert raced == [True] and tokens == [new] == [lease.token]


async def test_a_re_acquisition_two_terms_on_is_another_controllers_gap_not_this_ones_term(servers) -> None:
    """The key expired; another controller took the lease and lost it in turn (its own freeze,
    a take-over that failed part-way and released it); only then does the keeper find no holder
    and take the lease, two terms on. It led on under the new token, acting on a view from before
    the other's term (members it started, stopped or recorded unseen, an outside review). A term
    that is not the very next one ends this controller's lead: LeaseLost, no start's check passes
    meanwhile, and its fenced writes carry the old token again."""
    async with _leader(servers, "keeper-gap") as (lease, redis):
        first = lease.token
        other = await _taken_in_redis(redis, "another")
        await redis.delete(Keys.controller_lease())  # the other's term ended (released)
        assert other == first + 1

        with pytest.raises(LeaseLost, match="another term came in between"):
            await _keeper_verdict(lease)
        assert not await lease.newest_term()
        # Its writes and commands fenced off (the old token), and the key given up to a standby.
        assert lease.token == first and await redis.get(Keys.controller_lease()) is None


async def test_a_start_check_whose_look_crossed_the_keepers_reply_is_this_controllers_term(servers) -> None:
    """The key expired and the keeper's re-acquisition ran in Redis (the counter one above the
    token held); a start's check reads the counter, finds it above, and looks at the key; while
    that look is on its way the acquisition's reply is handled and the token becomes the new
    one. The key names that term: this controller's. The look compared it with the token after
    the reply (the very next one of the new token, which it is not) and refused the start, and a
    just-started member was killed as a deposed leader's."""
    async with _leader(servers, "keeper-crossed") as (lease, redis):
        new = await _taken_in_redis(redis, lease.owner)
        real = lease.holder

        async def look_crossing_the_reply() -> str | None:
            held = await real()
            lease.token = new  # the keeper's acquisition reply, handled while the look was away
            return held

        lease.holder = look_crossing_the_reply  # type: ignore[method-assign]
        assert await lease.newest_term(), "this controller's own term refused"
        assert lease.token == new


async def test_a_renewal_timing_out_after_its_own_acquisition_took_the_lease_does_not_depose_it(servers) -> None:
    """Renewals time out (Redis answering slowly, a starved loop) for longer than a lease
    lifetime, while an acquisition of this controller's own, whose reply came too late for its
    timeout, did take the lease (the next term). The keeper deposed itself on the timeout alone,
    the key left naming it until it expired: nobody led meanwhile. It looks once first."""
    async with _leader(servers, "keeper-slow") as (lease, redis):
        first = lease.token

        async def slow_renewal() -> bool:
            if (await redis.get(Keys.controller_lease()) or b"").decode() != f"{lease.owner}:{first + 1}":
                # the key expired; this controller's acquisition landed, its reply too late
                await _taken_in_redis(redis, lease.owner)
            raise TimeoutError("the renewal's reply came too late (the test's)")

        lease.renew = slow_renewal  # type: ignore[method-assign]
        tokens = await _keeper_verdict(lease)  # (LeaseLost raised here before)
        assert tokens == [first + 1] == [lease.token]
