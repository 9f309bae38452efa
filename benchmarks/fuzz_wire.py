"""Wire fuzzer: every devipc message kind, mutated, must be refused with a devipc error (or still
open as what it says), never crash or hang its reader.

Kinds: typed tensor handles (every dtype family, requires_grad, empty tensors, device indices),
bucket handles, arena attachments and chunks, p2p remote descriptors (device and CPU memory) and
endpoint metadata. A worker subprocess makes a genuine message of the kind, then mutates it with
its own seeded random generator: one field of the framing (`devipc._core._wire`: u32 length |
payload) gets an edge integer, a flipped, cut, grown, zeroed or random payload, a wrong length,
or is dropped, doubled or swapped with its neighbour; or the whole message is cut or a header field
changed; a nested message (a handle inside an attachment) is mutated the same way. It then opens
the result as its reader would and touches what it got (device work that reads it). Outcomes as
in `fuzz_handles.py`: accepted, refused (by type), wrong (any other exception), crash, hang.

Usage: python benchmarks/fuzz_wire.py --mutations 12000 --seed 1 [--modes sync,events]
"""

import argparse
import json
import os
import random
import struct
import subprocess
import sys
import time

from fuzz_handles import LINE_TIMEOUT, Report, _follow, _progress_bar

KINDS = ("tensor", "bucket", "arena", "chunk", "weights", "descriptor", "metadata")
BATCH = 500
_LENGTH = struct.Struct("<I")
_HEADER = 8  # magic, version, kind


# -- mutations of the framing ----------------------------------------------------------------
def fields(data: bytes) -> list[tuple[int, int]] | None:
    """(start of the length prefix, payload length) of each field, or None if it does not parse."""
    found, at = [], _HEADER
    while at < len(data):
        if at + 4 > len(data):
            return None
        (length,) = _LENGTH.unpack_from(data, at)
        if at + 4 + length > len(data):
            return None
        found.append((at, length))
        at += 4 + length
    return found


def _payload(value: bytes, rng: random.Random) -> tuple[str, bytes]:
    if len(value) == 8 and rng.random() < 0.6:
        original = struct.unpack("<q", value)[0]
        number = rng.choice(
            [
                0,
                1,
                -1,
                2,
                7,
                8,
                127,
                128,
                255,
                256,
                4096,
                9_999,
                10_000,
                (1 << 31) - 1,
                1 << 31,
                (1 << 63) - 1,
                -(1 << 63),
                original + 1,
                original - 1,
                original * 2,
                original ^ 0x80,
                rng.randint(-(1 << 63), (1 << 63) - 1),
            ]
        )
        return f"int={number}", struct.pack("<q", number)
    if value[:4] == b"DVIP" and rng.random() < 0.7:
        label, nested = mutate(value, rng)
        return f"nested:{label}", nested
    style = rng.choice(["flip", "cut", "grow", "zero", "random", "empty"])
    if style == "flip" and value:
        at = rng.randrange(len(value))
        return "flip", value[:at] + bytes([value[at] ^ (1 << rng.randrange(8))]) + value[at + 1 :]
    if style == "cut" and value:
        return "cut", value[: rng.randrange(len(value))]
    if style == "grow":
        return "grow", value + rng.randbytes(rng.choice([1, 7, 8, 64]))
    if style == "zero":
        return "zero", bytes(len(value))
    if style == "random":
        return "random", rng.randbytes(len(value))
    return "empty", b""


def mutate(data: bytes, rng: random.Random) -> tuple[str, bytes]:
    """(label, mutated bytes) of one genuine message."""
    spans = fields(data)
    style = rng.random()
    if not spans or style < 0.05:
        return "cut-message", data[: rng.randrange(len(data))]
    if style < 0.10:
        at = rng.choice([0, 4, 6])
        size = 4 if at == 0 else 2
        return f"header@{at}", data[:at] + rng.randbytes(size) + data[at + size :]
    index = rng.randrange(len(spans))
    start, length = spans[index]
    end = start + 4 + length
    whole, payload = data[start:end], data[start + 4 : end]
    if style < 0.18:
        claimed = rng.choice([0, length + 1, length - 1, 1 << 31, (1 << 32) - 1])
        claimed = max(0, min(claimed, (1 << 32) - 1))
        return f"length#{index}", data[:start] + _LENGTH.pack(claimed) + data[start + 4 :]
    if style < 0.22:
        return f"drop#{index}", data[:start] + data[end:]
    if style < 0.25:
        return f"double#{index}", data[:end] + whole + data[end:]
    if style < 0.28 and index + 1 < len(spans):
        nxt_start, nxt_length = spans[index + 1]
        nxt = data[nxt_start : nxt_start + 4 + nxt_length]
        return f"swap#{index}", data[:start] + nxt + whole + data[nxt_start + 4 + nxt_length :]
    label, value = _payload(payload, rng)
    return f"{label}#{index}", data[:start] + _LENGTH.pack(len(value)) + value + data[end:]


# -- the worker: makes, mutates and opens; one JSON line per mutation -------------------------
class _Subjects:
    """What the worker's genuine messages come from: tensors of every dtype family, an arena
    with its reader, an endpoint connected to itself with device and CPU registrations."""

    def __init__(self):
        import torch

        import devipc
        from devipc import p2p

        self.torch, self.devipc, self.p2p = torch, devipc, p2p
        device = "openreg"
        self.tensors = [
            torch.arange(64, dtype=torch.float32, device=device),
            torch.arange(64, dtype=torch.float32, device=device).requires_grad_(),
            torch.ones(3, 5, dtype=torch.bfloat16, device=device).t(),
            torch.arange(10, dtype=torch.int64, device="openreg:1"),
            torch.ones(7, dtype=torch.bool, device=device),
            torch.ones(4, dtype=torch.complex64, device=device).requires_grad_(),
            torch.arange(300, dtype=torch.int8, device=device)[10:40],
            torch.empty(0, dtype=torch.float16, device="openreg:1"),
        ]
        self.named = {"w": self.tensors[0], "b": self.tensors[3].to(device), "m": self.tensors[4]}
        self.packed = devipc.pack(self.named)  # views of one allocation, for copy=False
        self.arena = devipc.Arena(4096, device)
        self.reader = devipc.open_arena(self.arena.attach())
        self.publisher = devipc.WeightPublisher(self.packed)  # tokens: an attachment and a table
        self.endpoint = p2p.Endpoint()
        self.connection = self.endpoint.connect(self.endpoint.metadata())
        self.remote = [
            p2p.create_tensor((256,), torch.float32, place)[0] for place in (device, "cpu")
        ]

    def genuine(self, kind: str, rng: random.Random) -> bytes:
        devipc = self.devipc
        if kind == "tensor":
            data = bytes(devipc.share(rng.choice(self.tensors)))
        elif kind == "bucket":
            copy = rng.random() < 0.5
            data = bytes(devipc.share_tensors(self.named if copy else self.packed, copy=copy))
        elif kind == "arena":
            data = self.arena.attach()
        elif kind == "chunk":
            data = self.arena.put(self.named)
        elif kind == "weights":
            data = self.publisher.token()
        elif kind == "descriptor":
            data = self.endpoint.advertise(rng.choice(self.remote)[rng.randrange(64) :])
        else:
            data = self.endpoint.metadata()
        self.last = data
        return data

    def settle(self, kind: str) -> None:
        """Use up the genuine message if the mutation did not: an arena record is taken until
        its attachment is opened, and the next chunk waits for this one's acknowledgement."""
        if kind == "arena":
            try:
                self.devipc.open_arena(self.last).close()
            except self.devipc.InvalidHandleError:
                pass  # the mutated bytes opened it: already closed
        elif kind == "chunk":
            self.reader.ack(self.reader.read(self.last))
        elif kind == "weights":
            try:
                self.devipc.WeightSubscriber(self.last).close()
            except self.devipc.InvalidHandleError:
                pass  # the mutated bytes opened it: already closed

    def open(self, kind: str, data: bytes) -> None:
        """Open `data` as its reader would and read what it names."""
        devipc, torch = self.devipc, self.torch
        if kind == "tensor":
            float(devipc.open(data).detach().float().sum())
        elif kind == "bucket":
            for tensor in devipc.open_tensors(data).values():
                float(tensor.float().sum())
        elif kind == "arena":
            devipc.open_arena(data).close()
        elif kind == "chunk":
            for tensor in self.reader.read(data).tensors.values():
                float(tensor.float().sum())
        elif kind == "weights":
            with devipc.WeightSubscriber(data) as subscriber:
                self.publisher.publish(wait=False)
                subscriber.wait(timeout=LINE_TIMEOUT / 2)
                for tensor in subscriber.tensors().values():
                    float(tensor.float().sum())
                subscriber.ack()
        elif kind == "descriptor":
            from devipc.p2p._descriptor import Descriptor

            nbytes = Descriptor.from_bytes(data).nbytes
            local = torch.empty(min(nbytes, 1 << 20), dtype=torch.uint8, device="openreg")
            self.connection.read(local, data)
        else:
            connection = self.endpoint.connect(data)
            try:
                connection.read(
                    torch.empty(1024, device="openreg"), self.endpoint.advertise(self.remote[0])
                )
            finally:
                connection.close()


def worker(kinds: str, seed: int, first: int, count: int) -> None:
    import faulthandler

    import devipc
    import devipc_openreg  # noqa: F401

    subjects = _Subjects()
    devipc.set_unopened_deadline(2.0)  # sends whose mutations were refused come back
    print(json.dumps({"ready": True}), flush=True)
    kinds = kinds.split(",")
    for number in range(first, first + count):
        rng = random.Random(f"{seed}-{number}")
        kind = kinds[number % len(kinds)]
        faulthandler.dump_traceback_later(LINE_TIMEOUT - 1, exit=False)
        result, label = {"n": number, "mapped": False}, "genuine"
        try:
            label, data = mutate(subjects.genuine(kind, rng), rng)
            subjects.open(kind, data)
        except devipc.DevIpcError as error:
            result.update(outcome="refused", error=type(error).__name__)
        except Exception as error:  # noqa: BLE001 - what the fuzzer looks for
            result.update(outcome="wrong", error=f"{label}: {type(error).__name__}: {error}"[:400])
        else:
            result["outcome"] = "accepted"
        try:
            subjects.settle(kind)
        except Exception as error:  # noqa: BLE001 - the genuine message must still work
            result.update(
                outcome="wrong",
                error=f"{label}, then the genuine message: {type(error).__name__}: {error}"[:400],
            )
        faulthandler.cancel_dump_traceback_later()
        print(json.dumps(result), flush=True)
    devipc.ipc_collect()
    sys.stdout.flush()
    os._exit(0)


# -- the driver --------------------------------------------------------------------------------
def fuzz(
    mode: str, count: int, seed: int, progress=lambda n: None, kinds=KINDS, batch: int = BATCH
) -> Report:
    """Runs `count` mutations, the kinds in turn, with openreg in `mode` ("sync" or "events")."""
    env = {
        **os.environ,
        "OPENREG_IPC_EVENTS": "1" if mode == "events" else "0",
        "DEVIPC_OPENREG": "1",
    }
    report = Report()
    for first in range(0, count, batch):
        pending = list(range(first, min(first + batch, count)))
        mutations = {n: (kinds[n % len(kinds)], "", None, False) for n in pending}
        while pending:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--worker",
                    ",".join(kinds),
                    str(seed),
                    str(pending[0]),
                    str(len(pending)),
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            settled = _follow(proc, pending, mutations, report, progress)
            pending = [n for n in pending if n not in settled]  # after a crash or a hang
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mutations", type=int, default=1200, help="per IPC mode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default="sync,events")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.worker:
        kinds, seed, first, count = options.worker
        worker(kinds, int(seed), int(first), int(count))
    failed = 0
    for mode in options.modes.split(","):
        print(
            f"mode {mode}: {options.mutations} mutations over {', '.join(KINDS)}, seed "
            f"{options.seed}",
            flush=True,
        )
        update, close = _progress_bar(options.mutations)
        started = time.monotonic()
        report = fuzz(mode, options.mutations, options.seed, update)
        close()
        print(f"  {sum(report.counts.values())} run in {time.monotonic() - started:.0f} s")
        report.print(KINDS)
        failed += report.failed
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
