"""Child-process bodies of the p2p tests (spawn imports them): an owner that registers tensors and
answers control messages (never transfers: those are one-sided), and peers that read and write."""

import gc
import os
import time

import torch
from _support import open_fds, recv

import devipc
import devipc.p2p as p2p


def nixl_registered(transport, addr: int, nbytes: int) -> bool:
    """Whether NIXL's agent itself has [addr, addr + nbytes) registered: preparing a local
    descriptor list succeeds only for memory some backend registered."""
    agent = transport.agent
    try:
        agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(addr, nbytes, 0)], "DRAM").release()
    except Exception as error:  # noqa: BLE001 - NIXL's own exception type
        assert type(error).__name__ == "nixlNotFoundError", error
        return False
    return True


def owner(conn, transport="auto"):
    """Registers and advertises on request over an Endpoint(transport=...); reports what it
    holds. Commands are tuples."""
    import devipc_openreg  # noqa: F401 - the device, also where autoload is off

    endpoint = p2p.Endpoint(transport=transport)
    tensors: dict[int, torch.Tensor] = {}
    spans: dict[int, tuple[int, int]] = {}  # id -> (address, bytes), kept after the tensor went
    conn.send(("ready", os.getpid(), endpoint.metadata()))
    while True:
        try:  # as long as the test holds the pipe: one owner may serve a whole module
            command, *args = conn.recv()
        except EOFError:
            return
        if command == "exit":
            endpoint.close()
            conn.send("bye")
            return
        if command == "env":
            os.environ[args[0]] = args[1]
            conn.send("ok")
        elif command == "create":  # (values on the CPU, device) -> (id, descriptor of it all)
            values, device = args
            tensor, tensor_id = p2p.create_tensor(values.shape, values.dtype, device)
            tensor.copy_(values)
            tensors[tensor_id] = tensor
            spans[tensor_id] = (tensor.data_ptr(), tensor.nbytes)
            conn.send((tensor_id, endpoint.advertise(tensor)))
            del tensor  # only `tensors` holds it: "drop" must be its last reference
        elif command == "advertise":  # (id, offset, nbytes) -> descriptor, or the error
            try:
                conn.send(endpoint.advertise(*args))
            except devipc.DevIpcError as error:
                conn.send(error)
        elif command == "resize":  # (id, nbytes): the storage gets new memory
            tensors[args[0]].untyped_storage().resize_(args[1])
            conn.send("ok")
        elif command == "get":
            conn.send(tensors[args[0]].cpu().clone())
        elif command == "registered":  # -> whether NIXL's agent has the memory registered
            conn.send(nixl_registered(endpoint._transport, *spans[args[0]]))
        elif command == "free":
            p2p.free_tensor(tensors[args[0]])
            conn.send("ok")
        elif command == "deregister":
            conn.send(p2p.deregister(args[0]))
        elif command == "drop":  # the garbage collector deregisters it
            del tensors[args[0]]
            gc.collect()
            conn.send("ok")
        elif command == "hear_late":  # (seconds): the transport hears of a registration's end
            hear = endpoint._transport.on_deregister  # late, as on a busy machine

            def late(reg, hear=hear, seconds=args[0]):
                time.sleep(seconds)
                hear(reg)

            endpoint._transport.on_deregister = late
            conn.send("ok")
        elif command == "stats":
            torch.accelerator.synchronize()
            devipc.ipc_collect()
            conn.send({**devipc.stats(), "live": p2p.registry.live(), "fds": open_fds()})


def peer(conn, metadata, whole, mine, index):
    """Connects, writes its index into its own range (`mine`), reads the whole tensor back."""
    import devipc_openreg  # noqa: F401

    endpoint = p2p.Endpoint()
    connection = endpoint.connect(metadata)
    nbytes = p2p._descriptor.Descriptor.from_bytes(mine).nbytes
    connection.write(torch.full((nbytes,), index, dtype=torch.uint8, device="openreg"), mine)
    conn.send("written")
    assert recv(conn) == "read"
    out = torch.empty(
        p2p._descriptor.Descriptor.from_bytes(whole).nbytes, dtype=torch.uint8, device="openreg"
    )
    connection.read(out, whole)
    conn.send(out.cpu().tolist())
    assert recv(conn) == "exit"
    endpoint.close()


def read_and_wait(conn, metadata, descriptor):
    """Opens the owner's tensor by reading it, then waits to be killed."""
    import devipc_openreg  # noqa: F401

    connection = p2p.Endpoint().connect(metadata)
    local = torch.empty(
        p2p._descriptor.Descriptor.from_bytes(descriptor).nbytes,
        dtype=torch.uint8,
        device="openreg",
    )
    connection.read(local, descriptor)
    conn.send(local.sum().item())
    recv(conn)  # never comes: the test kills this process


def _openreg_test_helpers():
    """The openreg tests' native helpers (`_native`: stream gates), importable here."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "openreg"))
    import _native

    return _native


def prepare_while_a_copy_is_pinned(conn, metadata, descriptor):
    """One thread's read of the owner's CPU registration is queued on a held stream (its pin
    taken) while the owner frees the registration and this thread prepares a transfer of it:
    reports the entry's pins after the prepare failed, then what the held read copied."""
    import threading

    from _support import TIMEOUT, wait_until

    import devipc_openreg  # noqa: F401

    held_stream = _openreg_test_helpers().held_stream
    connection = p2p.Endpoint().connect(metadata)
    nbytes = p2p._descriptor.Descriptor.from_bytes(descriptor).nbytes
    first, held = (torch.zeros(nbytes, dtype=torch.uint8, device="openreg") for _ in range(2))
    connection.read(first, descriptor)  # opened: the entry is cached
    (entry,) = connection._link._peer._entries.values()
    outcome: dict = {}

    def read_held():
        try:
            connection.read_async(held, descriptor).wait(TIMEOUT)
            outcome["read"] = "ok"
        except Exception as error:  # noqa: BLE001 - reported to the test
            outcome["read"] = repr(error)

    with held_stream(torch.accelerator.current_stream(), TIMEOUT):
        reader = threading.Thread(target=read_held)
        reader.start()
        wait_until(lambda: entry._pins == 1, "the held read pinned the entry")
        conn.send("pinned")
        assert recv(conn) == "freed"
        try:
            connection.prepare("read", [first], [descriptor])
            outcome["prepare"] = "prepared"
        except p2p.RemoteTensorFreedError:
            outcome["prepare"] = "RemoteTensorFreedError"
        outcome["pins_after_prepare"] = entry._pins
    reader.join(TIMEOUT)
    outcome["held_bytes"] = held.cpu().unique().tolist()
    outcome["pins_at_end"] = entry._pins
    connection.close()
    outcome["mapped_after_close"] = connection.mapped()
    conn.send(outcome)


def replacing_owner(peer_conn, slots, period, elements):
    """Keeps `slots` registrations of `elements` float32 (CPU and openreg in turn), each filled
    with its own id, and replaces one every `period` seconds (freed or dropped, then made anew)
    until the peer says "stop"; sends the peer (metadata, [(descriptor, value)]) first, then
    (slot, descriptor, value) for each new one, and the number replaced last."""
    import random

    import devipc_openreg  # noqa: F401

    endpoint = p2p.Endpoint()
    rng = random.Random(7)

    def made(slot):
        tensor, tensor_id = p2p.create_tensor(
            (elements,), torch.float32, "cpu" if slot % 2 else "openreg"
        )
        tensor.fill_(float(tensor_id))
        return tensor, (endpoint.advertise(tensor), float(tensor_id))

    tensors, table = zip(*(made(slot) for slot in range(slots)))
    tensors = list(tensors)
    peer_conn.send((endpoint.metadata(), list(table)))
    replaced = 0
    while not peer_conn.poll(period):  # pacing only: the peer never waits for it
        slot = rng.randrange(slots)
        if rng.random() < 0.5:
            p2p.free_tensor(tensors[slot])  # deregistered while the tensor still lives
        tensors[slot] = None  # the collector deregisters it (if still registered)
        tensors[slot], entry = made(slot)
        peer_conn.send((slot, *entry))
        replaced += 1
    peer_conn.recv()
    peer_conn.send(replaced)
    endpoint.close()


def threads_under_replacement(conn, owner_conn, threads, transfers):
    """`threads` threads transfer through one Connection (read, read_async, readv, a prepared
    post, write of the value it holds) while `replacing_owner` replaces registrations: each
    read must hold its registration's value, or raise RemoteTensorFreedError. Reports counts,
    the pins left on the connection's entries and its mappings after close."""
    import random
    import threading

    from _support import TIMEOUT

    import devipc_openreg  # noqa: F401

    assert owner_conn.poll(TIMEOUT), "the owner did not start"
    metadata, table = owner_conn.recv()
    nbytes = p2p._descriptor.Descriptor.from_bytes(table[0][0]).nbytes
    connection = p2p.Endpoint().connect(metadata)
    lock = threading.Lock()
    counts = {"ok": 0, "freed": 0, "wrong": [], "errors": []}
    stop_feeding = threading.Event()

    def feed():
        while not stop_feeding.is_set():
            if owner_conn.poll(0.01):
                slot, descriptor, value = owner_conn.recv()
                table[slot] = (descriptor, value)

    def check(tensors, value):
        for tensor in tensors:
            found = tensor.cpu().unique().tolist()
            if found != [value]:
                with lock:
                    counts["wrong"].append(f"holding {value} read {found[:5]}")

    def work(seed):
        rng = random.Random(seed)
        ok = freed = 0
        for _ in range(transfers):
            descriptor, value = table[rng.randrange(len(table))]
            device = rng.choice(("cpu", "openreg"))
            local, other = (torch.empty(nbytes // 4, device=device) for _ in range(2))
            op = rng.randrange(5)
            try:
                if op == 0:
                    connection.read(local, descriptor)
                elif op == 1:
                    connection.read_async(local, descriptor).wait(TIMEOUT)
                elif op == 2:
                    connection.readv([local, other], [descriptor, descriptor])
                    check([other], value)
                elif op == 3:
                    with connection.prepare("read", [local], [descriptor]) as prepared:
                        prepared.post().wait(TIMEOUT)
                else:
                    connection.write(local.fill_(value), descriptor)
                check([local], value)
                ok += 1
            except p2p.RemoteTensorFreedError:
                freed += 1
            except Exception as error:  # noqa: BLE001 - every other failure is reported
                with lock:
                    counts["errors"].append(repr(error))
        with lock:
            counts["ok"] += ok
            counts["freed"] += freed

    feeder = threading.Thread(target=feed)
    feeder.start()
    workers = [threading.Thread(target=work, args=(seed,)) for seed in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(TIMEOUT)
    counts["hung"] = sum(worker.is_alive() for worker in workers)
    stop_feeding.set()
    feeder.join(TIMEOUT)
    owner_conn.send("stop")
    while not isinstance(message := recv(owner_conn), int):  # descriptors still in the pipe
        pass
    counts["replaced"] = message
    counts["pins_left"] = sum(entry._pins for entry in connection._link._peer._entries.values())
    connection.close()
    counts["mapped_after_close"] = connection.mapped()
    conn.send(counts)
