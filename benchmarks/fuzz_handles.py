"""Handle fuzzer: mutated rebuild arguments must be refused with a devipc error, never crash or
hang the consumer, and never map something they should not.

This process is the producer: it keeps real openreg tensors alive and makes one real send
(`reduce_tensor`, a fresh ref-counter slot) per mutation. It mutates one field of the 15-tuple:
the memory handle (64 bytes), the event handle (64 bytes), the counter handle (38 bytes), the slot
index, the storage size or offset, the device, the event flag. Each mutated rebuild runs in a worker
subprocess, BATCH at a time; a worker reports one line per mutation. Outcomes:

  accepted   the rebuild succeeded (fine where the mutation left the handle valid)
  refused    a devipc.DevIpcError subclass was raised (counted by type)
  wrong      a failure: another exception, or a rebuild that should have been refused
  crash      the worker died by a signal during that mutation
  hang       the rebuild, or the device work that reads the tensor, did not finish in time

Two acceptances of a changed handle are counted apart, as harmless: a pid or fd that still reaches
the very memfd the token names, and a memory handle whose token this process maps already (the
runtime then checks only size and device).

Usage: python benchmarks/fuzz_handles.py --mutations 10000 --seed 1 [--modes sync,events]
"""

import argparse
import faulthandler
import json
import os
import pickle
import random
import select
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter

BATCH = 200
LINE_TIMEOUT = 5.0  # seconds one mutation (rebuild, then reading the tensor) may take: a hang
START_TIMEOUT = 120.0

# The runtime's 64-byte handle (=IHHiiQiiI16s12x): field -> (offset, struct code)
RUNTIME_FIELDS = {
    "magic": (0, "I"),
    "version": (4, "H"),
    "kind": (6, "H"),
    "pid": (8, "i"),
    "fd": (12, "i"),
    "size": (16, "Q"),
    "physical": (24, "i"),
    "slot": (28, "i"),
    "seq": (32, "I"),
    "token": (36, "16s"),
    "zero": (52, "12s"),
}
# The core's 38-byte counter-file handle (<4sHiiQ16s)
COUNTER_FIELDS = {
    "magic": (0, "4s"),
    "version": (4, "H"),
    "pid": (6, "i"),
    "fd": (10, "i"),
    "size": (14, "Q"),
    "token": (22, "16s"),
}
# Fields that opening does not check: a changed value may be accepted. A memory handle's slot
# and seq are unused; an event's physical is unused, and its slot/seq are the record to wait for.
WIRE_HEADER = {"magic": (0, "4s"), "version": (4, "H"), "kind": (6, "H")}  # devipc._core._wire
UNCHECKED = {"mem": {"slot", "seq"}, "event": {"physical", "slot", "seq"}, "counter": set()}
WRONG_TYPES = [None, "x", 1, 1.5, [1], {}, True]


# -- mutations -------------------------------------------------------------------------------
def _edge_ints(code: str, original: int, rng: random.Random) -> list[int]:
    bits = struct.calcsize("<" + code) * 8
    low, high = (-(1 << bits - 1), (1 << bits - 1) - 1) if code.islower() else (0, (1 << bits) - 1)
    values = [
        low,
        high,
        0,
        1,
        -1,
        original + 1,
        original - 1,
        original ^ 0x80,
        rng.randint(low, high),
        os.getpid(),
        1,
        2,
        4096,
        16384,
    ]
    return [v for v in values if low <= v <= high]


def _mutate_bytes(data: bytes, fields: dict, unchecked: set, rng: random.Random):
    """(label, mutated bytes or another object, whether it must be refused)."""
    style = rng.choice(["field", "field", "flip", "truncate", "extend", "type"])
    if style == "field":
        name = rng.choice(list(fields))
        offset, code = fields[name]
        size = struct.calcsize("<" + code)
        if code.endswith("s"):
            choices = [
                bytes(size),
                b"\xff" * size,
                rng.randbytes(size),
                bytes([data[offset] ^ 1]) + data[offset + 1 : offset + size],
            ]
            value = rng.choice(choices)
        else:
            original = struct.unpack_from("=" + code, data, offset)[0]
            value = struct.pack("=" + code, rng.choice(_edge_ints(code, original, rng)))
        mutated = data[:offset] + value + data[offset + size :]
        return f"{name}", mutated, mutated != data and name not in unchecked
    if style == "flip":
        mutated = bytearray(data)
        touched = set()
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(data))
            mutated[i] ^= rng.randint(1, 255)
            touched.add(i)
        checked = {
            i
            for name, (offset, code) in fields.items()
            if name not in unchecked
            for i in range(offset, offset + struct.calcsize("<" + code))
        }
        mutated = bytes(mutated)
        reach = {
            i
            for name in ("pid", "fd")
            if name in fields
            for i in range(fields[name][0], fields[name][0] + 4)
        }
        label = "flip:pid/fd" if touched & checked <= reach else "flip"
        return label, mutated, mutated != data and bool(touched & checked)
    if style == "truncate":
        cut = data[: rng.randrange(len(data))]
        return "truncate", cut, bool(cut) or not unchecked  # an empty event handle: no event
    if style == "extend":
        return "extend", data + rng.randbytes(rng.randint(1, 64)), True
    value = rng.choice(WRONG_TYPES + [bytearray(data)])
    # bytearray: a memory handle must be bytes; counter and event handles take any bytes-like.
    return f"type:{type(value).__name__}", value, not isinstance(value, bytearray)


def mutate(args: list, event_handle: bytes, rng: random.Random):
    """One mutation of a real send's args: (kind, label, args, must_refuse)."""
    from devipc._core import _wire

    kind = rng.choice(["mem", "event", "counter", "slot", "size", "offset", "device", "flag"])
    args = list(args)
    if kind == "mem":
        # args[7] is the hooks' handle wrapped with the sender's device (devipc._core._wire): mostly
        # mutate the hooks' handle inside, sometimes the wrapping itself.
        sender, raw = _wire.unwrap_storage_handle(args[7])
        if rng.random() < 0.8:
            label, raw, refuse = _mutate_bytes(raw, RUNTIME_FIELDS, UNCHECKED["mem"], rng)
            args[7] = _wire.wrap_storage_handle(sender, raw) if isinstance(raw, bytes) else raw
        else:
            label, args[7], refuse = _mutate_bytes(args[7], WIRE_HEADER, set(), rng)
            label = "wire:" + label
        if isinstance(args[7], bytearray):
            refuse = True
    elif kind == "event":
        args[14] = True  # a sync-mode send gets a real event handle to mutate too
        label, args[13], refuse = _mutate_bytes(
            event_handle, RUNTIME_FIELDS, UNCHECKED["event"], rng
        )
    elif kind == "counter":
        label, args[11], refuse = _mutate_bytes(args[11], COUNTER_FIELDS, set(), rng)
    elif kind == "slot":
        value = rng.choice(
            [
                -1,
                -(1 << 63),
                10_000,
                10_001,
                1 << 31,
                1 << 64,
                0,
                9_999,
                args[12] + 1,
                None,
                "1",
                1.0,
                True,
                [0],
                bytes(8),
            ]
        )
        label, args[12] = f"slot={value!r}"[:24], value
        refuse = not (type(value) is int and 0 <= value < 10_000)
    elif kind in ("size", "offset"):
        index = 8 if kind == "size" else 9
        value = rng.choice(
            [
                0,
                -1,
                1,
                args[index] + 1,
                args[index] - 1,
                1 << 21,
                (1 << 21) + 1,
                1 << 40,
                1 << 63,
                1 << 64,
                -(1 << 63),
                None,
                1.0,
                "8",
                True,
            ]
        )
        label, args[index] = f"{kind}={value!r}"[:24], value
        fits = (
            type(value) is int
            and (value > 0 if kind == "size" else value >= 0)
            and value <= (1 << 21)
        )  # openreg's small-block segments are 2 MiB
        refuse = not fits
    elif kind == "device":
        value = rng.choice(
            [
                "cpu",
                "cuda",
                "meta",
                "openreg:1",
                "openreg:7",
                "garbage",
                None,
                -1,
                1,
                3.5,
                ("openreg", 0),
            ]
        )
        label, args[6] = f"device={value!r}", value
        refuse = value not in ("openreg:1", "openreg:7", 1)
    else:
        value = rng.choice([not args[14], None, 0, 1, "yes", b""])
        label, args[14] = f"flag={value!r}", value
        refuse = False
    return kind, label, args, refuse


# -- the worker: rebuilds one batch, one JSON line per mutation ------------------------------
def worker(path: str) -> None:

    import devipc
    import devipc_openreg  # noqa: F401
    from devipc._core import _sharing, _wire

    with open(path, "rb") as f:
        batch = pickle.load(f)
    print(json.dumps({"ready": True}), flush=True)
    for number, rebuild, args in batch:
        faulthandler.dump_traceback_later(LINE_TIMEOUT - 1, exit=False)  # where a hang hangs
        raw = args[7]
        if _wire.is_wrapped(raw):
            try:
                raw = _wire.unwrap_storage_handle(raw)[1]
            except devipc.DevIpcError:
                raw = None
        token = raw[36:52] if isinstance(raw, bytes) and len(raw) == 64 else None
        result = {
            "n": number,
            "mapped": any(handle[36:52] == token for handle in _sharing._opened._by_handle),
        }
        try:
            tensor = rebuild(*args)
        except devipc.DevIpcError as error:
            result.update(outcome="refused", error=type(error).__name__)
        except Exception as error:  # noqa: BLE001 - what the fuzzer looks for
            result.update(outcome="wrong", error=f"{type(error).__name__}: {error}"[:300])
        else:
            result["outcome"] = "accepted"
            float(tensor.sum())  # device work that reads it, behind any event wait
            del tensor
        faulthandler.cancel_dump_traceback_later()
        print(json.dumps(result), flush=True)
    devipc.ipc_collect()
    sys.stdout.flush()
    os._exit(0)


# -- the driver: producer, batches, watchdog -------------------------------------------------
class Report:
    def __init__(self):
        self.counts = Counter()
        self.by_kind = Counter()
        self.failures = []  # (outcome, kind, label, detail)

    def add(self, mutation, outcome, detail="", mapped=False):
        kind, label, _, refuse = mutation
        if outcome == "accepted" and refuse and kind == "mem" and mapped:
            # the runtime checks pid and fd only on a token's first open (see the docs)
            outcome = "accepted:token already mapped"
        elif outcome == "accepted" and refuse and label in ("pid", "fd", "flip:pid/fd"):
            # name, token and size matched: another pid or fd that holds the very same memfd
            # (the consumer itself holds the producer's counter file, often at the same fd)
            outcome = "accepted:same memfd by another pid/fd"
        elif outcome == "accepted" and refuse:
            outcome, detail = "wrong", "accepted, must be refused"
        self.counts[outcome if outcome != "refused" else f"refused:{detail}"] += 1
        self.by_kind[(kind, outcome)] += 1
        if outcome in ("wrong", "crash", "hang"):
            self.failures.append((outcome, kind, label, detail))

    @property
    def failed(self) -> int:
        return len(self.failures)

    def print(self, kinds) -> None:
        """Outcomes, outcomes by kind (in the order of `kinds`), and the first failures."""
        for outcome, n in sorted(self.counts.items()):
            print(f"  {outcome:32} {n}")
        for kind in kinds:
            row = ", ".join(f"{o} {n}" for (k, o), n in sorted(self.by_kind.items()) if k == kind)
            print(f"    {kind:10} {row}")
        for failure in self.failures[:50]:
            print("  FAIL", *failure[:3], failure[3][:2000])


def _run_batch(mutations, report, env, progress):
    """Runs mutations in worker subprocesses until each has an outcome."""
    pending = list(range(len(mutations)))
    while pending:
        items = [(i, mutations[i][2][0], mutations[i][2][1]) for i in pending]
        with tempfile.NamedTemporaryFile(suffix=".pkl", delete=False) as f:
            pickle.dump(items, f)
        try:
            proc = subprocess.Popen(
                [sys.executable, __file__, "--worker", f.name],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            done = _follow(proc, pending, mutations, report, progress)
        finally:
            os.unlink(f.name)
        pending = [i for i in pending if i not in done]


def _follow(proc, pending, mutations, report, progress) -> set:
    """Reads one worker's lines; returns the mutations it settled (the one it died on too)."""
    done, timeout = set(), START_TIMEOUT
    current = iter(pending)
    try:
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], timeout)
            line = proc.stdout.readline() if ready else None
            if line is None or line == "":  # silent too long, or exited
                number = next(current, None)
                if number is None:
                    return done
                if line is None:
                    proc.kill()
                    proc.wait(LINE_TIMEOUT)
                    report.add(
                        mutations[number],
                        "hang",
                        f"no answer within {timeout} s: {proc.stderr.read()[-1500:]}",
                    )
                else:
                    code = proc.wait(LINE_TIMEOUT)
                    outcome = "crash" if code < 0 else "wrong"
                    report.add(
                        mutations[number],
                        outcome,
                        f"worker exit {code}: {proc.stderr.read()[-300:]}",
                    )
                done.add(number)
                progress(1)
                return done
            message = json.loads(line)
            timeout = LINE_TIMEOUT
            if "ready" in message:
                continue
            number = next(current)
            assert number == message["n"], (number, message)
            report.add(
                mutations[number], message["outcome"], message.get("error", ""), message["mapped"]
            )
            done.add(number)
            progress(1)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(LINE_TIMEOUT)
        proc.stdout.close()
        proc.stderr.close()


def _event_handle():
    """A real interprocess event handle, recorded on the current stream (sync mode has none)."""
    import torch

    from devipc_openreg import _runtime

    event = _runtime.event_create(interprocess=True, timing=False)
    try:
        stream = torch.openreg.current_stream()
        _runtime.event_record(event, _runtime.stream_from_id(stream.device_index, stream.stream_id))
        return _runtime.ipc_get_event_handle(event)
    finally:
        _runtime.event_destroy(event)


def fuzz(mode: str, count: int, seed: int, progress=lambda n: None, batch: int = BATCH) -> Report:
    """Runs `count` mutations with openreg in `mode` ("sync" or "events") from this process."""
    os.environ["OPENREG_IPC_EVENTS"] = "1" if mode == "events" else "0"
    import torch
    import torch.multiprocessing.reductions as reductions

    import devipc
    import devipc_openreg  # noqa: F401

    rng = random.Random(f"{seed}-{mode}")
    tensors = [
        torch.arange(1024, dtype=torch.float32, device="openreg"),
        torch.ones(1 << 18, device="openreg"),
        torch.zeros(4096, device="openreg")[100:],
    ]
    torch.accelerator.synchronize()
    env = {**os.environ}
    report = Report()
    for start in range(0, count, batch):
        mutations = []
        for _ in range(min(batch, count - start)):
            rebuild, args = reductions.reduce_tensor(rng.choice(tensors))
            kind, label, mutated, refuse = mutate(args, _event_handle(), rng)
            mutations.append((kind, label, (rebuild, mutated), refuse))
        _run_batch(mutations, report, env, progress)
    devipc.set_unopened_deadline(0.5)  # sends that refused mutations never opened come back
    deadline = time.monotonic() + 30
    while (
        devipc.ipc_collect() is not None and devipc.stats()["sent"] and time.monotonic() < deadline
    ):
        time.sleep(0.1)
    report.still_held = devipc.stats()["sent"]
    devipc.set_unopened_deadline(None)
    return report


def _progress_bar(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        state = {"n": 0}

        def plain(n):
            state["n"] += n
            if state["n"] % 500 == 0 or state["n"] == total:
                print(f"  {state['n']}/{total}", flush=True)

        return plain, lambda: None
    bar = tqdm(total=total)
    return bar.update, bar.close


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mutations", type=int, default=1000, help="per IPC mode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default="sync,events")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.worker:
        worker(options.worker)
    failed = 0
    for mode in options.modes.split(","):
        print(f"mode {mode}: {options.mutations} mutations, seed {options.seed}", flush=True)
        update, close = _progress_bar(options.mutations)
        started = time.monotonic()
        report = fuzz(mode, options.mutations, options.seed, update)
        close()
        print(
            f"  {sum(report.counts.values())} run in {time.monotonic() - started:.0f} s; "
            f"sends still held by the producer afterwards: {report.still_held}"
        )
        report.print(sorted({k for k, _ in report.by_kind}))
        failed += report.failed
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
