"""A fixed weight-server port (``ROBUSTRL_WEIGHTS_PORT``): the Kubernetes manifests set it, so that
a NetworkPolicy admits weight pulls on one port instead of the pod's whole ephemeral range."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from robustrl.config import Settings
from robustrl.errors import WeightSyncError
from robustrl.weights import WeightServer, pull
from robustrl.weights import server as server_mod
from robustrl.weights.flat import flatten_state_dict
from robustrl.ports import free_port

pytestmark = pytest.mark.timeout(60)


async def test_a_fixed_weights_port_is_served_on_reused_after_a_close_and_a_taken_one_named(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The server listens on the set port and a pull gets the version there; a process switching
    role in place (its server closed, the next one started on the same port) gets it again; a port
    another listener holds is refused with the setting named once the bounded wait is over; the
    control plane never hands the setting on to the members it launches (on one host they would
    collide)."""
    torch.manual_seed(0)
    buffer, manifest = flatten_state_dict({"w": torch.randn(64, 64), "b": torch.randn(64)}, version=3,
                                          chunk_bytes=4096)
    port = free_port()
    settings = Settings.from_env({"ROBUSTRL_WEIGHTS_PORT": str(port)})
    first = WeightServer("tcp", port=settings.weights_port)
    assert (await first.start()).endswith(f":{port}")
    first.add_version(manifest, buffer)
    got, _ = await pull(manifest, [first.address])
    assert np.array_equal(np.asarray(got), buffer.numpy().view(np.uint8))
    await first.close()
    second = WeightServer("tcp", port=port)  # the same process in its next role
    try:
        assert (await second.start()).endswith(f":{port}")
        monkeypatch.setattr(server_mod, "FIXED_PORT_WAIT_S", 0.4)
        with pytest.raises(WeightSyncError, match="ROBUSTRL_WEIGHTS_PORT"):
            await WeightServer("tcp", port=port).start()
    finally:
        await second.close()
    assert "ROBUSTRL_WEIGHTS_PORT" not in settings.to_env()


@pytest.mark.parametrize("raw", ["-1", "65536", "http", ""])
def test_a_bad_weights_port_is_a_config_error_naming_it(raw: str) -> None:
    from robustrl.errors import ConfigError

    with pytest.raises(ConfigError, match="ROBUSTRL_WEIGHTS_PORT"):
        Settings.from_env({"ROBUSTRL_WEIGHTS_PORT": raw})
