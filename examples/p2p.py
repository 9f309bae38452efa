"""devipc.p2p in two processes: the owner registers a tensor and advertises it; the peer reads
and writes it one-sidedly (the owner's code does not run for that), then sees the owner free it.

    python examples/p2p.py            # openreg, the reference device
    python examples/p2p.py cpu        # CPU tensors in shared memory

Metadata and descriptors are plain bytes: here they go through a pipe, anywhere they could go
through a socket or a torch.distributed store.
"""

import sys

import torch
import torch.multiprocessing as mp

import devipc
import devipc.p2p as p2p
import devipc_openreg  # noqa: F401  (loads the reference device, wherever this runs)

TIMEOUT = 60


def owner(conn, device):
    tensor, tensor_id = p2p.create_tensor((2, 4), torch.float32, device)
    tensor.copy_(torch.arange(8.0).view(2, 4))
    endpoint = p2p.Endpoint()
    print(f"owner: registered tensor {tensor_id} on {tensor.device}:\n{tensor.cpu()}")
    conn.send(
        (
            endpoint.metadata(),
            endpoint.advertise(tensor),
            endpoint.advertise(tensor[0]),
            endpoint.advertise(tensor_id, offset=16, nbytes=16),
        )
    )  # row 1, by id and bytes
    assert conn.poll(TIMEOUT) and conn.recv() == "written"
    print(f"owner: the peer wrote row 0 while this process did nothing:\n{tensor.cpu()}")
    p2p.free_tensor(tensor)
    print(
        f"owner: freed tensor {tensor_id} (deregistered; the memory stays until the peer "
        f"lets go of its mapping)"
    )
    conn.send("freed")
    assert conn.poll(TIMEOUT) and conn.recv() == "done"
    endpoint.close()


def peer(conn, device):
    assert conn.poll(TIMEOUT)
    metadata, whole, row0, row1 = conn.recv()
    endpoint = p2p.Endpoint()
    connection = endpoint.connect(metadata)
    local = torch.empty(2, 4, device=device)
    connection.read(local, whole)
    print(f"peer: read the whole tensor: {local.cpu().tolist()}")
    row = torch.empty(4, device=device)
    connection.read(row, row1)
    print(f"peer: read row 1 alone: {row.cpu().tolist()}")
    transfer = connection.write_async(torch.full((4,), -1.0, device=device), row0)
    transfer.wait(TIMEOUT)
    print(
        f"peer: wrote row 0 (async, done: {transfer.done()}); mapped: "
        f"{connection.mapped()} registration(s)"
    )
    conn.send("written")
    assert conn.poll(TIMEOUT) and conn.recv() == "freed"
    try:
        connection.read(local, whole)
    except p2p.RemoteTensorFreedError as error:
        print(f"peer: reading again raised RemoteTensorFreedError: {error}")
    torch.accelerator.synchronize()
    devipc.ipc_collect()  # run the releases now instead of in the background
    print(
        f"peer: mapped now: {connection.mapped()} registration(s), devipc holds "
        f"{devipc.stats()['mapped']} mapping(s)"
    )
    conn.send("done")
    endpoint.close()


def main():
    device = sys.argv[1] if len(sys.argv) > 1 else "openreg"
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    procs = [
        ctx.Process(target=owner, args=(ours, device)),
        ctx.Process(target=peer, args=(theirs, device)),
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(TIMEOUT)
        if proc.is_alive():
            proc.kill()
            sys.exit(f"{proc.name} did not finish in time")
    sys.exit(max(proc.exitcode for proc in procs))


if __name__ == "__main__":
    main()
