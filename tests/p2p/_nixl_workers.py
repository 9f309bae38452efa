"""Child-process bodies of the NIXL tests (spawn imports them): an owner whose endpoint goes
through NIXL, answering control messages; it never takes part in a transfer."""
import gc
import os

import torch
from _support import TIMEOUT, recv

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


def nixl_owner(conn):
    """Registers and advertises on request over an Endpoint(transport="nixl")."""
    import devipc_openreg  # noqa: F401 - the device, also where autoload is off

    endpoint = p2p.Endpoint(transport="nixl")
    tensors: dict[int, torch.Tensor] = {}
    spans: dict[int, tuple[int, int]] = {}  # id -> (address, bytes), kept after the tensor went
    conn.send(("ready", os.getpid(), endpoint.metadata()))
    while True:
        command, *args = recv(conn, TIMEOUT)
        if command == "exit":
            endpoint.close()
            conn.send("bye")
            return
        if command == "create":  # (values on the CPU, device) -> (id, descriptor of it all)
            values, device = args
            tensor, tensor_id = p2p.create_tensor(values.shape, values.dtype, device)
            tensor.copy_(values)
            tensors[tensor_id] = tensor
            spans[tensor_id] = (tensor.data_ptr(), tensor.nbytes)
            conn.send((tensor_id, endpoint.advertise(tensor)))
            del tensor  # only `tensors` holds it: "drop" lets the garbage collector end it
        elif command == "advertise":  # (id, offset, nbytes) -> descriptor
            conn.send(endpoint.advertise(*args))
        elif command == "get":
            conn.send(tensors[args[0]].cpu().clone())
        elif command == "registered":  # -> whether NIXL's agent has the memory registered
            conn.send(nixl_registered(endpoint._transport, *spans[args[0]]))
        elif command == "deregister":
            conn.send(p2p.deregister(args[0]))
        elif command == "drop":  # the garbage collector deregisters it
            del tensors[args[0]]
            gc.collect()
            conn.send("ok")
