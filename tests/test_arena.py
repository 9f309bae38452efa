"""The arena: streamed chunks with acknowledgements across spawned processes in both openreg IPC
modes, flat device memory, a consumer killed mid-stream, close, and bad inputs."""

import gc

import _workers
import pytest
import torch
from _support import TIMEOUT, open_fds, wait_until

import devipc

pytestmark = pytest.mark.usefixtures("ipc_mode")


def _drain():
    """Until this process holds nothing another test left: memory in a garbage cycle (a failed
    test's traceback) or waiting for a release would otherwise be counted as ours."""
    gc.collect()
    torch.accelerator.synchronize()
    wait_until(
        lambda: (lambda s: s["sent"] == 0 and s["pending_releases"] == 0)(devipc.stats()),
        "every send and release ended",
        collect=True,
    )


def _chunk(generation):
    """A chunk whose values depend on its generation, with mixed dtypes and odd sizes."""
    return {
        "w": torch.arange(300, dtype=torch.float32, device="openreg").reshape(20, 15) + generation,
        "b": torch.full((7,), generation, dtype=torch.int64, device="openreg"),
        "h": torch.full((33,), generation / 4, dtype=torch.bfloat16, device="openreg"),
    }


def _start(children, arena, acknowledge=True):
    inbox, outbox = children.ctx.Queue(), children.ctx.Queue()
    proc = children.start(_workers.arena_consumer, arena.attach(), inbox, outbox, acknowledge)
    assert outbox.get(timeout=TIMEOUT) == ("attached", "openreg")
    return proc, inbox, outbox


def test_fifty_chunks_stream_with_acknowledgements_and_flat_memory(children):
    _drain()
    baseline = torch.openreg.memory_allocated()
    arena = devipc.Arena(4096, "openreg")
    with_arena = torch.openreg.memory_allocated()
    assert with_arena - baseline >= 2 * 4096
    _, inbox, outbox = _start(children, arena)
    torch.openreg.reset_peak_memory_stats()
    after_each, previous = [], None
    for generation in range(50):
        source = _chunk(generation)
        inbox.put(arena.put(source, timeout=TIMEOUT))
        expected = {name: t.cpu().tolist() for name, t in source.items()}
        del source
        after_each.append(torch.openreg.memory_allocated())
        if generation:  # the consumer works on chunk k while we filled k + 1
            assert outbox.get(timeout=TIMEOUT) == (generation - 1, previous)
        previous = expected
    assert outbox.get(timeout=TIMEOUT) == (49, previous)
    # no growth, chunk after chunk
    assert max(after_each) <= with_arena and len(set(after_each[-10:])) == 1
    assert torch.openreg.max_memory_allocated() <= with_arena + 4096  # plus one chunk's sources
    arena.wait_for(49, timeout=TIMEOUT)
    assert arena.consumers()[0]["acknowledged"] == 49
    inbox.put(None)
    children.join_ok()
    arena.close()
    _drain()
    assert torch.openreg.memory_allocated() <= baseline  # (below: memory others left went)


def test_buffers_of_an_odd_size_start_aligned(children):
    arena = devipc.Arena(1001, "openreg")  # rounded up: buffer 1 must start aligned for int64
    assert arena.nbytes == 1024
    _, inbox, outbox = _start(children, arena)
    for generation in range(3):
        source = {
            "b": torch.full((7,), generation, dtype=torch.int64, device="openreg"),
            "w": torch.arange(4, dtype=torch.float32, device="openreg") + generation,
        }
        inbox.put(arena.put(source, timeout=TIMEOUT))
        assert outbox.get(timeout=TIMEOUT) == (
            generation,
            {n: t.cpu().tolist() for n, t in source.items()},
        )
    inbox.put(None)
    children.join_ok()
    arena.close()
    _drain()


def test_a_buffer_is_reused_only_after_its_acknowledgement(children):
    arena = devipc.Arena(4096, "openreg", buffers=2)
    proc, inbox, outbox = _start(children, arena, acknowledge=False)
    for generation in range(2):  # two buffers: no acknowledgement needed yet
        inbox.put(arena.put(_chunk(generation), timeout=TIMEOUT))
        assert outbox.get(timeout=TIMEOUT)[0] == generation
    with pytest.raises(devipc.AckTimeoutError, match="acknowledged generation 0"):
        arena.put(_chunk(2), timeout=0.2)
    assert arena.generation == 1  # nothing was overwritten
    inbox.put(None)
    children.join_ok()  # a consumer that closes stops counting
    arena.put(_chunk(2), timeout=TIMEOUT)
    arena.close()
    _drain()


def test_a_consumer_killed_mid_stream_gives_the_arena_back(children):
    _drain()
    baseline = torch.openreg.memory_allocated()
    arena = devipc.Arena(4096, "openreg")
    proc, inbox, outbox = _start(children, arena, acknowledge=False)
    for generation in range(2):
        inbox.put(arena.put(_chunk(generation), timeout=TIMEOUT))
        assert outbox.get(timeout=TIMEOUT)[0] == generation
    proc.kill()
    proc.join(TIMEOUT)
    with pytest.raises(devipc.ConsumerDiedError, match=f"pid {proc.pid}") as raised:
        arena.put(_chunk(2), timeout=TIMEOUT)  # ends on the death, long before the timeout
    assert raised.value.consumers == [(0, proc.pid)] and raised.value.generation == 0
    assert isinstance(raised.value, devipc.PeerGoneError)
    del raised  # its traceback holds the chunk's sources
    assert arena.consumers()[0]["state"] == "died"
    for generation in range(2, 6):  # the arena is ours again
        arena.put(_chunk(generation), timeout=TIMEOUT)
    arena.close()
    _drain()  # the dead consumer's send was reclaimed
    assert torch.openreg.memory_allocated() <= baseline  # (below: memory others left went)


def test_close_leaves_memory_at_baseline(children):
    _drain()
    baseline = torch.openreg.memory_allocated()
    arena = devipc.Arena(1 << 16, "openreg", buffers=3)
    unopened = arena.attach()
    _, inbox, outbox = _start(children, arena)
    inbox.put(arena.put(_chunk(0), timeout=TIMEOUT))
    assert outbox.get(timeout=TIMEOUT)[0] == 0
    arena.close()
    arena.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        arena.put(_chunk(1))
    with pytest.raises(devipc.InvalidHandleError):
        devipc.open_arena(unopened)  # its send was revoked with the arena
    inbox.put(None)
    children.join_ok()
    _drain()
    assert torch.openreg.memory_allocated() <= baseline  # (below: memory others left went)


def test_close_leaves_no_descriptors():
    """Producer and consumer in one process: the control file, its second open and the mapping
    of the arena all go."""
    warm = devipc.open(devipc.share(torch.ones(1, device="openreg")))  # the counter file and
    del warm  # the consumer's idle open of it exist already
    _drain()
    baseline, fds = torch.openreg.memory_allocated(), open_fds()
    arena = devipc.Arena(1 << 16, "openreg")
    reader = devipc.open_arena(arena.attach())
    chunk = reader.read(arena.put(_chunk(0)))
    assert chunk.tensors["b"].cpu().tolist() == [0] * 7
    reader.ack(chunk)
    assert open_fds() > fds
    del chunk
    reader.close()
    arena.close()
    _drain()
    assert open_fds() <= fds  # (below: an earlier test's fds went)
    assert torch.openreg.memory_allocated() <= baseline  # (below: memory others left went)


def test_bad_inputs_are_refused_clearly():
    with pytest.raises(ValueError, match="nbytes"):
        devipc.Arena(0, "openreg")
    with pytest.raises(ValueError, match="buffers"):
        devipc.Arena(64, "openreg", buffers=0)
    with pytest.raises(ValueError, match="at most 16 buffers"):
        devipc.Arena(64, "openreg", buffers=17)
    with pytest.raises(devipc.UnsupportedDeviceError):
        devipc.Arena(64, "meta")  # no hooks (a CPU arena is torch's shared memory)
    with devipc.Arena(1024, "openreg") as arena, devipc.Arena(1024, "openreg") as other:
        reader = devipc.open_arena(arena.attach())
        with pytest.raises(devipc.InvalidHandleError):
            devipc.open_arena(b"DVIP junk")
        with pytest.raises(ValueError, match="split it"):
            arena.put({"big": torch.ones(1024, device="openreg")})
        with pytest.raises(ValueError, match="unique"):
            arena.put([("a", torch.ones(1, device="openreg"))] * 2)
        with pytest.raises(ValueError, match="arena is on openreg:0"):
            arena.put({"a": torch.ones(1, device="openreg:1")})
        with pytest.raises(ValueError, match="arena is on openreg:0, the chunk on cpu"):
            arena.put({"a": torch.ones(1)})
        with pytest.raises(ValueError, match="timeout"):
            arena.put({"a": torch.ones(1, device="openreg")}, timeout=0)
        data = arena.put({"a": torch.ones(1, device="openreg")})
        with pytest.raises(devipc.InvalidHandleError, match="another arena"):
            reader.read(other.put({"a": torch.ones(1, device="openreg")}))
        with pytest.raises(devipc.InvalidHandleError, match="truncated"):
            reader.read(data[:-3])
        bucket = devipc.share_tensors({"a": torch.ones(1, device="openreg")})
        with pytest.raises(devipc.InvalidHandleError, match="expected a arena chunk"):
            reader.read(bytes(bucket))
        assert bucket.revoke()
        with pytest.raises(ValueError, match="not read yet"):
            reader.ack(0)
        chunk = reader.read(data)
        assert chunk.tensors["a"].cpu().tolist() == [1.0]
        with pytest.raises(TypeError, match="generation"):
            reader.ack("0")
        reader.ack(chunk)
        with pytest.raises(devipc.InvalidHandleError, match="older than"):
            reader.read(data)
        reader.close()
        with pytest.raises(ValueError, match="closed"):
            reader.read(data)
        del chunk
    _drain()


def test_an_attachment_opens_once():
    with devipc.Arena(1024, "openreg") as arena:
        data = arena.attach()
        reader = devipc.open_arena(data)
        with pytest.raises(devipc.InvalidHandleError, match="already opened"):
            devipc.open_arena(data)
        reader.close()
    _drain()


def test_an_attachment_never_opened_does_not_hold_the_producer(children):
    """A consumer that dies after attach() and before open_arena: puts go on, no timeout."""
    arena = devipc.Arena(4096, "openreg", buffers=2)
    proc = children.start(_workers.exit_now, arena.attach())  # receives the bytes, opens nothing
    proc.join(TIMEOUT)
    assert proc.exitcode == 0
    lost = arena.attach()  # bytes that never reach anyone
    del lost
    for generation in range(6):
        arena.put(_chunk(generation), timeout=1)
    assert [c["state"] for c in arena.consumers().values()] == ["not opened yet"] * 2
    arena.close()
    _drain()


def test_a_reader_opening_late_starts_after_the_refilled_buffers():
    with devipc.Arena(4096, "openreg", buffers=2) as arena:
        data = arena.attach()
        chunks = [arena.put(_chunk(generation), timeout=1) for generation in range(4)]
        reader = devipc.open_arena(data)
        assert reader.acknowledged == 1  # chunks 0 and 1 lie in buffers refilled by 2 and 3
        for old in chunks[:2]:
            with pytest.raises(devipc.InvalidHandleError, match="before this reader opened"):
                reader.read(old)
        chunk = reader.read(chunks[2])
        assert chunk.tensors["b"].cpu().tolist() == [2] * 7
        with pytest.raises(devipc.AckTimeoutError):  # the late reader now counts
            arena.put(_chunk(4), timeout=0.2)
        reader.ack(chunk)
        arena.put(_chunk(4), timeout=1)
        del chunk
        reader.close()
    _drain()


@pytest.mark.filterwarnings("ignore:devipc. .* sends were never opened")  # 1,024 of them
def test_records_of_closed_and_revoked_attachments_are_reused():
    with devipc.Arena(1024, "openreg") as arena:
        for _ in range(3 * 64):  # attach/open/close cycles: each record freed for the next
            devipc.open_arena(arena.attach()).close()
        assert list(arena.consumers()) == [0]  # one record, reused: the scans look at one
        unopened = [arena.attach() for _ in range(1024)]
        with pytest.raises(ValueError, match="at most 1024 consumers attached at a time"):
            arena.attach()
        devipc.set_unopened_deadline(0.05)
        try:
            wait_until(
                lambda: devipc.stats()["sent"] == 0,
                "the unopened attachments revoked by the deadline",
                collect=True,
            )
        finally:
            devipc.set_unopened_deadline(None)
        fresh = arena.attach()  # a revoked attachment's record, under a new serial
        for stale in unopened:
            with pytest.raises(devipc.InvalidHandleError):
                devipc.open_arena(stale)
        reader = devipc.open_arena(fresh)
        reader.read(arena.put({"a": torch.ones(1, device="openreg")}))
        reader.close()
    _drain()


@pytest.mark.parametrize("device", ["openreg", "cpu"])
def test_a_published_checksum_is_verified_where_it_is_read(device):
    """A generation's CRC-32 goes with it (`put` or `publish` with checksum=True), per buffer
    of two; a reader's `verify` computes it again over its own view of the buffer."""
    with devipc.Arena(4096, device, buffers=2) as arena:
        reader = devipc.open_arena(arena.attach())
        assert reader.device.type == device
        for generation in range(3):
            chunk = reader.read(
                arena.put(
                    {"x": torch.full((1000,), generation, dtype=torch.int32, device=device)},
                    checksum=generation != 1,
                )
            )
            if generation == 1:
                with pytest.raises(ValueError, match="without a checksum"):
                    reader.verify(generation)
            else:
                reader.verify(generation)
                chunk.tensors["x"][5] += 1  # forged where it is read
                with pytest.raises(devipc.ChecksumError, match=f"generation {generation}"):
                    reader.verify(generation)
            reader.ack(chunk)
            with pytest.raises(ValueError, match="not held"):
                reader.verify(generation)
        del chunk
        reader.close()
    with devipc.Arena(64, device, buffers=3) as arena, pytest.raises(ValueError, match="2 buf"):
        arena.publish(checksum=True)
    _drain()
