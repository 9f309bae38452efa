"""One-sided read and write bandwidth between two processes on this host, up to four ways:

  memcpy       single-thread copy in one process (torch CPU copy_, torch.set_num_threads(1))
  devipc       devipc.p2p, same host: Endpoint() (the device's IPC hooks)
  devipc-nixl  devipc.p2p forced over NIXL: Endpoint(transport="nixl") (when NIXL is installed)
  nixl         NIXL's own agent API, no devipc: the same kind of memory registered with bare
               agents, prepared requests reposted (its best case: no per-call set-up)

Sizes 4 KiB ... max (powers of 4), then a vectorized batch of 1,000 x 4 KiB ranges (8 KiB apart
on both sides, so that nothing merges them): one readv/writev, one NIXL request of 1,000
descriptors, 1,000 copy_ calls for memcpy. The owner process only registers and advertises;
every transfer is posted by this process. GB/s are 10^9 bytes/s, medians of rounds that
interleave the methods. NIXL's path needs device memory that is host memory (`memory_kind`
"DRAM", as openreg's) or the engine's VRAM.
"""

import contextlib
import functools
import os
import statistics
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.multiprocessing as mp

from ... import p2p
from ..._core._errors import DevIpcError
from .._common import hook_modules, load_modules
from .common import Panel, Progress, human, markdown

__all__ = [
    "BATCH",
    "LATENCY_ROWS",
    "LATENCY_SIZES",
    "METHODS",
    "batch_offsets",
    "have_nixl",
    "latency",
    "latency_table",
    "measure",
    "panels",
    "sizes",
    "table",
]

TIMEOUT = 300
BATCH, BATCH_BYTES, BATCH_STRIDE = 1000, 4 << 10, 8 << 10
METHODS = ("memcpy", "devipc", "devipc-nixl", "nixl")
BATCH_LABEL = f"{BATCH} x 4 KiB"
LATENCY_SIZES = (4 << 10, 64 << 10, 1 << 20)
LATENCY_ROWS = (
    "sync read",
    "sync write",
    "prepared post (read)",
    "NIXL prepared READ",
    "sync read over NIXL",
    "sync read over NIXL, liveness=False",
    "NIXL prepared READ of 8 B, then READ",
)


def have_nixl(device: str) -> bool:
    """Whether NIXL is installed and takes `device`'s memory as host memory (DRAM), which the
    bare-agent comparison registers."""
    from ...p2p._nixl import load_nixl, memory_kind

    try:
        load_nixl()
        return memory_kind(torch.device(device)) == "DRAM"
    except (ImportError, DevIpcError):  # no NIXL here: nothing to compare with
        return False


def sizes(max_bytes: int) -> list[int]:
    out, size = [], 4 << 10
    while size <= max_bytes:
        out.append(size)
        size *= 4
    return out


def batch_offsets() -> list[int]:
    return [i * BATCH_STRIDE for i in range(BATCH)]


def _copies(target: torch.Tensor, source: torch.Tensor) -> None:
    """memcpy's batch: one copy_ per range."""
    for o in batch_offsets():
        target[o : o + BATCH_BYTES].copy_(source[o : o + BATCH_BYTES])


def _new_agent(name: str) -> Any:
    from ...p2p._nixl import new_agent

    return new_agent(name)


def owner(conn: Connection, max_bytes: int, device: str, nixl: bool, modules: list[str]) -> None:
    """Registers one tensor with the endpoints and the memory of another (no devipc
    registration) with a bare NIXL agent; advertises every range the benchmark uses; then waits
    to be told to exit."""
    load_modules(modules)
    endpoints = {"devipc": p2p.Endpoint()}
    if nixl:
        endpoints["devipc-nixl"] = p2p.Endpoint(transport="nixl")
    span = max(max_bytes, BATCH * BATCH_STRIDE)
    tensor, tensor_id = p2p.create_tensor((span,), torch.uint8, device)
    tensor.copy_(torch.arange(span, dtype=torch.int64).to(torch.uint8))
    info: dict = {"descs": {}}
    if nixl:
        agent = _new_agent(f"nixl-bench-owner-{os.getpid()}")
        buffer = torch.empty(span, dtype=torch.uint8, device=device)  # as devipc's memory
        buffer.copy_(tensor)
        torch.accelerator.synchronize()
        registered = agent.register_memory([(buffer.data_ptr(), span, 0, "")], "DRAM")
        info["nixl"] = (agent.get_agent_metadata(), buffer.data_ptr())
    for name, endpoint in endpoints.items():
        info[name] = endpoint.metadata()
        descs: dict = {size: endpoint.advertise(tensor_id, 0, size) for size in sizes(max_bytes)}
        descs["batch"] = [
            endpoint.advertise(tensor_id, offset, BATCH_BYTES) for offset in batch_offsets()
        ]
        info["descs"][name] = descs
    conn.send(info)
    assert conn.poll(TIMEOUT) and conn.recv() == "exit"
    if nixl:
        agent.deregister_memory(registered)
    for endpoint in endpoints.values():
        endpoint.close()
    conn.send("bye")


def rates(
    steps: dict[str, Callable[[], object]], nbytes: int, seconds: float, rounds: int
) -> dict[str, float]:
    """Median GB/s of each step (one transfer of `nbytes`) over `rounds` rounds that interleave
    the methods, so that load from elsewhere on the machine falls on all of them alike; each
    round runs a step for >= seconds / rounds (3 calls at least), after one untimed call."""
    samples: dict = {name: [] for name in steps}
    for name, step in steps.items():
        with single_thread(name):
            step()
    for _ in range(rounds):
        for name, step in steps.items():
            with single_thread(name):
                count, start = 0, time.perf_counter()
                while True:
                    step()
                    count += 1
                    elapsed = time.perf_counter() - start
                    if (count >= 3 and elapsed >= seconds / rounds) or count >= 100_000:
                        break
            samples[name].append(nbytes * count / elapsed / 1e9)
    return {name: statistics.median(values) for name, values in samples.items()}


@contextlib.contextmanager
def single_thread(name: str) -> Iterator[None]:
    """memcpy runs on one thread; the others as they are."""
    threads = torch.get_num_threads()
    if name == "memcpy":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class NixlOwn:
    """NIXL's own DRAM -> DRAM path on the device's memory (host addresses, registered with the
    agent directly): prepared requests, reposted and polled to completion."""

    def __init__(self, metadata: bytes, remote_addr: int, span: int, device: str) -> None:
        self.agent = _new_agent(f"nixl-bench-{os.getpid()}")
        self.buffer = torch.zeros(span, dtype=torch.uint8, device=device)
        torch.accelerator.synchronize()
        self.address = self.buffer.data_ptr()
        self.registered = self.agent.register_memory([(self.address, span, 0, "")], "DRAM")
        self.peer = self.agent.add_remote_agent(metadata)
        self.remote = remote_addr
        self.handles: list[Any] = []
        self.dlists: list[Any] = []

    def step(self, op: str, offsets: list[int], nbytes: int) -> Callable[[], None]:
        local = [(self.address + o, nbytes, 0) for o in offsets]
        remote = [(self.remote + o, nbytes, 0) for o in offsets]
        handle = self.agent.initialize_xfer(
            op,
            self.agent.get_xfer_descs(local, "DRAM"),
            self.agent.get_xfer_descs(remote, "DRAM"),
            self.peer,
        )
        self.handles.append(handle)
        return self._run(handle)

    def prepped(self, op: str, nbytes: int) -> Callable[[], None]:
        """NIXL's prepared descriptor lists (prep_xfer_dlist) and request (make_prepped_xfer)
        made once; a call is `transfer`, then `check_xfer_state` polled to DONE."""
        local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(self.address, nbytes, 0)], "DRAM")
        remote = self.agent.prep_xfer_dlist(self.peer, [(self.remote, nbytes, 0)], "DRAM")
        self.dlists += [local, remote]
        handle = self.agent.make_prepped_xfer(op, local, [0], remote, [0])
        self.handles.append(handle)
        return self._run(handle)

    def _run(self, handle: Any) -> Callable[[], None]:
        """One transfer of `handle`, polled to DONE."""

        def run() -> None:
            state = self.agent.transfer(handle)
            while state == "PROC":
                state = self.agent.check_xfer_state(handle)
            assert state == "DONE", state

        return run

    def close(self) -> None:
        for handle in self.handles:
            self.agent.release_xfer_handle(handle)
        for dlist in self.dlists:
            self.agent.release_dlist_handle(dlist)
        self.agent.remove_remote_agent(self.peer)
        self.agent.deregister_memory(self.registered)


class _Owner:
    """The spawned process that registers and advertises what the benchmarks read and write."""

    def __init__(self, device: str, nbytes: int, nixl: bool):
        ctx = mp.get_context("spawn")
        self._conn, theirs = ctx.Pipe()
        modules = hook_modules([torch.device(device).type])
        self._process = ctx.Process(
            target=owner, args=(theirs, nbytes, device, nixl, modules), daemon=True
        )
        self._process.start()

    def info(self) -> dict:
        """What it advertised: metadata and descriptors by method and size."""
        assert self._conn.poll(TIMEOUT), "the owner did not answer"
        return self._conn.recv()

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.send("exit")
            self._conn.poll(TIMEOUT) and self._conn.recv()
        self._process.join(TIMEOUT)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(TIMEOUT)


def measure(
    device: str,
    max_bytes: int = 256 << 20,
    seconds: float = 0.8,
    rounds: int = 9,
    nixl: bool | None = None,
    progress: Progress | None = None,
) -> tuple[list[tuple[str, str]], dict]:
    """([(op, label)], {(op, label, method): GB/s}); the NIXL methods when `nixl` (default:
    when NIXL is installed)."""
    nixl = have_nixl(device) if nixl is None else nixl
    methods = METHODS if nixl else METHODS[:2]
    progress = progress or Progress("p2p", lines=True)
    progress.start(2 * (len(sizes(max_bytes)) + 1))
    child = _Owner(device, max_bytes, nixl)
    progress.note("p2p: the owner registers and advertises")
    endpoints: dict[str, p2p.Endpoint] = {}
    nixl_own: NixlOwn | None = None
    rows: list[tuple[str, str]] = []
    results: dict[tuple[str, str, str], float] = {}
    try:
        info = child.info()
        span = max(max_bytes, BATCH * BATCH_STRIDE)
        endpoints = {"devipc": p2p.Endpoint()}
        if nixl:
            endpoints["devipc-nixl"] = p2p.Endpoint(transport="nixl")
            metadata, address = info["nixl"]
            nixl_own = NixlOwn(metadata, address, span, device)
        connections = {name: endpoints[name].connect(info[name]) for name in endpoints}
        local, _ = p2p.create_tensor((span,), torch.uint8, device)
        source, target = torch.ones(span, dtype=torch.uint8), torch.zeros(span, dtype=torch.uint8)
        batch_views = [local[o : o + BATCH_BYTES] for o in batch_offsets()]
        for op in ("read", "write"):
            each_size: list[int | str] = [*sizes(max_bytes), BATCH_LABEL]
            for size in each_size:
                steps: dict[str, Callable[[], object]] = {}
                if isinstance(size, str):  # the batch
                    nbytes, label, offsets, each = (
                        BATCH * BATCH_BYTES,
                        size,
                        batch_offsets(),
                        BATCH_BYTES,
                    )
                    steps["memcpy"] = functools.partial(_copies, target, source)
                    for name, connection in connections.items():
                        call = connection.readv if op == "read" else connection.writev
                        steps[name] = functools.partial(
                            call, batch_views, info["descs"][name]["batch"]
                        )
                else:
                    nbytes, label, offsets, each = size, human(size), [0], size
                    steps["memcpy"] = functools.partial(target[:size].copy_, source[:size])
                    for name, connection in connections.items():
                        one = connection.read if op == "read" else connection.write
                        steps[name] = functools.partial(
                            one, local[:size], info["descs"][name][size]
                        )
                if nixl_own is not None:
                    steps["nixl"] = nixl_own.step(op.upper(), offsets, each)
                got = rates(steps, nbytes, seconds, rounds)
                for name in methods:
                    results[(op, label, name)] = got[name]
                progress.step(
                    f"{op} {label}: "
                    + ", ".join(f"{name} {got[name]:.2f}" for name in methods)
                    + " GB/s"
                )
                rows.append((op, label))
    finally:
        progress.close()
        if nixl_own is not None:
            nixl_own.close()
        for endpoint in endpoints.values():
            endpoint.close()
        child.stop()
    return rows, results


def latency(
    device: str,
    seconds: float = 0.5,
    rounds: int = 9,
    nixl: bool | None = None,
    progress: Progress | None = None,
) -> dict[tuple[str, int], float]:
    """{(row, size): µs per operation}: devipc's synchronous read and write (then
    `torch.accelerator.synchronize()`), a prepared read posted and waited for (then the same),
    and NIXL's own prepared READ (posted, polled to DONE) on the same kind of memory, between
    two processes; medians of `rounds` rounds that interleave them. With NIXL also devipc's
    synchronous read over NIXL, with and without its liveness read (`connect(...,
    liveness=False)`), and NIXL's own prepared READ of 8 bytes then of the size: what devipc's
    liveness read and its read cost in NIXL's own API."""
    nixl = have_nixl(device) if nixl is None else nixl
    progress = progress or Progress("p2p latency", lines=True)
    progress.start(len(LATENCY_SIZES))
    top = max(LATENCY_SIZES)
    child = _Owner(device, top, nixl)
    endpoint: p2p.Endpoint | None = None
    over_nixl: p2p.Endpoint | None = None
    nixl_own: NixlOwn | None = None
    results: dict[tuple[str, int], float] = {}
    sync = torch.accelerator.synchronize
    try:
        info = child.info()
        endpoint = p2p.Endpoint()
        connection = endpoint.connect(info["devipc"])
        if nixl:  # before the local tensor, which it registers with NIXL too
            over_nixl = p2p.Endpoint(transport="nixl")
            checked = over_nixl.connect(info["devipc-nixl"])
            unchecked = over_nixl.connect(info["devipc-nixl"], liveness=False)
            metadata, address = info["nixl"]
            nixl_own = NixlOwn(metadata, address, max(top, BATCH * BATCH_STRIDE), device)
        local, _ = p2p.create_tensor((top,), torch.uint8, device)
        for size in LATENCY_SIZES:
            desc, view = info["descs"]["devipc"][size], local[:size]
            prepared = connection.prepare("read", [view], [desc])

            def read(view: torch.Tensor = view, desc: bytes = desc) -> None:
                connection.read(view, desc)
                sync()

            def write(view: torch.Tensor = view, desc: bytes = desc) -> None:
                connection.write(view, desc)
                sync()

            def post(prepared: p2p.PreparedTransfer = prepared) -> None:
                prepared.post().wait()
                sync()

            steps: dict[str, Callable[[], object]] = dict(zip(LATENCY_ROWS, (read, write, post)))
            if nixl_own is not None:
                steps[LATENCY_ROWS[3]] = nixl_own.prepped("READ", size)
                nixl_desc = info["descs"]["devipc-nixl"][size]
                for row, over in zip(LATENCY_ROWS[4:6], (checked, unchecked)):
                    steps[row] = functools.partial(_read_synced, over, view, nixl_desc)
                steps[LATENCY_ROWS[6]] = functools.partial(
                    _one_then_other, nixl_own.prepped("READ", 8), nixl_own.prepped("READ", size)
                )
            got = rates(steps, 1, seconds, rounds)  # one "byte" a call: 10^9 calls/s
            for name, rate in got.items():
                results[(name, size)] = 1e-3 / rate  # µs per call
            prepared.close()
            progress.step(
                f"latency {human(size)}: "
                + ", ".join(f"{name} {results[(name, size)]:.1f}" for name in steps)
                + " µs"
            )
    finally:
        progress.close()
        if nixl_own is not None:
            nixl_own.close()
        for each in (endpoint, over_nixl):
            if each is not None:
                each.close()
        child.stop()
    return results


def _one_then_other(one: Callable[[], None], other: Callable[[], None]) -> None:
    one()
    other()


def _read_synced(connection: p2p.Connection, local: torch.Tensor, desc: bytes) -> None:
    connection.read(local, desc)
    torch.accelerator.synchronize()


def latency_table(results: dict[tuple[str, int], float]) -> str:
    """µs per operation, and each row's ratio to NIXL's prepared READ of the same size."""
    rows = [row for row in LATENCY_ROWS if (row, LATENCY_SIZES[0]) in results]
    nixl = LATENCY_ROWS[3] in rows
    headers = [
        "operation",
        *(f"{human(size)} (µs)" for size in LATENCY_SIZES),
        *((f"{human(size)} / NIXL" for size in LATENCY_SIZES) if nixl else ()),
    ]
    body = [
        [
            row,
            *(f"{results[(row, size)]:.1f}" for size in LATENCY_SIZES),
            *(
                (
                    f"{results[(row, size)] / results[(LATENCY_ROWS[3], size)]:.2f}"
                    for size in LATENCY_SIZES
                )
                if nixl
                else ()
            ),
        ]
        for row in rows
    ]
    return markdown(headers, body)


def table(rows: list, results: dict) -> str:
    """The methods measured, GB/s, and devipc's ratios to the others."""
    methods = [m for m in METHODS if (*rows[0], m) in results]
    names = {
        "memcpy": "memcpy",
        "devipc": "devipc",
        "devipc-nixl": "devipc over NIXL",
        "nixl": "NIXL",
    }
    ratios = [("devipc", "memcpy")] + (
        [("devipc", "nixl"), ("devipc-nixl", "nixl")] if "nixl" in methods else []
    )
    headers = [
        "op",
        "size",
        *(names[m] for m in methods),
        *(f"{names[a]} / {names[b]}" for a, b in ratios),
    ]
    headers[2] = "memcpy (1 thread)"
    body = [
        [
            op,
            label,
            *(f"{results[(op, label, m)]:.2f}" for m in methods),
            *(f"{results[(op, label, a)] / results[(op, label, b)]:.2f}" for a, b in ratios),
        ]
        for op, label in rows
    ]
    return markdown(headers, body)


def panels(rows: list, results: dict) -> list[Panel]:
    out = []
    for op in ("read", "write"):
        labels = [label for o, label in rows if o == op and label != BATCH_LABEL]
        x = [int(label.split()[0]) << (20 if label.endswith("MiB") else 10) for label in labels]
        names = {
            "memcpy": "memcpy (1 thread)",
            "devipc": "devipc",
            "devipc-nixl": "devipc over NIXL",
            "nixl": "NIXL (its own API)",
        }
        series = {
            names[m]: [results[(op, label, m)] for label in labels]
            for m in METHODS
            if (op, labels[0], m) in results
        }
        out.append(Panel(f"p2p {op}, same host", "bandwidth (GB/s)", x, series))
    return out
