"""The owner process the same-host p2p tests read from and write to, and a peer connected to it."""

import os

import _p2p_workers
import pytest
from _support import Children, recv

import devipc.p2p as p2p


@pytest.fixture(scope="module")
def owner():
    """(call, metadata): `call(*command)` runs a command of `_p2p_workers.owner` there."""
    group = Children()
    try:
        proc, conn = group.start_piped(_p2p_workers.owner)
        ready, _, metadata = recv(conn)
        assert ready == "ready"

        def call(*command):
            conn.send(command)
            return recv(conn)

        yield call, metadata
    finally:
        group.reap()


@pytest.fixture
def peer(owner, ipc_mode):
    """A fresh endpoint here connected to the owner, both in this test's IPC mode."""
    call, metadata = owner
    call("env", "OPENREG_IPC_EVENTS", os.environ["OPENREG_IPC_EVENTS"])
    with p2p.Endpoint() as endpoint:
        yield endpoint.connect(metadata)
