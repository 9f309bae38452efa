"""`devipc doctor`: whether tensors can be shared from here, and what to change when not.

Sharing rests on one access: a consumer opens the producer's memfds through
/proc/<producer pid>/fd/<fd> (`_memfd`), which the kernel allows to a process of the same user
(or one with CAP_SYS_PTRACE) in the same PID namespace, when the producer is dumpable. So the
doctor reports the environment, then tries the real thing: a spawned child receives a shared
tensor of every device with hooks (and CPU) through a torch.multiprocessing Queue and writes
into it, and serves a devipc.p2p read. Across containers, `--serve` here and `--peer TOKEN`
there check the access between the two.
"""

import base64
import binascii
import contextlib
import ctypes
import importlib.metadata
import json
import os
import platform
import queue
import resource
import secrets
import socket
import sys
import time
import traceback
from typing import Any

import torch
import torch.multiprocessing as mp

from .. import p2p
from .._core._devices import synchronize
from .._core._errors import DevIpcError
from .._core._hooks import device_supports_ipc, get_ipc_hooks
from .._core._memfd import HANDLE_SIZE, SharedFile, handle_pid, open_shared_file
from .._core._reductions import installed
from .._core._statspage import StatsPageError, find_pages, read_page
from ._common import device_types, hook_modules, load_modules

__all__ = ["doctor", "serve"]

MAGIC = b"DOCT"
TOKEN_PREFIX = "devipc-doctor-1:"
INIT_PID_NS = 0xEFFFFFFC  # the inode of the host's (initial) PID namespace, PROC_PID_INIT_INO
CAP_SYS_PTRACE = 19
PR_GET_DUMPABLE = 3
SHM_WARN_BYTES = 1 << 30
NOFILE_LOW, NOFILE_WANT = 1024, 65536  # `ulimit -n` below which it warns; what it advises
FIX_PID_NS = (
    "run both in one PID namespace: `docker run --pid=host` (or "
    "--pid=container:<the other>) for the containers; in Kubernetes "
    "`shareProcessNamespace: true` for containers of one pod, `hostPID: true` across "
    "pods; or move tensors with devipc.p2p.Endpoint(transport='nixl'), which needs no "
    "/proc access"
)


class Report:
    """Prints each finding as it comes; remembers whether any means sharing cannot work."""

    def __init__(self) -> None:
        self.failures = self.warnings = 0

    def __call__(self, status: str, what: str, fix: str = "") -> None:
        self.failures += status == "FAIL"
        self.warnings += status == "WARN"
        print(f"{status:<5} {what}", flush=True)
        if fix:
            print(f"      fix: {fix}", flush=True)


def doctor(peer: str | None = None, timeout: float = 60.0) -> int:
    """The whole check; 0 when sharing works here (and with `peer`), else 1."""
    theirs = None if peer is None else parse_token(peer)
    if peer is not None and theirs is None:
        print(
            "devipc doctor: --peer takes the token that `devipc doctor --serve` prints, whole",
            file=sys.stderr,
        )
        return 2
    report = Report()
    versions()
    types = devices(report)
    environment(report)
    threads(report, find_pages()[0])
    live(report, types, timeout)
    if theirs is not None:
        check_peer(report, theirs)
    if report.failures:
        print(
            f"\ndevipc doctor: {report.failures} problem(s): sharing cannot work until they "
            f"are fixed (see each `fix:` above)"
        )
        return 1
    print(
        "\ndevipc doctor: sharing works here"
        + (f" ({report.warnings} warning(s) above)" if report.warnings else "")
    )
    return 0


def _version(*distributions: str) -> str:
    for name in distributions:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            version = importlib.metadata.version(name)
            return version if len(distributions) == 1 else f"{version} ({name})"
    return "not installed"


def versions() -> None:
    print(
        f"devipc {_version('devipc')}, torch {torch.__version__}, devipc-openreg "
        f"{_version('devipc-openreg')}, nixl {_version('nixl', 'nixl-cu12', 'nixl-cu13')}; "
        f"Python {platform.python_version()}, Linux {platform.release()}",
        flush=True,
    )


def devices(report: Report) -> list[str]:
    """The device types with hooks that can share; each one's devices, sync mode, identity."""
    types = device_types()
    if not types:
        report(
            "WARN",
            "no device has IPC hooks here: devipc shares no device tensor (CPU tensors "
            "keep torch's own sharing)",
            "import the device's package before sharing (the reference device: `import "
            "devipc_openreg`, or DEVIPC_OPENREG=1); the doctor sees what `import torch` loads",
        )
    for name in list(types):
        hooks = get_ipc_hooks(name)
        if hooks is None or not device_supports_ipc(name):
            report(
                "FAIL",
                f"{name}: hooks are registered but supports_ipc() is False",
                f"the {name} package must enable IPC (see its documentation)",
            )
            types.remove(name)
            continue
        try:
            described = describe(name, hooks)
        except Exception as error:  # noqa: BLE001 - a device's bad setting: a finding
            # the device's own message names its setting and what works (docs/vendor-guide.md)
            report(
                "FAIL",
                f"{name}: its IPC hooks raise {type(error).__name__}, as every send "
                f"of {name} tensors would; the {name} package says:",
                str(error),
            )
            types.remove(name)
            continue
        report("ok", described[0])
        for line in described[1:]:
            print(f"        {line}")
    if types and not installed():
        report(
            "FAIL",
            "torch.multiprocessing is not routed through devipc (devipc.rfc.uninstall() "
            "was called?)",
            "call devipc.rfc.install()",
        )
    return types


def describe(name: str, hooks: Any) -> list[str]:
    """A finding on device type `name` from its hooks (its devices, sync mode), then a line per
    device (identity, memory kind); what a hook raises, for a bad setting of the device's."""
    count = torch.get_device_module(name).device_count()
    mode = (
        "interprocess events (the consumer's stream waits)"
        if hooks.requires_event_sync()
        else "the producer synchronizes before each send"
    )
    lines = [f"{name}: {count} device(s), hooks {type(hooks).__module__}; {mode}"]
    for index in range(count):
        device = torch.device(name, index)
        identity = hooks.device_identity(device)
        kind = hooks.memory_kind(index)
        shown = (
            identity.decode()
            if identity.isascii() and identity.decode().isprintable()
            else identity.hex()
        )
        lines.append(
            f"{device}: identity {shown or '(none)'}, "
            f"memory kind for NIXL {kind or '(none: over NIXL it is refused)'}"
        )
    return lines


def _pid_ns() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def _capability(bit: int) -> bool:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> bit & 1)
    return False


def environment(report: Report) -> None:
    """The traps of tensor IPC on Linux, one finding each."""
    try:
        file = SharedFile(MAGIC, 4096)
    except OSError as error:
        report(
            "FAIL",
            f"memfd_create or mmap failed ({error.strerror})",
            "devipc needs Linux >= 3.17 and a seccomp profile that allows memfd_create "
            "(Docker's default does)",
        )
        return
    try:
        file.buffer.int64(0).value = 42
        mapped = open_shared_file(file.handle, MAGIC)
        seen = mapped.int64(0).value
        mapped.close()
        report(
            "ok" if seen == 42 else "FAIL",
            f"memfd: created, mapped, and opened again through /proc/{os.getpid()}/fd",
        )
    except (DevIpcError, OSError) as error:
        report(
            "FAIL",
            f"this process cannot open its own memfd through /proc ({error})",
            "mount procfs at /proc (a container's own /proc; `unshare --mount-proc`)",
        )
    finally:
        file.close()

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) != 1:
        report(
            "WARN",
            "this process is not dumpable: peers cannot open /proc/<pid>/fd of it "
            "(it changed user, or called prctl(PR_SET_DUMPABLE, 0))",
            "do not run producers setuid; or call prctl(PR_SET_DUMPABLE, 1)",
        )
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as scope:
            value = scope.read().strip()
        print(
            f"info  Yama ptrace_scope {value}: it restricts attaching only; opening "
            f"/proc/<pid>/fd is a read access it does not restrict",
            flush=True,
        )
    except OSError:
        print(
            "info  no Yama ptrace_scope here (it would restrict attaching only, not opening "
            "/proc/<pid>/fd)",
            flush=True,
        )
    if _capability(CAP_SYS_PTRACE):
        report("ok", f"CAP_SYS_PTRACE: held; uid {os.getuid()} can open peers of any user")
    else:
        report(
            "info",
            f"CAP_SYS_PTRACE: not held (a container's default): peers must run as uid "
            f"{os.getuid()}, as this process does",
            "for peers of other users: `docker run --cap-add SYS_PTRACE`, or run them as one user",
        )
    namespace = _pid_ns()
    if namespace == INIT_PID_NS:
        report("ok", "PID namespace: the host's")
    else:
        report(
            "info",
            f"PID namespace pid:[{namespace}], not the host's (a container): a peer "
            f"in another container reaches this process only inside one namespace; "
            f"check it with `devipc doctor --serve` here, `devipc doctor --peer "
            f"TOKEN` there",
        )
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < NOFILE_LOW:
        report(
            "WARN",
            f"ulimit -n is {soft}: each counter file and mapping a peer keeps open takes an fd",
            _nofile_fix(hard),
        )
    else:
        report("ok", f"ulimit -n {soft} (hard {hard})")
    try:
        shm = os.statvfs("/dev/shm")
        size, free = shm.f_blocks * shm.f_frsize, shm.f_bavail * shm.f_frsize
    except OSError:
        size = free = 0
    what = (
        f"/dev/shm: {size / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
        if size
        else "/dev/shm: missing"
    )
    if size < SHM_WARN_BYTES:
        report(
            "WARN",
            f"{what}: torch's own CPU tensor sharing (DataLoader workers, CPU "
            f"tensors in a Queue) needs room there; devipc's memfds do not",
            "docker run --shm-size=8g (or --ipc=host); Kubernetes: an emptyDir with "
            "medium: Memory mounted at /dev/shm",
        )
    else:
        report("ok", what)
    try:
        read_page(os.getpid())
        report("ok", f"stats page: `devipc info --pid {os.getpid()}` reads this process's")
    except StatsPageError as error:
        report("WARN", f"stats page: {error}")


def _nofile_fix(hard: int) -> str:
    """A command that raises the soft fd limit to NOFILE_WANT, or to the hard limit if lower;
    a hard limit below NOFILE_LOW only a privileged process (or the process's starter) raises."""
    if hard == resource.RLIM_INFINITY or hard >= NOFILE_LOW:
        wanted = NOFILE_WANT if hard == resource.RLIM_INFINITY else min(hard, NOFILE_WANT)
        return f"ulimit -n {wanted} in the shell that starts the processes"
    return (
        f"the hard limit is {hard} too, and only a privileged process raises it: `ulimit -n "
        f"{NOFILE_WANT}` as root before starting them, `docker run --ulimit "
        f"nofile={NOFILE_WANT}:{NOFILE_WANT}`, or LimitNOFILE={NOFILE_WANT} in a systemd "
        f"unit"
    )


def threads(report: Report, pages: dict[int, dict]) -> None:
    """Whether the other devipc processes on this host (their stats pages: `pages`; not this
    short-lived one) ask for more torch CPU threads than the cores they may run on: each takes
    one per core by default, and engines beside a trainer then fight over the cores."""
    cores = len(os.sched_getaffinity(0))
    counts = {}
    for pid, page in pages.items():  # any process may write such a page: read it warily
        stats = page.get("stats") if isinstance(page, dict) else None
        count = stats.get("torch_threads") if isinstance(stats, dict) else None
        if isinstance(count, int) and not isinstance(count, bool) and 0 < count < 1 << 16:
            counts[pid] = count
    total = sum(counts.values())
    if len(counts) > 1 and total > cores:
        share = max(1, cores // len(counts))
        report(
            "WARN",
            f"{len(counts)} devipc processes here (pids "
            f"{', '.join(map(str, sorted(counts)))}) ask for {total} torch CPU "
            f"threads in all, for {cores} cores: they slow each other down (engines "
            f"beside a trainer, each with a thread per core)",
            f"give each its share: torch.set_num_threads({share}) first thing, or "
            f"OMP_NUM_THREADS={share} in its environment before it starts",
        )
    elif counts:
        report(
            "ok",
            f"torch CPU threads: {total} for {cores} cores "
            f"({len(counts)} other devipc process(es) here)",
        )
    else:
        report("ok", "torch CPU threads: no other devipc process here")


def _child(inbox: Any, outbox: Any, modules: list[str]) -> None:
    """The doctor's peer: receives tensors and writes into them; serves a p2p read."""
    load_modules(modules)
    kept = None
    while True:
        try:
            item = inbox.get(timeout=60)
        except queue.Empty:
            break  # the doctor is gone
        except Exception as error:  # noqa: BLE001 - opening a handle fails in here
            outbox.put(("error", f"{type(error).__name__}: {error}"))
            continue
        if item is None:
            break
        try:
            if item[0] == "tensor":
                tensor = item[1]
                seen = float(tensor.sum())
                tensor.fill_(7)
                if tensor.device.type != "cpu":
                    synchronize(tensor.device)
                del tensor, item
                outbox.put(("ok", seen))
            else:  # ("p2p", device)
                endpoint = p2p.Endpoint()
                tensor, _ = p2p.create_tensor((16,), torch.float32, item[1])
                tensor.copy_(torch.arange(16.0))
                kept = (endpoint, tensor)
                outbox.put(("ok", endpoint.metadata(), endpoint.advertise(tensor)))
        except Exception as error:  # noqa: BLE001 - reported by the parent
            outbox.put(("error", f"{type(error).__name__}: {error}"))
    if kept is not None:
        kept[0].close()


def live(report: Report, types: list[str], timeout: float) -> None:
    """A round trip of a shared tensor per device through a spawned child, then a p2p read."""
    deadline = time.monotonic() + timeout
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(
        target=_child,
        args=(inbox, outbox, hook_modules(types)),
        daemon=True,
        name="devipc-doctor-peer",
    )
    child.start()

    def answer() -> Any:
        while True:
            with contextlib.suppress(queue.Empty):
                return outbox.get(timeout=0.2)
            if not child.is_alive() or time.monotonic() > deadline:
                raise TimeoutError(
                    f"the child (pid {child.pid}) did not answer within "
                    f"{timeout:.0f} s (exit code {child.exitcode})"
                )

    names = [*(f"{t}:0" for t in types), "cpu"]
    first = names[0]
    try:
        for name in names:
            tensor = torch.arange(16.0, device=name)
            if name == "cpu":
                tensor.share_memory_()
            start = time.perf_counter()
            inbox.put(("tensor", tensor))
            reply = answer()
            took = (time.perf_counter() - start) * 1e3
            if reply[0] != "ok":
                report(
                    "FAIL",
                    f"round trip {name}: the child could not open it: {reply[1]}",
                    _fix_for(reply[1]),
                )
            elif reply[1] != 120.0 or not bool((tensor.cpu() == 7).all()):
                report(
                    "FAIL",
                    f"round trip {name}: the child saw sum {reply[1]} (120 sent) and "
                    f"its write {'did not' if tensor.cpu()[0] != 7 else 'did'} reach "
                    f"this process: the memory is not shared",
                    "report this as a bug",
                )
            else:
                report(
                    "ok",
                    f"round trip {name}: child pid {child.pid} received a tensor through "
                    f"a torch.multiprocessing Queue, its write came back ({took:.0f} ms"
                    f"{', with its start' if name == first else ''})",
                )
        where = f"{types[0]}:0" if types else "cpu"
        inbox.put(("p2p", where))
        reply = answer()
        if reply[0] != "ok":
            report("FAIL", f"p2p: the child could not advertise a {where} tensor: {reply[1]}")
        else:
            with p2p.Endpoint() as endpoint:
                local = torch.zeros(16, device=where)
                endpoint.connect(reply[1]).read(local, reply[2])
                if torch.equal(local.cpu(), torch.arange(16.0)):
                    report(
                        "ok",
                        f"p2p: read the child's tensor on {where} through devipc.p2p.Endpoint()",
                    )
                else:
                    report("FAIL", "p2p: the read brought other bytes", "report this as a bug")
        inbox.put(None)
        child.join(max(1.0, deadline - time.monotonic()))
    except Exception as error:  # noqa: BLE001 - a finding, not a crash
        report("FAIL", f"live check: {type(error).__name__}: {error}", _fix_for(str(error)))
        if not isinstance(error, (DevIpcError, TimeoutError)):
            traceback.print_exc()
    finally:
        if child.is_alive():
            child.kill()
        child.join(5)


def _fix_for(message: str) -> str:
    if "permission denied" in message:
        return (
            "run consumers as the producer's user, in its PID namespace, and keep the "
            "producer dumpable; or give consumers CAP_SYS_PTRACE"
        )
    if "has exited" in message or "no longer open" in message:
        return "a peer in another PID namespace sees other pids: " + FIX_PID_NS
    return ""


def _identity() -> dict:
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            boot_id = boot.read().strip()
    except OSError:
        boot_id = ""
    return {
        "pid": os.getpid(),
        "uid": os.getuid(),
        "boot": boot_id,
        "pid_ns": _pid_ns(),
        "host": socket.gethostname(),
    }


def serve(timeout: float = 600.0) -> int:
    """The other side of `--peer`: a memfd a peer must open through /proc/<pid>/fd; 0 once a
    peer did (it writes the word it read, plus one), 1 when none did within `timeout`."""
    file = SharedFile(MAGIC, 4096)
    try:
        nonce = secrets.randbits(62)
        file.buffer.int64(0).value = nonce
        token = (
            TOKEN_PREFIX
            + base64.urlsafe_b64encode(
                json.dumps({**_identity(), "handle": file.handle.hex()}).encode()
            ).decode()
        )
        print(
            f"devipc doctor: serving a peer check for {timeout:.0f} s (pid {os.getpid()}). In "
            f"the other container, pod or process, run:\n\n    devipc doctor --peer {token}\n",
            flush=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if file.buffer.int64(1).value == nonce + 1:
                print(
                    "ok    a peer opened this process's memfd through /proc and read it: "
                    "sharing between the two works",
                    flush=True,
                )
                return 0
            time.sleep(0.05)
        print(
            f"FAIL  no peer opened the memfd within {timeout:.0f} s; run `devipc doctor "
            f"--peer TOKEN` there, it says what is wrong",
            flush=True,
        )
        return 1
    finally:
        file.close()


def parse_token(token: str) -> dict | None:
    """What a `--serve` token says of its process; None for anything else."""
    try:
        theirs = json.loads(base64.urlsafe_b64decode(token.removeprefix(TOKEN_PREFIX)))
        theirs["handle"] = bytes.fromhex(theirs["handle"])
        if (
            token.startswith(TOKEN_PREFIX)
            and len(theirs["handle"]) == HANDLE_SIZE
            and {"uid", "boot", "pid_ns", "host"} <= set(theirs)
        ):
            return theirs
    except (ValueError, TypeError, KeyError, binascii.Error):
        pass  # not a doctor's token: None says so
    return None


def check_peer(report: Report, theirs: dict) -> None:
    """Open the memfd of a `devipc doctor --serve` elsewhere; when it fails, say why and what to
    change, from what the two processes are (machine, PID namespace, user)."""
    handle = theirs["handle"]
    mine, pid = _identity(), handle_pid(handle)
    causes = []
    if theirs["boot"] != mine["boot"]:
        causes.append(
            (
                f"the peer (pid {pid} on {theirs['host']}) runs on another machine, VM or "
                f"kernel boot: same-host sharing cannot reach it",
                "move tensors between hosts with devipc.p2p.Endpoint(transport='nixl')",
            )
        )
    elif theirs["pid_ns"] != mine["pid_ns"]:
        causes.append(
            (
                f"the peer (pid {pid} there) runs in another PID namespace (pid:"
                f"[{theirs['pid_ns']}] there, pid:[{mine['pid_ns']}] here), as two "
                f"containers do: /proc/{pid}/fd here is not the peer's, so no handle of "
                f"it can be opened",
                FIX_PID_NS,
            )
        )
    if theirs["uid"] != mine["uid"] and not _capability(CAP_SYS_PTRACE):
        causes.append(
            (
                f"the peer runs as uid {theirs['uid']}, this process as uid {mine['uid']}, "
                f"without CAP_SYS_PTRACE: the kernel denies opening /proc/{pid}/fd",
                "run both as one user, or give the consumer CAP_SYS_PTRACE "
                "(`docker run --cap-add SYS_PTRACE`)",
            )
        )
    try:
        mapped = open_shared_file(handle, MAGIC)
    except (DevIpcError, OSError) as error:
        failure = f"{type(error).__name__}: {error}"
    else:
        mapped.int64(1).value = mapped.int64(0).value + 1
        mapped.close()
        report(
            "ok",
            f"peer: opened the memfd of pid {pid} ({theirs['host']}) through /proc: "
            f"handles of that process open here",
        )
        return
    for what, fix in causes:
        report("FAIL", f"peer: {what} (opening it said: {failure})", fix)
    if not causes:
        report(
            "FAIL",
            f"peer: the memfd of pid {pid} cannot be opened: {failure}",
            _fix_for(failure) or "keep the serving side running while the peer checks",
        )
