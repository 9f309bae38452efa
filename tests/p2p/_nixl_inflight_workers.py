"""Children of test_nixl_inflight.py: NIXL transfers whose caller lets go of them in flight. Each
runs both endpoints in one process (UCX over TCP loopback reaches itself as another host), so a
crash is the child's exit code, not pytest's."""

import functools
import gc
import hashlib
import os
import signal
import threading
import time

import torch
from _support import after_large_posts, keyboard_interrupts

import devipc.p2p as p2p

WAIT = 60.0  # seconds, for a child's bounded waits (the test's own bound is longer)


def _pair(nbytes: int):
    """(owner endpoint, peer endpoint, connection, descriptor of `nbytes` bytes of 7s, the
    tensor it describes)."""
    import devipc_openreg  # noqa: F401 - the device, also where autoload is off

    source, _ = p2p.create_tensor((nbytes,), torch.uint8, "cpu")
    source.fill_(7)
    owner, peer = p2p.Endpoint(transport="nixl"), p2p.Endpoint(transport="nixl")
    connection = peer.connect(owner.metadata())
    return owner, peer, connection, owner.advertise(source), source


def _markers(nbytes: int) -> list[torch.Tensor]:
    """New memory of the size just let go of (the allocator maps it where the old was): a
    transfer still writing into the old memory overwrites these 1s."""
    return [torch.ones(nbytes, dtype=torch.uint8) for _ in range(2)]


def _settled(peer: p2p.Endpoint, ranges: int) -> bool:
    """Once NIXL is done with the transfers let go of, the reaper lets go of their memory:
    nothing in flight, no registration made for them left."""
    transport = peer._transport
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        with transport.lock:
            if not getattr(transport, "in_flight", ()) and len(transport._ranges) == ranges:
                return True
        time.sleep(0.01)
    return False


def _report(conn, peer, connection, desc, nbytes, ranges, markers, **counts) -> None:
    gc.collect()
    intact = all(bool((marker == 1).all()) for marker in markers)
    settled = _settled(peer, ranges)
    again = torch.zeros(nbytes, dtype=torch.uint8)
    connection.read(again, desc)  # the connection still works
    conn.send(
        {
            **counts,
            "settled": settled,
            "markers_intact": intact,
            "read_again": bool((again == 7).all()),
        }
    )


def dropped_after_a_timeout(conn, rounds: int, nbytes: int) -> None:
    """`read_async` into new memory, `wait(timeout=0.001)` raises TimeoutError, the caller drops
    the transfer and the memory."""
    owner, peer, connection, desc, _source = _pair(nbytes)
    ranges = len(peer._transport._ranges)
    markers: list[torch.Tensor] = []
    timed_out = 0
    for _ in range(rounds):
        local = torch.empty(nbytes, dtype=torch.uint8)  # registered with NIXL for this transfer
        transfer = connection.read_async(local, desc)
        try:
            transfer.wait(timeout=0.001)
        except TimeoutError:
            timed_out += 1
        del transfer, local
        gc.collect()
        markers += _markers(nbytes)
    _report(conn, peer, connection, desc, nbytes, ranges, markers, timed_out=timed_out)
    peer.close()
    owner.close()


def interrupted_read(conn, rounds: int, nbytes: int) -> None:
    """Ctrl-C (SIGINT) during a synchronous `read` of `nbytes` bytes, raised as soon as its
    request is posted and in flight (whatever the load); the caller then drops the memory."""
    keyboard_interrupts()
    owner, peer, connection, desc, _source = _pair(nbytes)
    ranges = len(peer._transport._ranges)
    sent: list[float] = []

    def interrupt(state):
        if state == "PROC":  # in flight: Ctrl-C now
            sent.append(time.monotonic())
            signal.raise_signal(signal.SIGINT)

    markers: list[torch.Tensor] = []
    interrupted, latencies = 0, []
    with after_large_posts(nbytes, interrupt):
        for _ in range(rounds):
            local = torch.empty(nbytes, dtype=torch.uint8)
            sent.clear()
            try:
                connection.read(local, desc)
            except KeyboardInterrupt:
                interrupted += 1
                latencies.append(time.monotonic() - sent[0])
            del local
            gc.collect()
            markers += _markers(nbytes)
    _report(
        conn,
        peer,
        connection,
        desc,
        nbytes,
        ranges,
        markers,
        interrupted=interrupted,
        latency=max(latencies, default=0.0),
    )
    peer.close()
    owner.close()


def _burner(seconds: float):
    """One C call that releases the GIL and handles no signal (as a NIXL poll that sits in
    UCX's code), of about `seconds` on this machine now."""
    rounds, started = 100_000, time.monotonic()
    hashlib.pbkdf2_hmac("sha256", b"devipc", b"salt", rounds)
    rounds = max(rounds, int(rounds * seconds / max(time.monotonic() - started, 1e-6)))
    return functools.partial(hashlib.pbkdf2_hmac, "sha256", b"devipc", b"salt", rounds)


def ctrl_c_in_a_long_poll(conn, nbytes: int) -> None:
    """Issue 53, item 1, deterministic: the first NIXL poll of a synchronous read of `nbytes`
    sits ~3 s in C (as UCX's do over TCP, seconds for a large transfer into fresh pages), and a
    process-directed SIGINT comes 50 ms into it. Sent back: where the poll ran, how long it sat,
    and how long after the signal KeyboardInterrupt came."""
    from devipc.p2p import _nixl

    keyboard_interrupts()
    owner, peer, connection, desc, _source = _pair(nbytes)
    ranges = len(peer._transport._ranges)
    poll, sent, seen, burnt = _nixl._Pending.poll, [], {}, threading.Event()
    burn = _burner(3.0)

    def sigint():
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    def long_poll(self, nixl):
        if self.keep is not None and not seen:  # the read's own requests, not a liveness read
            seen["main thread"] = threading.current_thread() is threading.main_thread()
            threading.Timer(0.05, sigint).start()
            started = time.monotonic()
            try:
                burn()
            finally:  # on main's code, KeyboardInterrupt comes here, once the poll returned
                seen["sat"] = time.monotonic() - started
                burnt.set()
        return poll(self, nixl)

    local = torch.empty(nbytes, dtype=torch.uint8)
    _nixl._Pending.poll = long_poll
    try:
        connection.read(local, desc)
        latency = None
    except KeyboardInterrupt:
        latency = time.monotonic() - sent[0]
    finally:
        _nixl._Pending.poll = poll
    burnt.wait(WAIT)  # in whichever thread polled
    del local
    _report(conn, peer, connection, desc, nbytes, ranges, [], latency=latency, **seen)
    peer.close()
    owner.close()


def owner_of_a_word(conn) -> None:
    """An endpoint of one registered word of 7 in a process the test may freeze, as a relay's
    progress word: sends its metadata and the word's descriptor, then waits for "exit"."""
    owner, word = p2p.Endpoint(transport="nixl"), p2p.create_tensor((1,), torch.int64, "cpu")[0]
    word.fill_(7)
    conn.send((owner.metadata(), owner.advertise(word)))
    conn.recv()
    owner.close()


def dropped_with_a_read_of_a_frozen_peer(conn, metadata: bytes, desc: bytes) -> None:
    """Connects and reads the word once; once the test froze the owner, posts a read into a
    new registered word (memory of its own, unmapped once freed), closes the connection, drops
    the transfer and the word and closes the endpoint (in a thread: it waits for the read);
    once the owner runs again, reads its word through a new endpoint (the owner answered what
    came before). An answer written into the word once unmapped: SIGSEGV. Sent back: whether
    the read was in flight when dropped, whether the endpoint closed, what the new read got."""
    peer = p2p.Endpoint(transport="nixl")
    connection = peer.connect(metadata, liveness=False)
    word = p2p.create_tensor((1,), torch.int64, "cpu")[0]
    connection.read(word, desc)
    conn.send(int(word[0]))
    conn.recv()  # the owner is frozen
    local = p2p.create_tensor((1,), torch.int64, "cpu")[0]
    transfer = connection.read_async(local, desc)
    in_flight = not transfer.done()
    connection.close()
    p2p.free_tensor(local)
    del transfer, local, connection
    gc.collect()
    closing = threading.Thread(target=peer.close)
    closing.start()
    conn.send(in_flight)
    conn.recv()  # the owner runs again: its answer lands in the memory kept for it
    closing.join(WAIT)
    with p2p.Endpoint(transport="nixl") as again:
        again.connect(metadata).read(word, desc)
    conn.send({"closed": not closing.is_alive(), "read_again": int(word[0])})
