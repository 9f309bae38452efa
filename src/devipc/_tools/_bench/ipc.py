"""Per-tensor round trip through a torch.multiprocessing Queue: the producer puts a tensor, the
consumer reads one element of it and replies. Four ways, measured in one run, beside the floor
(a small message that is not a tensor, through the same queues):

  devipc      a tensor of a device with IPC hooks, shared zero-copy by devipc, the same tensor
              sent again and again (what is cached after its first send is reused)
  devipc-new  a new tensor of that device made before every send (`torch.empty`, its last
              element set), as a DataLoader worker or a pipeline stage sends: the allocation
              and everything a first send of a storage costs are in the round trip
  cpu-shm     torch's own CPU tensor already in shared memory (fd passing)
  via-cpu     copy through the host: .cpu(), the queue, .to(device) in the consumer

`reduction_floor` is the floor of any message in the reduction's shape: devipc's pickled
reduction of a tensor (the 15 arguments of torch's rebuild, as frameworks expect them), rebuilt by
a function that opens nothing, against the small message.

`dataloader` compares a DataLoader whose spawned workers make each batch on the device with the
same loader whose workers make a small Python object per batch.

`phases` splits devipc's part of a round trip: the producer's pickling (reduce_tensor: a slot,
the handle), the consumer's unpickling (the open: slot held, memory mapped, storage made, and the
release of the tensor received before, which a drop leaves pending until then), its read of one
element, and the drop.
"""

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing as mp

from .._common import hook_modules, load_modules
from .common import Panel, Progress, human, markdown

__all__ = [
    "METHODS",
    "SIZES",
    "dataloader",
    "measure",
    "panel",
    "phase_table",
    "phases",
    "reduction_floor",
    "table",
]

TIMEOUT = 120
WARM_UP = 10  # untimed round trips per mode and size
SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20]
METHODS = ("devipc", "devipc-new", "cpu-shm", "via-cpu")


def consumer(inbox: Any, outbox: Any, device: str, modules: list[str]) -> None:
    load_modules(modules)
    while (item := inbox.get(timeout=TIMEOUT)) is not None:
        mode, tensor = item
        if mode == "flush":
            outbox.put(None)
            continue
        if mode == "message":  # the floor: a small object that is not a tensor
            outbox.put(tensor)
            continue
        if mode == "via-cpu":
            tensor = tensor.to(device)
        value = int(tensor[-1].item())
        del tensor, item  # releasing what was received is part of the round trip
        outbox.put(value)


def iterations(nbytes: int, quick: bool) -> int:
    n = 200 if nbytes <= (1 << 20) else 40
    return max(3, n // 4) if quick else n


def _round_trip(inbox: Any, outbox: Any, mode: str, make: Callable[[], Any]) -> float:
    start = time.perf_counter()
    inbox.put((mode, make()))
    value = outbox.get(timeout=TIMEOUT)
    elapsed = time.perf_counter() - start
    assert value == 7, f"{mode}: consumer read {value}"
    # The queue's feeder thread holds the last item it sent until it sends the next one: flush it
    # with a small untimed message, so that freeing this item is not charged to the next mode.
    inbox.put(("flush", None))
    outbox.get(timeout=TIMEOUT)
    return elapsed


def _median_us(inbox: Any, outbox: Any, mode: str, make: Callable[[], Any], count: int) -> float:
    """Median microseconds of one mode. Modes run one after the other, not interleaved: a
    256 MiB copy of via-cpu leaves the caches cold and would slow whatever comes right after."""
    times = [_round_trip(inbox, outbox, mode, make) for _ in range(count + WARM_UP)]
    return statistics.median(times[WARM_UP:]) * 1e6


def _returns(value: Any) -> Callable[[], Any]:
    return lambda: value


def _new(n: int, device: str) -> Callable[[], torch.Tensor]:
    """A new int32 tensor of `n` elements per call, its last one 7 (what the consumer reads)."""

    def make() -> torch.Tensor:
        tensor = torch.empty(n, dtype=torch.int32, device=device)
        tensor[-1] = 7
        return tensor

    return make


def _paired_medians_us(
    inbox: Any, outbox: Any, mode: str, make: Callable[[], Any], count: int
) -> tuple[float, float]:
    """Median microseconds of `mode` and of the small message, their round trips alternating:
    this machine's speed drifts by 2x over seconds, and a ratio of two blocks measured one after
    the other would carry that drift."""
    times: list[tuple[float, float]] = []
    for _ in range(count + WARM_UP):
        times.append(
            (
                _round_trip(inbox, outbox, mode, make),
                _round_trip(inbox, outbox, "message", lambda: 7),
            )
        )
    mode_times, message_times = zip(*times[WARM_UP:])
    return statistics.median(mode_times) * 1e6, statistics.median(message_times) * 1e6


def _seven(*_args: Any) -> int:
    """What a `_ReductionShaped` message unpickles to: nothing is opened."""
    return 7


class _ReductionShaped:
    """A message pickled as devipc's reduction of a tensor is (the rebuild's 15 arguments), that
    unpickles to 7 without opening anything."""

    def __init__(self, tensor: torch.Tensor):
        from ..._core._reductions import reduce_tensor
        from ..._core._sharing import revoke

        _, args = reduce_tensor(tensor)
        revoke(tensor)  # the send it made is never opened
        self.args = tuple(_plain(arg) for arg in args)

    def __reduce__(self) -> tuple:
        return (_seven, self.args)


def _plain(arg: Any) -> Any:
    """An argument as bytes where it is a memoryview (pickled as bytes either way)."""
    return bytes(arg) if isinstance(arg, memoryview) else arg


def reduction_floor(device: str, nbytes: int = 4 << 10, count: int = 200) -> tuple[float, float]:
    """(us, small message us): round trips of a message in the shape of devipc's reduction of a
    tensor of `nbytes` on `device`, opened by nothing, alternating with the small message."""
    shaped = _ReductionShaped(torch.full((nbytes // 4,), 7, dtype=torch.int32, device=device))
    with _consumer(device) as (inbox, outbox):
        return _paired_medians_us(inbox, outbox, "message", _returns(shaped), count)


@contextlib.contextmanager
def _consumer(device: str) -> Iterator[tuple[Any, Any]]:
    """A spawned `consumer` of `device`'s tensors: (inbox, outbox); it ends with the block."""
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    modules = hook_modules([torch.device(device).type])
    proc = ctx.Process(target=consumer, args=(inbox, outbox, device, modules), daemon=True)
    proc.start()
    try:
        yield inbox, outbox
        inbox.put(None)
        proc.join(TIMEOUT)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(TIMEOUT)


def measure(
    device: str, sizes: list[int] = SIZES, quick: bool = False, progress: Progress | None = None
) -> list[dict]:
    """[{"size": bytes, "devipc": us, "devipc-new": us, "cpu-shm": us, "via-cpu": us,
    "message": us, "message-new": us}], medians per size; "message" and "message-new" are the
    small message's round trips, alternating with devipc's and devipc-new's."""
    progress = progress or Progress("ipc", lines=True)
    progress.start(len(sizes) * len(METHODS))
    rows = []
    with _consumer(device) as (inbox, outbox), contextlib.closing(progress):
        for nbytes in sizes:
            n = nbytes // 4
            on_device = torch.full((n,), 7, dtype=torch.int32, device=device)
            host = torch.full((n,), 7, dtype=torch.int32).share_memory_()
            count = iterations(nbytes, quick)
            row: dict = {"size": nbytes}
            row["devipc"], row["message"] = _paired_medians_us(
                inbox, outbox, "devipc", _returns(on_device), count
            )
            progress.step(f"{human(nbytes)} devipc {row['devipc']:.0f} us")
            row["devipc-new"], row["message-new"] = _paired_medians_us(
                inbox, outbox, "devipc", _new(n, device), count
            )
            progress.step(
                f"{human(nbytes)} devipc, a new tensor each send {row['devipc-new']:.0f} us"
            )
            for mode, make in (
                ("cpu-shm", lambda t=host: t),
                ("via-cpu", lambda t=on_device: t.cpu()),
            ):
                row[mode] = _median_us(inbox, outbox, mode, make, count)
                progress.step(f"{human(nbytes)} {mode} {row[mode]:.0f} us")
            rows.append(row)
            del on_device, host
    return rows


def table(rows: list[dict], device: str) -> str:
    return markdown(
        [
            "size",
            "small message (us)",
            f"devipc {device}, re-sent (us)",
            "re-sent / message",
            f"devipc {device}, new each send (us)",
            "new / its message",
            "torch CPU shared (us)",
            "copy via CPU (us)",
            "cpu-shm / devipc",
            "via-cpu / devipc",
        ],
        [
            [
                human(r["size"]),
                f"{r['message']:.0f}",
                f"{r['devipc']:.0f}",
                f"{r['devipc'] / r['message']:.2f}x",
                f"{r['devipc-new']:.0f}",
                f"{r['devipc-new'] / r['message-new']:.2f}x",
                f"{r['cpu-shm']:.0f}",
                f"{r['via-cpu']:.0f}",
                f"{r['cpu-shm'] / r['devipc']:.2f}x",
                f"{r['via-cpu'] / r['devipc']:.1f}x",
            ]
            for r in rows
        ],
    )


BATCH_SHAPE = (64, 3, 32, 32)  # float32: 768 KiB per batch


class _Batches(torch.utils.data.Dataset):
    """Each item a whole batch (the loader's batch_size=None), made in the worker: a device
    tensor of BATCH_SHAPE, or a small Python object (the floor)."""

    def __init__(self, count: int, device: str | None, modules: list[str]):
        self.count, self.device, self.modules = count, device, modules

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> Any:
        if self.device is None:
            return (index, 7)
        batch = torch.empty(BATCH_SHAPE, device=self.device)
        batch[0, 0, 0, 0] = index
        return batch


def _load_modules(worker: int) -> None:
    """A spawned worker's first step: the device package of its dataset."""
    info = torch.utils.data.get_worker_info()
    assert info is not None and isinstance(info.dataset, _Batches)  # (called in a worker)
    load_modules(info.dataset.modules)


def dataloader(device: str, batches: int = 400, workers: int = 2, rounds: int = 3) -> dict:
    """{"device": batches/s, "objects": batches/s}: best of `rounds` passes of a DataLoader
    (`workers` spawned workers, `batches` items each pass) over batches made on `device` in the
    workers, and over small objects; the consumer reads one element of each device batch. The
    two loaders' passes alternate (their workers persist): this machine's speed drifts."""
    modules = hook_modules([torch.device(device).type])
    loaders = {
        name: torch.utils.data.DataLoader(
            _Batches(batches, where, modules),
            batch_size=None,
            num_workers=workers,
            multiprocessing_context="spawn",
            worker_init_fn=_load_modules,
            persistent_workers=True,
            prefetch_factor=4,
        )
        for name, where in (("objects", None), ("device", device))
    }
    rates = dict.fromkeys(loaders, 0.0)
    for round_ in range(rounds + 1):  # the first pass starts the workers: not timed
        for name, loader in loaders.items():
            start = time.perf_counter()
            for index, item in enumerate(loader):
                got = item[0] if name == "objects" else int(item[0, 0, 0, 0].item())
                assert got == index, f"{name}: batch {index} read {got}"
            if round_:
                rates[name] = max(rates[name], batches / (time.perf_counter() - start))
    del loaders
    return rates


PHASES = ("reduce", "open", "read", "release")


def phase_consumer(conn: Any, modules: list[str]) -> None:
    """Unpickles what comes through `conn` (a Pipe: no queue thread), reads one element, drops
    it, and replies with the times of each."""
    load_modules(modules)
    kept = []
    while (data := conn.recv_bytes()) != b"stop":
        if data.startswith(_KEEP):  # received and held, as an engine holds its weights
            kept.append(ForkingPickler.loads(data[len(_KEEP) :]))
            conn.send(None)
            continue
        if data == _DROP:
            kept.clear()
            conn.send(None)
            continue
        start = time.perf_counter()
        tensor = ForkingPickler.loads(data)
        opened = time.perf_counter()
        value = int(tensor[-1].item())
        read = time.perf_counter()
        del tensor
        conn.send((value, opened - start, read - opened, time.perf_counter() - read))


_KEEP, _DROP = b"keep:", b"drop"


def phases(device: str, sizes: list[int], count: int = 200, held: int = 0) -> list[dict]:
    """[{"size", "reduce", "open", "read", "release"}]: medians in us of each part of a send;
    with `held`, while the consumer holds that many tensors it received before (separate
    allocations of 64 bytes), as an inference engine holds its weights."""
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(
        target=phase_consumer, args=(theirs, hook_modules([torch.device(device).type])), daemon=True
    )
    proc.start()
    rows = []
    weights = [torch.full((16,), 1, dtype=torch.int32, device=device) for _ in range(held)]
    try:
        for weight in weights:
            mine.send_bytes(_KEEP + bytes(ForkingPickler.dumps(weight)))
            if not mine.poll(TIMEOUT):
                raise TimeoutError("the consumer did not answer")
            mine.recv()
        for nbytes in sizes:
            tensor = torch.full((nbytes // 4,), 7, dtype=torch.int32, device=device)
            times: list[tuple[float, ...]] = []
            for _ in range(count + WARM_UP):
                start = time.perf_counter()
                data = ForkingPickler.dumps(tensor)
                reduced = time.perf_counter() - start
                mine.send_bytes(data)
                if not mine.poll(TIMEOUT):
                    raise TimeoutError("the consumer did not answer")
                value, *parts = mine.recv()
                assert value == 7, f"the consumer read {value}"
                times.append((reduced, *parts))
            medians = [statistics.median(column) * 1e6 for column in zip(*times[WARM_UP:])]
            rows.append({"size": nbytes, "held": held, **dict(zip(PHASES, medians))})
            del tensor
        mine.send_bytes(_DROP)
        if mine.poll(TIMEOUT):
            mine.recv()
        mine.send_bytes(b"stop")
        proc.join(TIMEOUT)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(TIMEOUT)
    return rows


def phase_table(rows: list[dict]) -> str:
    return markdown(
        [
            "size",
            "tensors the consumer holds",
            "producer: reduce (us)",
            "consumer: open, previous release (us)",
            "consumer: read one element (us)",
            "consumer: drop (us)",
        ],
        [
            [human(r["size"]), f"{r.get('held', 0):,}", *(f"{r[p]:.0f}" for p in PHASES)]
            for r in rows
        ],
    )


def panel(rows: list[dict], device: str) -> Panel:
    names = {
        "devipc": f"devipc ({device}), re-sent",
        "devipc-new": f"devipc ({device}), new",
        "cpu-shm": "torch CPU shared",
        "via-cpu": "copy through CPU",
    }
    return Panel(
        "IPC round trip (Queue)",
        "latency (us)",
        [r["size"] for r in rows],
        {names[m]: [r[m] for r in rows] for m in METHODS},
    )
