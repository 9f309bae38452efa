"""The processes of tests/test_relay.py, spawned: an engine and a trainer, each driven by
commands through a pipe; each replies to each command, an error as its exception."""

import hashlib
import os
import time

import torch

import devipc
from devipc import p2p
from devipc._weights import _relay


def _digest(tensors) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(tensors.items()):
        digest.update(name.encode() + tensor.cpu().numpy().tobytes())
    return digest.hexdigest()


def engine(conn) -> None:
    """An engine: ("open", token, share[, prefetch]) subscribes, ("stall", seconds[, lag]) sets
    RELAY_STALL (and RELAY_LAG), ("slow", chunk, seconds) makes its pull of that chunk from the
    trainer take `seconds` more (a slow link: the engine still moves), ("take",) waits for,
    checks and acknowledges the next generation, ("hold",) waits for it without acknowledging,
    ("copy",) copies the held one out and acknowledges, ("close",) closes the subscription and
    replies how many fds are open; ("exit",) ends."""
    import devipc_openreg  # noqa: F401 - the device of the weights

    p2p.Endpoint(transport="nixl").close()  # NIXL's first use keeps some fds
    sub = None
    while True:
        command, *args = conn.recv()
        try:
            if command == "open":
                sub = devipc.WeightSubscriber(args[0], share=args[1], prefetch=args[2:] == [True])
                conn.send(os.getpid())
            elif command == "stall":
                _relay.RELAY_STALL = args[0]
                _relay.RELAY_LAG = args[1] if len(args) > 1 else _relay.RELAY_LAG
                conn.send(None)
            elif command == "slow":
                _slow(*args)
                conn.send(None)
            elif command == "take":
                generation = sub.wait(timeout=60)
                # no view outlives the digest: the engine's memory goes once it closed
                digest = _digest(sub.tensors())
                sub.ack()
                conn.send((generation, digest, sub._backend.counts()))
            elif command == "hold":  # the next generation, not acknowledged
                conn.send(sub.wait(timeout=60))
            elif command == "copy":  # the held one into the engine's own tensors, then ack
                own = {name: torch.empty_like(view) for name, view in sub.tensors().items()}
                sub.copy_into(own)
                sub.ack()
                conn.send((sub.generation, _digest(own)))
            elif command == "close":
                sub.close()
                sub = None
                devipc.ipc_collect()  # what the relay's buffers were exported as
                torch.accelerator.empty_cache()  # the allocator's cached segments: memfds
                conn.send(len(os.listdir("/proc/self/fd")))
            else:
                break
        except Exception as error:  # noqa: BLE001 - replied: the test raises it
            conn.send(error)


def _slow(chunk: int, seconds: float) -> None:
    """This engine's chunk `chunk` from the trainer comes `seconds` late, as over a slow link."""
    commit = _relay.Relay.commit

    def late(self, generation, buffer, index, staged, source):
        if source == "trainer" and index == chunk:
            time.sleep(seconds)
        commit(self, generation, buffer, index, staged, source)

    _relay.Relay.commit = late


def trainer(conn) -> None:
    """A trainer of 1 MiB of weights that relays: replies two tokens; at the first command
    waits for their subscribers and publishes generation 0 (replies its number); exits at the
    second."""
    import devipc_openreg  # noqa: F401 - the device of the weights

    weights = devipc.pack({"w": torch.ones(1 << 18, device="openreg")})
    publisher = devipc.WeightPublisher(weights, transport="nixl", relay=True)
    conn.send([publisher.token() for _ in range(2)])
    conn.recv()
    publisher.wait_subscribers(2, timeout=60)
    conn.send(publisher.publish(wait=False))
    conn.recv()
