"""The `devipc` command (also `python -m devipc`):

devipc doctor [--serve | --peer TOKEN]   can tensors be shared from here? what to fix if not
devipc info [--pid PID ...] [--json]     what a running process holds (its stats page)
devipc bench [ipc|p2p|weight-sync|all]   the benchmarks: a Markdown table, --plot out.png
"""

import argparse
import importlib.metadata
import json
import os
import shlex
import sys
import time

__all__ = ["main"]

BENCHMARKS = ("ipc", "p2p", "weight-sync")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="devipc", description="zero-copy tensor IPC: checks, live stats and benchmarks"
    )
    parser.add_argument(
        "--version", action="version", version=f"devipc {importlib.metadata.version('devipc')}"
    )
    commands = parser.add_subparsers(dest="command", required=True)

    doctor = commands.add_parser(
        "doctor",
        help="check that sharing works here; say what to fix",
        description="Versions, devices with IPC hooks, the environment "
        "traps of tensor IPC, then a live round trip and a p2p read with "
        "a spawned child. Exits 1 when sharing cannot work.",
    )
    side = doctor.add_mutually_exclusive_group()
    side.add_argument(
        "--serve",
        action="store_true",
        help="wait for a `--peer` check from another container or process",
    )
    side.add_argument(
        "--peer",
        metavar="TOKEN",
        help="also check access to the process that printed TOKEN (--serve)",
    )
    doctor.add_argument(
        "--timeout",
        type=float,
        help="seconds for the live checks (60) or for waiting as --serve (600)",
    )

    info = commands.add_parser(
        "info",
        help="what running devipc processes hold",
        description="Reads each process's devipc stats page through "
        "/proc/<pid>/fd: no debugger, no signal. Without --pid: every "
        "devipc process this user can see.",
    )
    info.add_argument("--pid", type=int, action="append", help="a process (repeatable)")
    info.add_argument("--json", action="store_true", help="the pages as JSON")

    bench = commands.add_parser(
        "bench",
        help="benchmarks: Markdown table, optional PNG",
        description="Quick settings by default (ipc: about 20 s on 2 "
        "cores); --full for those of docs/benchmarks.md.",
    )
    bench.add_argument("which", nargs="?", default="ipc", choices=[*BENCHMARKS, "all"])
    bench.add_argument("--device", help="a device with IPC hooks (default: the first one)")
    bench.add_argument("--max-mib", type=int, help="largest size (weight-sync: the state_dict)")
    bench.add_argument("--full", action="store_true", help="the documented iterations (minutes)")
    bench.add_argument("--plot", metavar="PNG", help="also draw the results (devipc[plot])")

    args = parser.parse_args(argv)
    if args.command == "bench" and (problem := _bench_problem(args)):
        bench.error(problem)  # exit 2, before anything is measured
    try:
        return {"doctor": _doctor, "info": _info, "bench": _bench}[args.command](args)
    except KeyboardInterrupt:
        return 130


def _doctor(args: argparse.Namespace) -> int:
    from . import _doctor

    if args.serve:
        return _doctor.serve(args.timeout or 600.0)
    return _doctor.doctor(args.peer, args.timeout or 60.0)


def _info(args: argparse.Namespace) -> int:
    from .._core._statspage import StatsPageError, find_pages, read_page

    pages, failed = {}, 0
    for pid in args.pid or []:
        try:
            pages[pid] = read_page(pid)
        except StatsPageError as error:
            print(f"devipc info: {error}", file=sys.stderr)
            failed += 1
    if not args.pid:
        pages, refused = find_pages()
        for why in refused.values():
            print(f"devipc info: {why}", file=sys.stderr)
        failed = len(refused)
        if not pages and not args.json:
            print("no other devipc process is visible to this user here")
    if args.json:
        print(json.dumps(pages, indent=2))
    else:
        for pid, page in sorted(pages.items()):
            print(describe(pid, page))
    return 1 if failed else 0


def _command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            words = cmdline.read().split(b"\0")
        return shlex.join(word.decode(errors="replace") for word in words if word)[:100]
    except OSError:  # gone meanwhile, or not ours to read
        return "?"


def describe(pid: int, page: dict) -> str:
    """A process's page, in words."""
    now = time.time()
    head = (
        f"pid {pid}: {_command_line(pid)}\n  devipc stats as of {now - page['updated']:.1f} s "
        f"ago (the collector's last round; devipc loaded there "
        f"{now - page['started']:.0f} s ago)"
    )
    stats = page.get("stats")
    if not stats:
        return head + "\n  no numbers yet (no devipc round has run since it started or forked)"
    if "error" in stats:
        return head + f"\n  the page holds no numbers: {stats['error']}"
    oldest = ""
    if stats.get("unopened"):
        age = stats["oldest_unopened_s"] + now - page["updated"]
        oldest = f", the oldest sent {age:.1f} s ago"
    lines = [
        ("exports", stats.get("exports"), "allocations other processes may reach"),
        (
            "sends held",
            stats.get("sent"),
            "sends not ended (consumers hold them or have not opened them)",
        ),
        ("unopened sends", stats.get("unopened"), f"sent, never opened{oldest}"),
        ("counter files", stats.get("counter_files"), "this process's, for its sends"),
        ("mapped", stats.get("mapped"), "allocations received from other processes"),
        (
            "of which idle",
            stats.get("mapped_idle"),
            "kept open a while for the next tensor on them",
        ),
        ("mapped counter files", stats.get("mapped_counter_files"), "other producers' files"),
        ("pending releases", stats.get("pending_releases"), "waiting for device work"),
        (
            "buckets shared",
            stats.get("buckets_shared"),
            f"{stats.get('bucket_tensors_shared')} tensors in them",
        ),
    ]
    return "\n".join(
        [
            head,
            *(
                f"  {name:<21}{value!s:>7}   {what}"
                for name, value, what in lines
                if value is not None
            ),
        ]
    )


def _bench_problem(args: argparse.Namespace) -> str:
    """What in the bench's arguments would end in a traceback, or measure something other than
    asked; "" when nothing."""
    import torch

    from .._core._devices import count_of, present
    from ._bench import ipc
    from ._common import device_types

    which = BENCHMARKS if args.which == "all" else (args.which,)
    if args.max_mib is not None:
        if args.max_mib < 1:
            return f"--max-mib {args.max_mib}: a size is at least 1 (MiB)"
        if "ipc" in which and args.max_mib << 20 > ipc.SIZES[-1]:
            return f"--max-mib {args.max_mib}: ipc measures sizes up to {ipc.SIZES[-1] >> 20} MiB"
        needed = 3 * args.max_mib << 20  # p2p: the device range and two host buffers as large
        host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if {"p2p", "weight-sync"} & set(which) and needed > host:
            return (
                f"--max-mib {args.max_mib}: needs about {needed / 2**30:.1f} GiB of host "
                f"memory, this host has {host / 2**30:.1f} GiB"
            )
    if args.device is not None:
        try:
            device = torch.device(args.device)
        except RuntimeError as error:
            return f"--device {args.device}: not a device ({str(error).splitlines()[0][:120]})"
        if device.type not in device_types():
            return (
                f"--device {args.device}: {device.type} has no IPC hooks here (devices with "
                f"hooks: {', '.join(device_types()) or 'none'})"
            )
        if not present(device):
            return (
                f"--device {args.device}: {device.type} has {count_of(device.type)} device(s) here"
            )
    if args.plot is not None:
        folder = os.path.dirname(os.path.abspath(args.plot))
        if os.path.isdir(args.plot) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            return (
                f"--plot {args.plot}: not a file that can be written (a PNG in a folder "
                f"that exists)"
            )
    return ""


def _bench(args: argparse.Namespace) -> int:
    from ._bench import common, ipc, p2p, weight_sync
    from ._common import device_types

    if args.plot:  # before a long run, not after it
        try:
            common.require_plotting()
        except ImportError as error:
            print(f"devipc bench: --plot: {error}", file=sys.stderr)
            return 2
    device = args.device or next(iter(device_types()), None)
    if device is None:
        print(
            "devipc bench: no device has IPC hooks here: import your device's package first "
            "(the reference device: DEVIPC_OPENREG=1 or `pip install devipc-openreg`)",
            file=sys.stderr,
        )
        return 2
    quick = "" if args.full else "; quick settings, --full for the documented ones"
    panels = []
    for name in BENCHMARKS if args.which == "all" else (args.which,):
        if name == "ipc":
            top = (args.max_mib or 256) << 20
            latencies = ipc.measure(
                device,
                [s for s in ipc.SIZES if s <= top],
                quick=not args.full,
                progress=common.Progress("ipc"),
            )
            print(
                f"\n### IPC round trip through a torch.multiprocessing Queue, median us "
                f"({device}{quick})\n\n{ipc.table(latencies, device)}",
                flush=True,
            )
            panels.append(ipc.panel(latencies, device))
            rates = ipc.dataloader(device, 400 if args.full else 50, rounds=3 if args.full else 1)
            print(
                f"\nDataLoader, 2 spawned workers: batches of {ipc.BATCH_SHAPE} float32 made "
                f"on {device} {rates['device']:.0f}/s, small Python objects "
                f"{rates['objects']:.0f}/s ({rates['device'] / rates['objects']:.0%})",
                flush=True,
            )
        elif name == "p2p":
            top = (args.max_mib or (256 if args.full else 64)) << 20
            rows, results = p2p.measure(
                device,
                top,
                0.8 if args.full else 0.2,
                9 if args.full else 3,
                progress=common.Progress("p2p"),
            )
            print(
                f"\n### p2p one-sided bandwidth, same host, GB/s ({device}{quick})\n\n"
                f"{p2p.table(rows, results)}",
                flush=True,
            )
            panels += p2p.panels(rows, results)
        else:
            mib = args.max_mib or (256 if args.full else 64)
            measured = weight_sync.measure(
                device, mib, 5 if args.full else 2, progress=common.Progress("weight-sync")
            )
            print(
                f"\n### weight sync of a {measured['tensors']}-tensor state_dict, "
                f"{measured['nbytes'] / 2**20:.0f} MiB ({device}{quick})\n\n"
                f"{weight_sync.table(measured)}",
                flush=True,
            )
            panels.append(weight_sync.panel(measured))
    if args.plot:
        common.plot(panels, args.plot)
        print(f"devipc bench: plot written to {args.plot}", file=sys.stderr)
    return 0
