"""Module-level child-process bodies for the multi-process tests (spawn must import them)."""
import pickle
import socket

import torch
from _support import TIMEOUT

import devipc


# -- _memfd / _refcount ----------------------------------------------------------------------------
def write_shared_file(handle, magic, done):
    from devipc._memfd import open_shared_file

    buffer = open_shared_file(handle, magic)
    buffer.write(0, b"HELLO")
    buffer.close()
    done.put("ok")


def release_slot(handle, index, done):
    devipc.release_ipc_counter_device(handle, index)
    done.put("ok")


# -- sharing ---------------------------------------------------------------------------------------
def check_received(inbox, outbox):
    """Receives (tensor, expected CPU copy) pairs until None; reports what arrived."""
    while (item := inbox.get(timeout=TIMEOUT)) is not None:
        tensor, expected = item
        outbox.put({
            "equal": bool(torch.equal(tensor.cpu(), expected)),
            "device": str(tensor.device), "dtype": tensor.dtype, "shape": tuple(tensor.shape),
            "stride": tensor.stride(), "offset": tensor.storage_offset(),
            "requires_grad": tensor.requires_grad, "type": type(tensor).__name__,
            "received": devipc.received_via_ipc(tensor),
        })
        del tensor, item


def mutate_both_ways(inbox, outbox):
    tensor = inbox.get(timeout=TIMEOUT)
    tensor.add_(1)                       # the parent must see this
    torch.accelerator.synchronize()
    outbox.put("added")
    assert inbox.get(timeout=TIMEOUT) == "filled"
    outbox.put(tensor.cpu().tolist())    # and we must see the parent's fill


def views_of_one_storage(inbox, outbox):
    whole, first, second = inbox.get(timeout=TIMEOUT)
    same = whole.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() \
        == second.untyped_storage().data_ptr()
    first.fill_(5)
    outbox.put({"same_storage": same, "whole": whole.cpu().tolist()})


def hold_until_told(inbox, outbox):
    """Receives tensors and keeps them until told to drop them."""
    held = []
    while (item := inbox.get(timeout=TIMEOUT)) != "drop":
        held.append(item)
        outbox.put(float(item.sum().item()))
    held.clear()
    outbox.put("dropped")
    assert inbox.get(timeout=TIMEOUT) == "exit"


def try_to_reshare(inbox, outbox):
    from multiprocessing.reduction import ForkingPickler

    tensor = inbox.get(timeout=TIMEOUT)
    try:
        ForkingPickler.dumps(tensor)
        outbox.put("no error")
    except devipc.ReshareError as error:
        clone_ok = ForkingPickler.dumps(tensor.clone()) is not None
        outbox.put(("ReshareError", str(error), clone_ok))


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
    outbox.put((value, len(os.listdir("/proc/self/fd")) - before))


def reduce_and_exit(outbox):
    """Sends a handle as plain bytes, then exits before anyone opens it."""
    import torch.multiprocessing.reductions as reductions

    tensor = torch.ones(4, device="openreg")
    outbox.put(pickle.dumps(reductions.reduce_tensor(tensor)))
    outbox.close()
    outbox.join_thread()


def produce_and_wait(outbox, inbox):
    """A producer that stays until it is killed."""
    tensor = torch.arange(4, dtype=torch.float32, device="openreg") * 10
    outbox.put(tensor)
    inbox.get(timeout=TIMEOUT)
