"""Child-process bodies of the p2p tests (spawn imports them): an owner that registers tensors and
answers control messages (never transfers: those are one-sided), and peers that read and write."""
import gc
import os

import torch
from _support import TIMEOUT, open_fds, recv

import devipc
import devipc.p2p as p2p


def nixl_registered(transport, addr: int, nbytes: int) -> bool:
    """Whether NIXL's agent itself has [addr, addr + nbytes) registered: preparing a local
    descriptor list succeeds only for memory some backend registered."""
    agent = transport._agent
    try:
        agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(addr, nbytes, 0)], "DRAM").release()
    except Exception as error:  # NIXL's own exception type
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
        command, *args = recv(conn, TIMEOUT)
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
    out = torch.empty(p2p._descriptor.Descriptor.from_bytes(whole).nbytes, dtype=torch.uint8,
                      device="openreg")
    connection.read(out, whole)
    conn.send(out.cpu().tolist())
    assert recv(conn) == "exit"
    endpoint.close()


def read_and_wait(conn, metadata, descriptor):
    """Opens the owner's tensor by reading it, then waits to be killed."""
    import devipc_openreg  # noqa: F401

    connection = p2p.Endpoint().connect(metadata)
    local = torch.empty(p2p._descriptor.Descriptor.from_bytes(descriptor).nbytes,
                        dtype=torch.uint8, device="openreg")
    connection.read(local, descriptor)
    conn.send(local.sum().item())
    recv(conn)  # never comes: the test kills this process
