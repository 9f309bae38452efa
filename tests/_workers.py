"""Module-level child-process bodies for the multi-process tests (spawn must import them)."""

import hashlib
import os
import pickle
import signal
import socket
import sys

import torch
from _support import TIMEOUT, until_the_test_ends, wait_until

import devipc


def settle():
    """Run the releases that waited for device work, so the producer sees them now."""
    torch.accelerator.synchronize()
    wait_until(
        lambda: not devipc.stats()["pending_releases"], "received storages released", collect=True
    )


# -- _memfd / _refcount ----------------------------------------------------------------------------
def write_shared_file(handle, magic, done):
    from devipc._core._memfd import open_shared_file

    buffer = open_shared_file(handle, magic)
    buffer.write(0, b"HELLO")
    buffer.close()
    done.put("ok")


def hold_lifeline(conn, handle, how):
    """Hold a lifeline in the shared file `handle` names, send its id, then end as `how` says."""
    from devipc._core._lifeline import hold
    from devipc._core._memfd import open_shared_file

    buffer = open_shared_file(handle, b"TEST")
    conn.send(hold(buffer.address))
    conn.recv()  # "end" (or the parent's end closed)
    if how == "exit":
        sys.exit(0)
    os.kill(os.getpid(), signal.SIGKILL)


def release_slot(handle, index, done):
    devipc.rfc.release_ipc_counter_device(handle, index)
    done.put("ok")


# -- sharing ---------------------------------------------------------------------------------------
def check_received(inbox, outbox):
    """Receives (tensor, expected CPU copy) pairs until None; reports what arrived."""
    while (item := inbox.get(timeout=TIMEOUT)) is not None:
        tensor, expected = item
        outbox.put(
            {
                "equal": bool(torch.equal(tensor.cpu(), expected)),
                "device": str(tensor.device),
                "dtype": tensor.dtype,
                "shape": tuple(tensor.shape),
                "stride": tensor.stride(),
                "offset": tensor.storage_offset(),
                "requires_grad": tensor.requires_grad,
                "type": type(tensor).__name__,
                "received": devipc.received_via_ipc(tensor),
            }
        )
        del tensor, item


def reopen_while_release_pends(first, second, outbox):
    """Opens `first`, drops it and opens `second` (the same allocation) before the pending
    release runs (the collector thread is kept out); reports how often the memory was mapped."""
    from devipc._core import _sharing
    from devipc._core._hooks import hooks_for

    _sharing._background.wake = lambda: None
    hooks = hooks_for(torch.device("openreg"))
    maps, open_handle = [], hooks.open_ipc_mem_handle
    hooks.open_ipc_mem_handle = lambda handle: maps.append(1) or open_handle(handle)
    tensor = devipc.open(first)
    values = tensor.cpu().tolist()
    del tensor
    pending = devipc.stats()["pending_releases"]
    tensor = devipc.open(second)
    report = (
        len(maps),
        pending,
        devipc.stats()["pending_releases"],
        devipc.stats()["mapped"],
        values == tensor.cpu().tolist(),
    )
    del tensor
    settle()
    outbox.put(report + (devipc.stats()["mapped"],))


def mutate_both_ways(inbox, outbox):
    tensor = inbox.get(timeout=TIMEOUT)
    tensor.add_(1)  # the parent must see this
    torch.accelerator.synchronize()
    outbox.put("added")
    assert inbox.get(timeout=TIMEOUT) == "filled"
    outbox.put(tensor.cpu().tolist())  # and we must see the parent's fill


def views_of_one_storage(inbox, outbox):
    whole, first, second = inbox.get(timeout=TIMEOUT)
    same = (
        whole.untyped_storage().data_ptr()
        == first.untyped_storage().data_ptr()
        == second.untyped_storage().data_ptr()
    )
    first.fill_(5)
    outbox.put({"same_storage": same, "whole": whole.cpu().tolist()})


def hold_until_told(inbox, outbox):
    """Receives tensors and keeps them until told to drop them."""
    held = []
    while (item := inbox.get(timeout=TIMEOUT)) != "drop":
        held.append(item)
        outbox.put(float(item.sum().item()))
    held.clear()
    settle()
    outbox.put("dropped")
    assert inbox.get(timeout=TIMEOUT) == "exit"


def read_from_socket(port, outbox):
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as conn:
        data = b""
        while chunk := conn.recv(1 << 16):
            data += chunk
    rebuild, args = pickle.loads(data)
    tensor = rebuild(*args)
    outbox.put(tensor.cpu().tolist())


# -- torch.multiprocessing integration -------------------------------------------------------------
class DeviceDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        return torch.full((4,), float(index), device="openreg")


def hogwild_train(model, data, target, steps, done):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(data), target).backward()
        optimizer.step()
    torch.accelerator.synchronize()
    done.put("trained")


def produce_and_exit(outbox):
    """A producer that is gone before its consumer reads."""
    outbox.put(torch.arange(4, dtype=torch.float32, device="openreg") * 10)
    outbox.close()
    outbox.join_thread()


def count_fds_around_a_receive(inbox, outbox):
    import os

    scratch = torch.ones(1, device="openreg")  # our own allocator's segment, opened up front
    before = len(os.listdir("/proc/self/fd"))
    tensor = inbox.get(timeout=TIMEOUT)
    value = float(tensor.sum().item())
    del tensor, scratch
    devipc.ipc_collect()  # runs a release that waited for device work, if any
    outbox.put(
        (value, len(os.listdir("/proc/self/fd")) - before, devipc.stats()["mapped_counter_files"])
    )


def read_new_tensors(inbox, outbox, count):
    """Reads the first element of `count` tensors, each dropped at once; replies with their sum
    and what it holds afterwards beyond what it held after the first: fds, mappings of other
    processes' memfds, devipc's mapped allocations."""
    from _support import foreign_memfd_maps

    first = inbox.get(timeout=TIMEOUT)  # the producer's counter file, mapped once and kept
    total = first[0].item()
    del first
    devipc.ipc_collect()
    fds, maps = len(os.listdir("/proc/self/fd")), foreign_memfd_maps()
    for _ in range(count - 1):
        tensor = inbox.get(timeout=TIMEOUT)
        total += tensor[0].item()
        del tensor
    wait_until(
        lambda: devipc.stats()["mapped"] == 0, "every received allocation let go", collect=True
    )
    outbox.put(
        (
            total,
            len(os.listdir("/proc/self/fd")) - fds,
            sorted(foreign_memfd_maps() - maps),
            devipc.stats()["mapped"],
        )
    )


def reduce_and_exit(outbox):
    """Sends a handle as plain bytes, then exits before anyone opens it."""
    import torch.multiprocessing.reductions as reductions

    tensor = torch.ones(4, device="openreg")
    outbox.put(pickle.dumps(reductions.reduce_tensor(tensor)))
    outbox.close()
    outbox.join_thread()


def produce_and_wait(outbox):
    """A producer that stays until it is killed."""
    tensor = torch.arange(4, dtype=torch.float32, device="openreg") * 10
    outbox.put(tensor)
    until_the_test_ends()


# -- lifetime: slots, kills, forwarding --------------------------------------------------------
def hold_slot_until_told(handle, index, inbox, outbox):
    from devipc._core._refcount import ConsumerCounters

    counters = ConsumerCounters()
    counters.hold(handle, index, lambda: None)
    outbox.put("held")
    assert inbox.get(timeout=TIMEOUT) == "release"
    counters.release(handle, index)
    outbox.put("released")


def forward_to(inbox, onward, outbox):
    """B of A -> B -> C: sends on what it received, then holds it until told to exit."""
    tensor = inbox.get(timeout=TIMEOUT)
    onward.put(tensor)
    outbox.put("forwarded")
    assert inbox.get(timeout=TIMEOUT) == "exit"


def write_and_hold(inbox, outbox, value):
    """Receives a tensor, writes `value` into it, holds it until told to drop it."""
    tensor = inbox.get(timeout=TIMEOUT)
    tensor.fill_(value)
    torch.accelerator.synchronize()
    outbox.put(("written", devipc.received_via_ipc(tensor)))
    assert inbox.get(timeout=TIMEOUT) == "drop"
    del tensor
    settle()
    outbox.put("dropped")
    assert inbox.get(timeout=TIMEOUT) == "exit"


def hold_then_write(inbox, outbox):
    """Receives a tensor, reports its sum, writes 99 into it when told, then holds it."""
    tensor = inbox.get(timeout=TIMEOUT)
    outbox.put(float(tensor.sum().item()))
    assert inbox.get(timeout=TIMEOUT) == "write"
    tensor.fill_(99)
    torch.accelerator.synchronize()
    outbox.put("written")
    assert inbox.get(timeout=TIMEOUT) == "exit"


def read_some_then_wait(inbox, outbox, count):
    """Receives `count` tensors and holds them; the test kills it while it waits."""
    held = [inbox.get(timeout=TIMEOUT) for _ in range(count)]
    outbox.put(len(held))
    until_the_test_ends()  # killed while it waits


def rebuild_pickled(payload, inbox, outbox):
    """Rebuilds a pickled reduce_tensor result; holds the tensor until told to drop it."""
    try:
        rebuild, args = pickle.loads(payload)
        tensor = rebuild(*args)
    except devipc.InvalidHandleError as error:
        outbox.put(("refused", str(error)))
        return
    outbox.put(("opened", float(tensor.sum().item())))
    if inbox.get(timeout=TIMEOUT) == "write":
        tensor.fill_(99)
        torch.accelerator.synchronize()
        outbox.put("written")
        inbox.get(timeout=TIMEOUT)
    del tensor
    settle()
    outbox.put("dropped")


# -- typed handles and buckets ---------------------------------------------------------------------
def open_and_write(inbox, outbox, device):
    """Opens a handle's bytes (on `device`, None: its own), reports, adds 1, reports again when
    the producer filled it, then drops it when told to exit."""
    tensor = devipc.open(inbox.get(timeout=TIMEOUT), device=device)
    outbox.put((str(tensor.device), tensor.cpu().tolist()))
    tensor.add_(1)
    torch.accelerator.synchronize()
    outbox.put("added")
    assert inbox.get(timeout=TIMEOUT) == "filled"
    outbox.put(tensor.cpu().tolist())
    assert inbox.get(timeout=TIMEOUT) == "exit"
    del tensor
    settle()


def try_open(data, outbox):
    """Opens a handle's bytes once; reports its values or the refusal."""
    try:
        tensor = devipc.open(data)
    except devipc.InvalidHandleError as error:
        outbox.put(("refused", str(error)))
        return
    outbox.put(("opened", tensor.cpu().tolist()))
    del tensor
    settle()


def rebuild_on(payload, index, outbox):
    """Rebuilds a pickled reduce_tensor result, with args[6] replaced by `index` unless None
    (what frameworks do with CUDA tensors); reports the device and the values."""
    rebuild, args = pickle.loads(payload)
    args = list(args)
    if index is not None:
        args[6] = index
    try:
        tensor = rebuild(*args)
    except devipc.DevIpcError as error:
        outbox.put(("refused", type(error).__name__, str(error)))
        return
    outbox.put(("opened", str(tensor.device), tensor.cpu().tolist()))
    del tensor
    settle()


def _bucket_report(tensors):
    return {
        name: (t.dtype, tuple(t.shape), str(t.device), t.cpu().tolist())
        for name, t in tensors.items()
    }


def open_bucket_and_write(inbox, outbox):
    """Opens a pickled bucket Handle, reports it, writes into "w", reports again once the
    producer wrote, then drops it when told to exit."""
    tensors = devipc.open_tensors(inbox.get(timeout=TIMEOUT))
    same_mapping = len({t.untyped_storage().data_ptr() for t in tensors.values()}) == 1
    outbox.put((_bucket_report(tensors), same_mapping))
    tensors["w"].fill_(5)
    torch.accelerator.synchronize()
    outbox.put("written")
    assert inbox.get(timeout=TIMEOUT) == "filled"
    outbox.put(_bucket_report(tensors))
    assert inbox.get(timeout=TIMEOUT) == "exit"
    del tensors
    settle()


# -- faults: processes that the test kills -----------------------------------------------------
def send_raw_then_wait(conn, count):
    """Producer: sends `count` sends of one tensor as pickled bytes (opened when the receiver
    decides), then keeps the tensor alive until it is killed."""
    from multiprocessing.reduction import ForkingPickler

    tensor = torch.arange(1 << 14, dtype=torch.float32, device="openreg")
    for _ in range(count):
        conn.send(bytes(ForkingPickler.dumps(tensor)))
    until_the_test_ends()


def hold_then_wait(conn):
    """Consumer: opens what it is sent (a tensor, or pickled bytes), reports its sum, holds it
    until it is killed."""
    item = conn.recv()
    tensor = pickle.loads(item) if isinstance(item, bytes) else item
    conn.send(float(tensor.sum().item()))
    until_the_test_ends()


def idle_until_killed(*_):
    """A consumer that never reads what it is sent."""
    until_the_test_ends()


def devipc_process(conn):
    """A process with devipc imported (its stats page made, torch's default CPU threads): says
    its pid and thread count, then waits."""
    conn.send((os.getpid(), torch.get_num_threads()))
    until_the_test_ends()


def forward_and_hold(inbox, onward, outbox):
    """B of A -> B -> C: sends on what it received, flushed to the pipe, then holds it."""
    tensor = inbox.get(timeout=TIMEOUT)
    onward.put(tensor)
    onward.close()
    onward.join_thread()  # the forwarded send exists once this returns
    outbox.put("forwarded")
    until_the_test_ends()


def hold_from_queue(inbox, outbox, gate=None):
    """Consumer: opens the tensor it reads from `inbox` (once `gate` says so), reports its sum,
    holds it until killed."""
    if gate is not None:
        gate.get(timeout=TIMEOUT)
    tensor = inbox.get(timeout=TIMEOUT)
    outbox.put(float(tensor.sum().item()))
    until_the_test_ends()


# -- arena -----------------------------------------------------------------------------------------
def exit_now(*_received):
    """Receives its arguments (an arena attachment) and ends without using them."""


def arena_consumer(attachment, inbox, outbox, acknowledge):
    """Opens an arena; for each chunk's bytes, reports (generation, values by name) and, if told
    to, acknowledges it; None: close and exit."""
    reader = devipc.open_arena(attachment)
    outbox.put(("attached", reader.device.type))
    while (data := inbox.get(timeout=TIMEOUT)) is not None:
        chunk = reader.read(data)
        values = {name: t.cpu().tolist() for name, t in chunk.tensors.items()}
        if acknowledge:
            reader.ack(chunk)
        outbox.put((chunk.generation, values))
        del chunk
    reader.close()
    settle()


# -- weight publisher ------------------------------------------------------------------------------
class TinyGPT(torch.nn.Module):
    """Tied embedding and head, a persistent buffer (a causal mask), a non-persistent one."""

    def __init__(self, device="openreg"):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8, device=device)
        self.block = torch.nn.Linear(8, 8, device=device)
        self.head = torch.nn.Linear(8, 16, bias=False, device=device)
        self.head.weight = self.embed.weight
        self.register_buffer("mask", torch.tril(torch.ones(4, 4, device=device)))
        self.register_buffer("scratch", torch.zeros(2, device=device), persistent=False)

    def forward(self, tokens):
        hidden = self.block(self.embed(tokens))
        return self.head(hidden * self.mask[: tokens.shape[-1], : tokens.shape[-1]].sum())


def train_step(model, value):
    """What a training step does to the weights: writes every one of them in place."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(value)
        model.mask.add_(1)


def snapshot(model):
    return {name: t.detach().cpu().tolist() for name, t in model.state_dict().items()}


def weight_subscriber(
    conn, token, generations, into, device=None, engine_device="openreg", verify=False
):
    """Subscribes (reading on `device`), then for each generation: waits, checks its checksum
    (`verify`), reports what it sees (its own model's state on `engine_device` after
    copy_into, or the zero-copy views) and acknowledges."""
    subscriber = devipc.WeightSubscriber(token, device)
    engine = TinyGPT(engine_device) if into else None
    conn.send(("subscribed", str(subscriber.device)))
    for _ in range(generations):
        generation = subscriber.wait(timeout=TIMEOUT)
        if verify:
            subscriber.verify()  # ChecksumError ends this child: the test sees it
        if engine is not None:
            subscriber.copy_into(engine)
            seen = engine.state_dict()
        else:
            seen = subscriber.tensors()
        # plain lists: a CPU tensor on a pipe would be shared memory that dies with us
        conn.send((generation, {name: t.cpu().tolist() for name, t in seen.items()}))
        subscriber.ack()
    subscriber.close()
    conn.send("closed")


def digest(tensors) -> str:
    """What a generation's bytes come to, name by name: one line through a pipe."""
    found = hashlib.sha256()
    for name, tensor in sorted(tensors.items()):
        found.update(name.encode() + tensor.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return found.hexdigest()


def weight_subscribers(conn, tokens, generations, stall=None, options=None):
    """Subscribes once per token, with `options` (a dict: several engines in one process, as a fleet
    larger than its processes), then for each generation each engine in turn waits, reports the
    digest of what it holds, and acknowledges. `stall`: the relay's RELAY_STALL and RELAY_LAG
    here (a busy machine's engines are slow, not stalled)."""
    if stall is not None:
        from devipc._weights import _relay

        _relay.RELAY_STALL = _relay.RELAY_LAG = stall
    subscribers = [devipc.WeightSubscriber(token, **(options or {})) for token in tokens]
    conn.send("subscribed")
    for _ in range(generations):
        seen = []
        for subscriber in subscribers:
            seen.append((subscriber.wait(timeout=TIMEOUT), digest(subscriber.tensors())))
            subscriber.ack()
        conn.send(seen)
    for subscriber in subscribers:
        subscriber.close()
    conn.send("closed")


def weight_subscriber_that_hangs(conn, token):
    """Subscribes and waits for one generation without acknowledging it, until killed."""
    subscriber = devipc.WeightSubscriber(token)
    conn.send("subscribed")
    conn.send(("got", subscriber.wait(timeout=TIMEOUT)))
    until_the_test_ends()


def weight_publisher_child(conn):
    """Publishes one generation of a packed TinyGPT to the token it sends, then lives until
    killed."""
    model = TinyGPT()
    devipc.pack_module(model)
    publisher = devipc.WeightPublisher(model)
    conn.send(publisher.token())
    assert conn.recv() == "publish"
    conn.send(publisher.publish(wait=False))
    until_the_test_ends()


def with_short_bounds(worker, *args):
    """Runs `worker(*args)` with its module's bound cut to 0.2 s: a slow test, seen from here."""
    sys.modules[worker.__module__].TIMEOUT = 0.2
    worker(*args)


def make_shm_file_and_exit(conn):
    """Leaves /dev/shm/torch_<its pid>_... behind, as a leak would, and exits."""
    name = f"torch_{os.getpid()}_0_left"
    open(f"/dev/shm/{name}", "x").close()
    conn.send(name)
