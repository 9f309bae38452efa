"""devipc in one minute: an openreg tensor crosses processes without a copy.

Run with `make demo`. Nothing here is openreg-specific except the device name: a vendor's device
with IPC hooks works the same way.
"""

import torch
import torch.multiprocessing as mp

import devipc
import devipc_openreg  # noqa: F401  (loads the reference device, wherever this runs)

TIMEOUT = 60


def consumer(name, inbox, outbox):
    tensor = inbox.get(timeout=TIMEOUT)
    again = inbox.get(timeout=TIMEOUT)  # the same tensor, sent a second time
    outbox.put((name, tensor.data_ptr() == again.data_ptr(), devipc.received_via_ipc(tensor)))
    tensor[int(name[-1])] = 100 + int(name[-1])  # write into the producer's memory
    torch.accelerator.synchronize()
    outbox.put("written")
    assert inbox.get(timeout=TIMEOUT) == "look"
    outbox.put((name, tensor.cpu().tolist()))
    del tensor, again
    outbox.put("released")


def main():
    print("== the device ==")
    print(
        "accelerator:",
        torch.accelerator.current_accelerator(),
        "devices:",
        torch.accelerator.device_count(),
    )
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]], device="openreg")
    print("x + 2 on", (x + 2).device, "->", (x + 2).cpu().tolist())

    print("\n== zero-copy sharing with two consumer processes ==")
    ctx = mp.get_context("spawn")
    baseline = torch.accelerator.memory_allocated()
    shared = torch.zeros(4, device="openreg")
    queues = [(ctx.Queue(), ctx.Queue()) for _ in range(2)]
    procs = [
        ctx.Process(target=consumer, args=(f"consumer{i}", *q), daemon=True)
        for i, q in enumerate(queues)
    ]
    try:
        for proc in procs:
            proc.start()
        for inbox, _ in queues:
            inbox.put(shared)
            inbox.put(shared)
        for _, outbox in queues:
            name, cache_hit, received = outbox.get(timeout=TIMEOUT)
            print(
                f"{name}: second send reused the first mapping: {cache_hit}; "
                f"received via IPC: {received}"
            )
        for _, outbox in queues:
            assert outbox.get(timeout=TIMEOUT) == "written"
        print("producer sees the consumers' writes:", shared.cpu().tolist())
        shared[3] = 42.0
        torch.accelerator.synchronize()
        for inbox, outbox in queues:
            inbox.put("look")
            name, seen = outbox.get(timeout=TIMEOUT)
            print(f"{name} sees the producer's write: {seen}")
        for _, outbox in queues:
            assert outbox.get(timeout=TIMEOUT) == "released"
        for proc in procs:
            proc.join(TIMEOUT)
            assert proc.exitcode == 0, f"{proc.name} exited with {proc.exitcode}"
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()

    print("\n== memory comes back ==")
    print(
        f"allocated while shared: {torch.accelerator.memory_allocated() - baseline} bytes "
        f"above baseline"
    )
    del shared
    freed = devipc.ipc_collect()
    print(
        f"after the consumers released and the producer dropped it: "
        f"{torch.accelerator.memory_allocated() - baseline} bytes above baseline "
        f"({freed} sent storages freed)"
    )


if __name__ == "__main__":
    main()
