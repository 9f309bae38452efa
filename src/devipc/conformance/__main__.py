"""`python -m devipc.conformance --device TYPE`: run the kit, print the table, exit 1 on a
failure (2 when it cannot start)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from . import Result, run, select


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m devipc.conformance",
        description="Check a device's devipc IPC hooks against the contract.",
    )
    parser.add_argument("--device", help="the device type under test, e.g. openreg")
    parser.add_argument("--index", type=int, default=0, help="the device index (default 0)")
    parser.add_argument(
        "--hooks-module",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE first in every process of the kit (to load the "
        "device or register its hooks); repeatable",
    )
    parser.add_argument(
        "-k",
        action="append",
        default=[],
        metavar="SUBSTRING",
        help="run only checks whose name contains SUBSTRING; repeatable",
    )
    parser.add_argument("--list", action="store_true", help="list the checks and exit")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds one check may take before it fails (default 120)",
    )
    args = parser.parse_args(argv)
    if not args.list and not args.device:
        parser.error("--device is required")
    return args


def row(result: Result) -> str:
    return f"{result.status:<8} {result.name:<28} {result.seconds:6.2f}s  {result.detail}"


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    checks = select(args.k)
    if args.list:
        for check in checks:
            print(f"{check.name:<28} {check.proves}")
        return 0
    if not checks:
        print(f"no check matches {args.k}", file=sys.stderr)
        return 2
    import torch

    from . import _device
    from ._runner import CannotStart, describe, preflight

    try:
        _device.load(args.hooks_module)
        device = torch.device(args.device, args.index)
        count = _device.device_count(device)
    except Exception as error:  # noqa: BLE001 - said on stderr: the kit cannot start
        print(
            f"cannot test {args.device}:{args.index}: {type(error).__name__}: {error} "
            f"(is its package installed? --hooks-module imports it)",
            file=sys.stderr,
        )
        return 2
    if not 0 <= args.index < count:
        print(f"{args.device} has {count} devices here, no index {args.index}", file=sys.stderr)
        return 2
    try:
        preflight(device)
    except CannotStart as error:
        print(f"cannot test {device}: {error}", file=sys.stderr)
        return 2
    start = time.monotonic()
    if not args.json:
        print(f"devipc conformance: {describe(device)}")
        print(f"{'result':<8} {'check':<28} {'time':>7}  detail", flush=True)

    def report(result: Result) -> None:
        if not args.json:
            print(row(result), flush=True)

    results, hung = run(checks, device, args.hooks_module, report, args.timeout)
    failed = [result for result in results if result.status == "failed"]
    if args.json:
        print(json.dumps([dataclasses.asdict(result) for result in results], indent=1))
    else:
        counts = {
            status: sum(r.status == status for r in results)
            for status in ("passed", "failed", "skipped")
        }
        print(
            f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} "
            f"skipped in {time.monotonic() - start:.1f} s"
        )
    code = 1 if failed else 0
    if hung:  # a check's thread is still stuck in the device: do not wait for it at exit
        sys.stdout.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
