"""Shared fixtures: real servers (session-scoped) and fresh object stores.

Helpers such as ``eventually`` live in ``tests/support.py``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from robustrl.config import Settings
from robustrl.infra.embedded import EmbeddedInfra
from robustrl.storage.objects import S3ObjectStore


@pytest.fixture(scope="session")
def infra(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """NATS (JetStream), Redis-protocol and S3 servers for the whole session; yields their Settings."""
    embedded = EmbeddedInfra(tmp_path_factory.mktemp("infra"))
    try:
        yield embedded.start()
    finally:
        embedded.stop()


@pytest.fixture
def object_store(infra: Settings) -> Iterator[S3ObjectStore]:
    """An S3 object store on the session's server, in a bucket of its own."""
    store = S3ObjectStore(infra.s3_endpoint, infra.s3_access_key, infra.s3_secret_key,
                          bucket=f"t-{uuid.uuid4().hex[:16]}", secure=infra.s3_secure)
    try:
        yield store
    finally:
        store.delete_prefix("")


@pytest.fixture(scope="session")
def stack(infra: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """Controller, detector and request manager as real processes on the session's servers."""
    from robustrl.stack import Stack

    st = Stack(tmp_path_factory.mktemp("stack"), external=infra)
    st.start()
    try:
        yield st
    finally:
        st.stop()


@pytest.fixture(scope="session")
def api(stack: object) -> Iterator[object]:
    from robustrl.client import ApiClient

    client = ApiClient(stack.api_url, stack.settings.api_token)  # type: ignore[attr-defined]
    try:
        yield client
    finally:
        client.close()
