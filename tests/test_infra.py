"""Embedded infrastructure: each server answers with its credentials and refuses wrong ones."""

from __future__ import annotations

import io
import socket
import stat
import time
from pathlib import Path
from urllib.parse import urlparse

import nats
import psutil
import pytest
import redis
from minio import Minio
from minio.error import MinioException
from nats.errors import Error as NatsError
from redis.backoff import NoBackoff
from redis.retry import Retry
from support import eventually, eventually_async

from robustrl.config import Settings
from robustrl.errors import ConfigError, LaunchError
from robustrl.infra import binaries
from robustrl.infra.embedded import INFRA_FILE, EmbeddedInfra


def _with_password(url: str, password: str) -> str:
    parsed = urlparse(url)
    user = parsed.username or ""
    return parsed._replace(netloc=f"{user}:{password}@{parsed.hostname}:{parsed.port}").geturl()


async def test_nats_pubsub_and_jetstream(infra: Settings) -> None:
    nc = await nats.connect(infra.nats_url, connect_timeout=2, max_reconnect_attempts=0)
    try:
        sub = await nc.subscribe("robustrl.test.ping")
        await nc.publish("robustrl.test.ping", b"hello")
        msg = await sub.next_msg(timeout=2)
        assert msg.data == b"hello"

        js = nc.jetstream()
        await js.add_stream(name="INFRA_TEST", subjects=["robustrl.infra_test.>"])
        ack = await js.publish("robustrl.infra_test.a", b"event")
        assert ack.stream == "INFRA_TEST" and ack.seq == 1
        info = await js.stream_info("INFRA_TEST")
        assert info.state.messages == 1
        await js.delete_stream("INFRA_TEST")
    finally:
        await nc.close()


async def test_nats_rejects_wrong_password(infra: Settings) -> None:
    with pytest.raises((NatsError, OSError)):
        nc = await nats.connect(_with_password(infra.nats_url, "wrong"), connect_timeout=2,
                                allow_reconnect=False, max_reconnect_attempts=0)
        await nc.close()


def test_redis_auth(infra: Settings) -> None:
    client = redis.Redis.from_url(infra.redis_url, socket_timeout=2)
    try:
        assert client.set("infra:test", b"value")
        assert client.get("infra:test") == b"value"
        assert client.config_get("appendonly")["appendonly"] == "yes"
    finally:
        client.close()
    wrong = redis.Redis.from_url(_with_password(infra.redis_url, "wrong"), socket_timeout=2)
    with pytest.raises(redis.AuthenticationError):
        wrong.ping()
    anonymous = redis.Redis(host="127.0.0.1", port=urlparse(infra.redis_url).port, socket_timeout=2,
                            retry=Retry(NoBackoff(), 0))  # redis-py would otherwise retry for seconds
    with pytest.raises(redis.AuthenticationError):
        anonymous.get("infra:test")


def test_s3_minio_round_trip(infra: Settings) -> None:
    client = Minio(infra.s3_endpoint, access_key=infra.s3_access_key, secret_key=infra.s3_secret_key,
                   secure=False)
    assert client.bucket_exists(infra.s3_bucket)
    client.make_bucket("infra-test")
    client.put_object("infra-test", "a/one", io.BytesIO(b"1"), 1)
    client.put_object("infra-test", "a/two", io.BytesIO(b"22"), 2)
    resp = client.get_object("infra-test", "a/two")
    try:
        assert resp.read() == b"22"
    finally:
        resp.close()
        resp.release_conn()
    assert [o.object_name for o in client.list_objects("infra-test", prefix="a/", recursive=True)] == [
        "a/one", "a/two"]
    client.remove_object("infra-test", "a/one")
    assert [o.object_name for o in client.list_objects("infra-test", recursive=True)] == ["a/two"]

    wrong = Minio(infra.s3_endpoint, access_key=infra.s3_access_key, secret_key="wrong", secure=False)
    with pytest.raises(MinioException):  # rclone answers SignatureDoesNotMatch
        wrong.list_buckets()


def test_infra_file_is_private_and_loadable(infra: Settings) -> None:
    path = Path(infra.run_dir) / INFRA_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((Path(infra.run_dir) / "conf").stat().st_mode) == 0o700
    loaded = EmbeddedInfra.load(infra.run_dir)  # attach only; never stop the session's servers
    assert loaded.settings == infra
    assert loaded.alive() == {"nats": True, "redis": True, "s3": True}
    secrets_on_cmdline = [infra.s3_secret_key, urlparse(infra.redis_url).password,
                          urlparse(infra.nats_url).password]
    for record in loaded.records:
        cmdline = " ".join(psutil.Process(record.pid).cmdline())
        assert not any(s and s in cmdline for s in secrets_on_cmdline), record.name


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_start_refuse_second_and_down_from_infra_file(tmp_path: Path) -> None:
    infra = EmbeddedInfra(tmp_path / "run")
    t0 = time.perf_counter()
    settings = infra.start()
    startup_s = time.perf_counter() - t0
    assert startup_s < 15, f"startup took {startup_s:.2f} s"
    ports = [urlparse(settings.nats_url).port, urlparse(settings.redis_url).port,
             int(settings.s3_endpoint.rsplit(":", 1)[1])]
    assert all(p is not None and _port_open(p) for p in ports)

    with pytest.raises(LaunchError, match="already running"):
        EmbeddedInfra(tmp_path / "run").start()

    # What `robustrl down` does: stop from the recorded pids, from a fresh object.
    down = EmbeddedInfra.load(tmp_path / "run")
    down.stop()
    down.stop()  # idempotent
    assert not (tmp_path / "run" / INFRA_FILE).exists()
    assert not any(_port_open(p) for p in ports if p is not None)
    infra.stop()  # the original owner's stop is harmless now
    with pytest.raises(ConfigError):
        EmbeddedInfra.load(tmp_path / "run")
    assert "Server is ready" in (tmp_path / "run" / "logs" / "nats.log").read_text()


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True) if p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE}


def test_missing_binary_fails_cleanly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = _children()
    monkeypatch.setattr(binaries, "rclone", lambda: binaries.Binary("rclone", tmp_path / "no-such-rclone"))
    with pytest.raises(LaunchError, match="no-such-rclone"):
        EmbeddedInfra(tmp_path / "run").start()
    # NATS and Redis were spawned before rclone failed; they must be gone again.
    eventually(lambda: _children() <= before, timeout=10, what="servers of the failed start exited")
    assert not (tmp_path / "run" / INFRA_FILE).exists()


def test_server_that_exits_names_binary_and_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(binaries, "rclone", lambda: binaries.Binary("rclone", Path("/bin/false")))
    with pytest.raises(LaunchError) as err:
        EmbeddedInfra(tmp_path / "run").start()
    assert "/bin/false" in str(err.value) and str(tmp_path / "run" / "logs" / "s3.log") in str(err.value)


async def test_restart_keeps_redis_and_jetstream_data(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with EmbeddedInfra(run) as first:
        client = redis.Redis.from_url(first.redis_url, socket_timeout=2)
        client.set("durable:key", b"kept")
        client.close()
        nc = await nats.connect(first.nats_url, connect_timeout=2, max_reconnect_attempts=0)
        await nc.jetstream().add_stream(name="KEEP", subjects=["keep.>"])
        await nc.jetstream().publish("keep.a", b"1")
        await nc.close()
    with EmbeddedInfra(run) as second:
        assert second.redis_url != first.redis_url  # fresh credentials each start
        client = redis.Redis.from_url(second.redis_url, socket_timeout=2)
        assert client.get("durable:key") == b"kept"
        client.close()
        nc = await nats.connect(second.nats_url, connect_timeout=2, max_reconnect_attempts=0)
        info = await nc.jetstream().stream_info("KEEP")
        await nc.close()
        assert info.state.messages == 1


def test_eventually_returns_value_and_fails_bounded() -> None:
    calls = iter(range(100))
    assert eventually(lambda: next(calls) >= 3 and "done", timeout=5, interval=0.001) == "done"
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="never"):
        eventually(lambda: False, timeout=0.05, interval=0.01, what="never")
    assert time.monotonic() - t0 < 2


async def test_eventually_async_awaits_coroutines() -> None:
    state = {"n": 0}

    async def probe() -> bool:
        state["n"] += 1
        return state["n"] >= 3

    assert await eventually_async(probe, timeout=5, interval=0.001) is True
    with pytest.raises(AssertionError):
        await eventually_async(lambda: False, timeout=0.05, interval=0.01)
