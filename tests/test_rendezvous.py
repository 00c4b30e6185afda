"""The trainer gang's rendezvous store listens on MASTER_ADDR only (``rendezvous_listener``), and
falls back to torch's own listen on every interface where one address could strand a peer."""

from __future__ import annotations

import datetime
import os
import socket

import pytest
from support import wide_listeners

from robustrl.services.trainer.worker import rendezvous_listener
from robustrl.ports import free_port


@pytest.mark.parametrize("libuv", [True, False])
def test_a_local_master_addr_gets_a_listener_on_that_address_only_and_torch_serves_on_it(libuv):
    """With libuv (torch's default) and without (USE_LIBUV=0, honoured as env:// honours it: the
    older store takes the socket as well, where it was handed none and listened on ``::``)."""
    import torch.distributed as dist

    port = free_port()
    fd = rendezvous_listener("127.0.0.1", port)
    assert fd is not None
    master = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=datetime.timedelta(seconds=10),
                           wait_for_workers=False, master_listen_fd=fd, use_libuv=libuv)
    try:
        peer = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=10),
                             use_libuv=libuv)
        peer.set("k", "v")
        assert master.get("k") == b"v"
        assert wide_listeners([os.getpid()]) == []  # read from /proc: nothing of it beyond loopback
    finally:
        del master


def test_any_loopback_address_is_local():
    # (Ray's test nodes are 127.0.0.2 and 127.0.0.3: no interface lists them, all are this machine's)
    port = free_port()
    fd = rendezvous_listener("127.0.0.3", port)
    assert fd is not None
    os.close(fd)


@pytest.mark.parametrize(("address", "why"), [
    ("192.0.2.123", "not an address of this machine"),  # TEST-NET-1: never local
    ("no-such-host.invalid", "does not resolve"),
])
def test_an_address_a_listener_could_not_serve_falls_back_to_torchs_listen(address, why, caplog):
    assert rendezvous_listener(address, free_port()) is None
    assert why in caplog.text and "every interface" in caplog.text


def test_a_name_with_several_addresses_falls_back(monkeypatch, caplog):
    port = free_port()
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port)),
        (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", port, 0, 0))])
    assert rendezvous_listener("rank0.example", port) is None
    assert "2 addresses" in caplog.text


def test_a_taken_port_is_an_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError):
            rendezvous_listener("127.0.0.1", taken.getsockname()[1])


def test_an_address_that_cannot_be_bound_yet_falls_back(monkeypatch, caplog):
    """EADDRNOTAVAIL (an IPv6 address still tentative in a fresh namespace or pod): torch's listen
    on every interface serves there; failing rank 0 at every start would fail the job."""
    import errno

    def bind(self, address):
        raise OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address")

    port = free_port()
    monkeypatch.setattr(socket.socket, "bind", bind)
    assert rendezvous_listener("127.0.0.1", port) is None
    assert "cannot be bound" in caplog.text and "every interface" in caplog.text

