"""The producer's side of a send's lifetime: the memory that was sent is held — not the storage
object — until every consumer released it, died, or the send was revoked; in both IPC modes."""

import os
import pickle
import signal

import _workers
import pytest
import torch
import torch.multiprocessing.reductions as torch_reductions
from _support import TIMEOUT, wait_until

import devipc

pytestmark = pytest.mark.usefixtures("ipc_mode")


def _baseline():
    torch.accelerator.synchronize()
    wait_until(lambda: devipc.stats()["sent"] == 0, "earlier sends ended", collect=True)
    return torch.accelerator.memory_allocated()


def _back_to(baseline, what):
    return wait_until(lambda: torch.accelerator.memory_allocated() <= baseline, what, collect=True)


def test_resizing_after_a_send_gives_new_memory_and_the_sent_memory_stays(children):
    """CUDA's semantics, and FSDP's pattern: send, resize_(0), regrow, write. The sent block
    stays for the consumer; the producer's tensor gets new memory; nothing aliases."""
    baseline = _baseline()
    inbox, outbox = children.ctx.Queue(), children.ctx.Queue()
    children.start(_workers.hold_then_write, inbox, outbox)
    t1 = torch.ones(1024, device="openreg")
    sent_ptr = t1.data_ptr()
    inbox.put(t1)
    assert outbox.get(timeout=TIMEOUT) == 1024.0
    storage = t1.untyped_storage()
    assert storage.resizable()
    storage.resize_(0)  # FSDP frees an unsharded parameter so
    assert t1.untyped_storage().nbytes() == 0
    storage.resize_(4096)  # ...and regrows it
    t1.fill_(2.0)
    assert t1.data_ptr() != sent_ptr, "the regrown storage reuses the sent block"
    t1.resize_(2048)  # a tensor's resize_ grows its storage the same way
    t1[1024:] = 3.0
    t2 = torch.zeros(1024, device="openreg")
    assert sent_ptr not in (t1.data_ptr(), t2.data_ptr()), "the sent block was reused"
    inbox.put("write")
    assert outbox.get(timeout=TIMEOUT) == "written"
    assert t2.sum().item() == 0, "the consumer's write landed in the producer's next tensor"
    assert t1[:1024].sum().item() == 2048 and t1[1024:].sum().item() == 3072
    inbox.put("exit")
    children.join_ok()
    del t1, t2, storage
    _back_to(baseline, "memory back after the consumer exited")


def test_a_killed_consumer_holding_100_tensors_gives_the_memory_back(children):
    baseline = _baseline()
    inbox, outbox = children.ctx.Queue(), children.ctx.Queue()
    child = children.start(_workers.read_some_then_wait, inbox, outbox, 100)
    for _ in range(100):
        inbox.put(torch.ones(1024, device="openreg"))  # 4 KiB each, the producer keeps none
    assert outbox.get(timeout=TIMEOUT) == 100
    assert torch.accelerator.memory_allocated() >= baseline + 100 * 4096
    os.kill(child.pid, signal.SIGKILL)
    child.join(TIMEOUT)
    # No ipc_collect needed: the collector thread notices the dead holder by itself.
    wait_until(
        lambda: torch.accelerator.memory_allocated() <= baseline,
        "memory of a SIGKILLed consumer back by the collector thread",
    )


def test_unopened_sends_are_revoked_after_the_deadline(children):
    baseline = _baseline()
    inbox, outbox = children.ctx.Queue(), children.ctx.Queue()
    child = children.start(_workers.read_some_then_wait, inbox, outbox, 50)
    for _ in range(100):
        inbox.put(torch.ones(1024, device="openreg"))
    assert outbox.get(timeout=TIMEOUT) == 50
    os.kill(child.pid, signal.SIGKILL)
    child.join(TIMEOUT)
    # The 50 read are reclaimed with their dead reader; the 50 never read wait for a deadline.
    wait_until(lambda: devipc.stats()["sent"] == 50, "the 50 opened sends reclaimed", collect=True)
    assert torch.accelerator.memory_allocated() >= baseline + 50 * 4096
    devipc.set_unopened_deadline(0.1)
    try:
        _back_to(baseline, "unopened sends revoked after their deadline")
    finally:
        devipc.set_unopened_deadline(None)


def test_revoked_sends_cannot_be_opened_later():
    baseline = _baseline()
    tensor = torch.ones(1024, device="openreg")
    rebuild, args = torch_reductions.reduce_tensor(tensor)
    assert devipc.revoke(tensor) == 1
    assert devipc.revoke(tensor) == 0
    with pytest.raises(devipc.InvalidHandleError, match="revoked"):
        rebuild(*args)
    del tensor
    _back_to(baseline, "a revoked send's memory freed with its storage")


def test_one_pickled_handle_opens_in_one_process_only(children):
    baseline = _baseline()
    tensor = torch.ones(1024, device="openreg")
    payload = pickle.dumps(torch_reductions.reduce_tensor(tensor))
    first_in, first_out = children.ctx.Queue(), children.ctx.Queue()
    second_in, second_out = children.ctx.Queue(), children.ctx.Queue()
    children.start(_workers.rebuild_pickled, payload, first_in, first_out)
    assert first_out.get(timeout=TIMEOUT) == ("opened", 1024.0)
    children.start(_workers.rebuild_pickled, payload, second_in, second_out)
    kind, message = second_out.get(timeout=TIMEOUT)
    assert kind == "refused" and "already opened" in message
    first_in.put("write")
    assert first_out.get(timeout=TIMEOUT) == "written"
    assert tensor.sum().item() == 99 * 1024
    first_in.put("done")
    assert first_out.get(timeout=TIMEOUT) == "dropped"
    children.join_ok()
    del tensor
    _back_to(baseline, "memory back after the one holder released")


def test_one_pickled_handle_rebuilt_twice_in_one_process_is_one_storage():
    baseline = _baseline()
    tensor = torch.ones(16, device="openreg")
    rebuild, args = torch_reductions.reduce_tensor(tensor)
    first, second = rebuild(*args), rebuild(*args)
    assert first.data_ptr() == second.data_ptr()
    del first
    devipc.ipc_collect()
    second.fill_(2)  # still held: the send is not released by the first rebuild's death
    assert tensor.sum().item() == 32
    del second, tensor
    _back_to(baseline, "memory back once both rebuilds are gone")


def test_a_send_forwarded_between_two_sends_of_the_producer_is_tracked():
    """The producer's next send must not hide a slot that a forwarder took just before it."""
    from devipc._core._refcount import ConsumerCounters

    baseline = _baseline()
    tensor = torch.ones(1024, device="openreg")
    first = devipc.rfc.share_device(tensor.untyped_storage())
    forwarder, receiver = ConsumerCounters(), ConsumerCounters()  # opens of their own
    forwarder.hold(first[4], first[5], lambda: None)
    forwarded = forwarder.forward(first[4], first[5])
    second = devipc.rfc.share_device(tensor.untyped_storage())
    receiver.hold(first[4], forwarded, lambda: None)
    forwarder.release(first[4], first[5])
    devipc.rfc.release_ipc_counter_device(second[4], second[5])
    del tensor
    devipc.ipc_collect()
    assert torch.accelerator.memory_allocated() >= baseline + 4096, "freed while still held"
    receiver.release(first[4], forwarded)
    _back_to(baseline, "memory back once the receiver of the forwarded send let go")
