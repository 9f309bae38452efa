"""devipc.p2p's network path: NIXL's agent with its UCX backend (`Endpoint(transport="nixl")`).

Memory region and IPC handle together: the transport listens to the registry, so every
registration is registered with the agent too, as the memory kind the device's hooks report
(`IpcHooks.memory_kind`; CPU memory is DRAM), and deregistration undoes it. A device that
reports no kind is refused when the NIXL path is asked for it, not when it registers.

A descriptor's transport part names the agent, the memory kind, the address range and the
registration's own partial agent metadata: a peer loads it once per registration, so a peer that
connected before the registration reaches it too. The registry page (one word per registration:
its id while it lives, 0 after) is registered as well; before every transfer the peer reads the
words of the registrations it names, one small NIXL read, and raises RemoteTensorFreedError for
one that ended. The check happens before the transfer is posted: a deregistration that lands
while a transfer is in flight is not seen by it (over RDMA, the deregistration revokes the
remote key; over TCP or shared memory, nothing does).

NIXL parses its metadata blobs itself and can crash on damaged ones, so every NIXL part devipc
sends ends with a digest, checked before NIXL sees anything: damaged bytes are InvalidHandleError.
(Bytes forged with a matching digest still reach NIXL's parser: peers are trusted, as in NIXL.)

UCX reads and writes a transfer's local memory until its request completed, whatever the caller
dropped meanwhile (a transfer after its wait timed out, a read cut short by Ctrl-C), and a
cancelled RMA request may still be written into: so a request is never cancelled, and what it
uses (the local tensors, registrations made for it, the handles) is let go of only once NIXL says
it ended; requests nobody waits for any more are polled by a background thread until then.

A poll (`check_xfer_state`) progresses UCX in the calling thread and returns only once it handled
what had arrived: over TCP, a large transfer's poll can take seconds (512 MiB into fresh pages:
5 s in one call). Python handles signals between bytecodes only, so a caller polling a large
transfer could not be interrupted. Transfers of WATCHED_FROM bytes or more are therefore polled by
a watcher thread (NIXL releases the GIL in its calls); their callers wait on an event in slices of
_SLICE seconds, so that Ctrl-C lands between two (whichever thread the kernel gave the signal to).
When the watcher does not run (stopped at interpreter exit, or its thread failed to start), the
caller polls its transfer itself between two slices.
Smaller ones are polled by their caller: first without sleeping, then backing off.

NIXL is imported on first use: `import devipc.p2p` works without it.
"""

import bisect
import collections
import ctypes
import importlib
import logging
import sys
import threading
import types
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

import torch

from .._core import _wire
from .._core._background import Background
from .._core._backoff import Backoff
from .._core._devices import synchronize
from .._core._errors import (
    DevIpcError,
    InvalidHandleError,
    PeerGoneError,
    RemoteTensorFreedError,
    TransferSizeError,
    UnsupportedDeviceError,
)
from .._core._hooks import get_ipc_hooks
from ._descriptor import Descriptor, Metadata
from ._nixl_wire import KINDS, Remote, agent_metadata_from_bytes, agent_metadata_to_bytes
from ._registry import PAGE_BYTES, Registration, registry, word_offset
from ._transfer import Transfer
from ._transport import OPERATIONS, READ, WRITE

__all__ = ["NixlLink", "NixlPrepared", "NixlTransport", "load_nixl", "memory_kind", "new_agent"]

INSTALL = "pip install 'devipc[nixl]'"
LIVENESS_TIMEOUT = 30.0  # seconds a peer may take to answer the liveness read
_SCRATCH_WORDS = 4096  # liveness words read per NIXL request
_DECODED_MAX = 1 << 16
_AGAIN_KEPT = 64  # prepared pairs kept per transport for synchronous copies (`NixlLink.again`)
PROGRESS_DELAY_US = 100_000
WATCHED_FROM = 4 << 20  # bytes: transfers this large are polled by the watcher thread
_SLICE = 0.02  # seconds a caller waits on a watched transfer between looks at its signals
_api: types.ModuleType | None = None
_agent_lock = threading.Lock()
_log = logging.getLogger("devipc")


def load_nixl() -> types.ModuleType:
    """NIXL's agent API module (`nixl._api`), from whichever NIXL distribution is installed;
    ImportError saying how to install it when none is."""
    global _api
    if _api is not None:
        return _api
    for name in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            api = importlib.import_module(name)
        except ImportError as error:
            # a missing distribution, or the meta package finding no backend wheel: try the next
            if isinstance(error, ModuleNotFoundError) and error.name not in (
                name.split(".")[0],
                name,
            ):
                raise
            continue
        if not logging.getLogger("nixl").level < logging.INFO:
            logging.getLogger("nixl").setLevel(logging.WARNING)  # no INFO lines on stdout
        _api = api
        return api
    raise ImportError(
        f"devipc.p2p's NIXL transport needs NIXL, which is not installed: {INSTALL}"
    ) from None


def new_agent(name: str) -> Any:
    """A NIXL agent with the UCX backend whose progress thread waits for events: NIXL's Python API
    asks for a poll delay of 0, a busy loop that keeps one core spinning for as long as the agent
    lives; any delay makes the thread sleep in poll() on UCX's event fd, woken by what arrives,
    and transfers posted here progress in the calling thread anyway. The delay only bounds that
    sleep when nothing comes: at 0.1 ms an idle agent took 1.3% of a core, at 100 ms 0.04%
    (a relay's fleet runs 2 to 3 agents an engine), with no change in a read's round trip.

    The delay cannot be set through NIXL's configuration: `nixl_agent_config` has no field for it
    and `nixl_agent.__init__` writes `pthrDelay = 0` into the bind config it builds (nixl 1.5.1).
    Turning the progress thread off instead (`enable_prog_thread=False`) would leave an owner,
    which runs no code for a transfer, unable to serve UCX's TCP transport. So for the one call
    that builds the agent, under a lock, the bind's config constructor is given the delay."""
    api = load_nixl()
    bind, config = api.nixlBind, api.nixl_agent_config(backends=["UCX"])
    real = getattr(bind, "nixlAgent", None)
    if real is None:  # another NIXL layout: its defaults
        return api.nixl_agent(name, config)

    def make(agent_name: str, agent_config: Any) -> Any:
        agent_config.pthrDelay = PROGRESS_DELAY_US
        return real(agent_name, agent_config)

    with _agent_lock:
        bind.nixlAgent = make
        try:
            return api.nixl_agent(name, config)
        finally:
            bind.nixlAgent = real


def memory_kind(device: torch.device) -> str:
    """What `device`'s memory is to NIXL: the device's hooks say (`IpcHooks.memory_kind`)."""
    if device.type == "cpu":
        return "DRAM"
    hooks = get_ipc_hooks(device.type)
    kind = None if hooks is None else hooks.memory_kind(device.index or 0)
    if kind not in KINDS:
        raise UnsupportedDeviceError(
            f"{device} memory cannot be registered with NIXL: its IPC hooks' memory_kind("
            f"{device.index or 0}) says {kind!r}, not one of {KINDS}. Implement "
            f"IpcHooks.memory_kind for {device.type!r}, or use the same-host transport."
        )
    return kind


def _dev_id(device: torch.device, kind: str) -> int:
    return 0 if kind == "DRAM" else device.index or 0


class _Local:
    """One of this process's NIXL registrations (a devipc registration or the registry page)."""

    __slots__ = ("base", "end", "kind", "dev_id", "dlist", "partial")

    def __init__(
        self, base: int, nbytes: int, kind: str, dev_id: int, dlist: object, partial: bytes
    ):
        self.base, self.end, self.kind, self.dev_id = base, base + nbytes, kind, dev_id
        self.dlist, self.partial = dlist, partial


class _Pending:
    """Posted NIXL requests (`handles`, their `states`) and what must live until NIXL is done with
    every one of them: what `release` lets go of."""

    __slots__ = ("handles", "states", "owned", "dlists", "temps", "keep", "ended", "agent")

    def __init__(self, owned: Sequence[object] = (), keep: object = None):
        self.agent: str | None = None  # the peer its requests went to, once posted
        self.handles: list = []
        self.states: list[str] = []
        self.owned = list(owned)  # handles released with it
        self.dlists: list = []  # prepared descriptor lists released with it
        self.temps: list[_Local] = []  # registrations made for it
        self.keep = keep  # the local tensors
        self.ended: threading.Event | None = None  # set by the watcher, when it polls them

    def post(self, transport: "NixlTransport", handle: object, agent: str) -> None:
        """Post `handle` (a request of this one, released with it when `owned`). Until NIXL
        said otherwise it may be in flight (Ctrl-C may cut the call short after it posted)."""
        self.agent = agent
        self.handles.append(handle)
        self.states.append("PROC")
        self.states[-1] = transport.post_handle(handle, agent)

    def poll(self, nixl: Any) -> bool:
        """Whether every request ended (done or failed)."""
        for i, handle in enumerate(self.handles):
            if self.states[i] == "PROC":
                try:
                    self.states[i] = nixl.check_xfer_state(handle)
                except Exception:  # noqa: BLE001 - NIXL's own: the peer left, or never posted
                    self.states[i] = "ERR"
        return "PROC" not in self.states

    def release(self, transport: "NixlTransport") -> Exception | None:
        """Let go of everything, NIXL being done: the first error releasing a handle, if any."""
        nixl, error = transport.agent, None
        if nixl is not None:  # else the transport closed: NIXL let go of it all
            for handle in self.owned:
                try:
                    nixl.release_xfer_handle(handle)
                except Exception as failed:  # noqa: BLE001 - NIXL's own exception types
                    error = error or failed
            for dlist in self.dlists:
                nixl.release_dlist_handle(dlist)
            for temp in self.temps:
                transport.deregister_range(temp)
        self.owned, self.dlists, self.temps, self.keep = [], [], [], None
        return error

    def outcome(self, agent: str, error: Exception | None) -> BaseException | None:
        """What the transfer failed with, once released (`error`: its release's)."""
        if "PROC" in self.states:  # still in flight when the endpoint closed: kept for good
            return ValueError("the NIXL transport was closed before this transfer ended")
        if "ERR" in self.states:
            return PeerGoneError(
                f"a NIXL transfer with agent {agent!r} failed: the peer "
                f"exited, closed its endpoint, or its memory is no longer "
                f"registered"
            )
        return None if error is None else _nixl_error(error, agent)


# Requests nobody waits for any more (`NixlTransfer` dropped in flight, a wait cut short), and
# their transports: appended without a lock (a finalizer may), let go of by the reaper's rounds.
_abandoned: collections.deque = collections.deque()
_stranded: list = []  # still in flight when their endpoint closed: kept for the process's life


def _reap_round() -> bool:
    """A round of the reaper thread: let go of the abandoned requests NIXL is done with."""
    for _ in range(len(_abandoned)):
        transport, pending = _abandoned.popleft()
        if not transport.done_with(pending):
            _abandoned.append((transport, pending))
    return bool(_abandoned)


_reaper = Background("devipc-nixl-reaper", _reap_round)


def _abandon(transport: "NixlTransport", pending: _Pending) -> None:
    """Nobody waits for `pending` any more: the reaper lets go of it once NIXL is done. No lock:
    a finalizer may call it."""
    _abandoned.append((transport, pending))
    _reaper.wake()


# Large transfers that callers wait for without polling NIXL themselves (see the module's doc).
_watched: collections.deque = collections.deque()


def _watch_round() -> bool:
    """A round of the watcher thread: poll each watched transfer, set `ended` of those that
    ended (they are let go of by their caller, or by the reaper once dropped)."""
    for _ in range(len(_watched)):
        transport, pending = _watched.popleft()
        with transport.lock:
            ended = pending not in transport.in_flight or pending.poll(transport.agent)
        if ended:
            pending.ended.set()
        else:
            _watched.append((transport, pending))
    return bool(_watched)


_watcher = Background("devipc-nixl-watcher", _watch_round, interval=0.0002, share=None)


def _watch(transport: "NixlTransport", pending: _Pending, nbytes: int) -> None:
    """From now on, a transfer of `nbytes` is polled by the watcher thread if it is large."""
    if nbytes >= WATCHED_FROM:
        pending.ended = threading.Event()
        _watched.append((transport, pending))
        _watcher.wake()


class NixlTransport:
    """One NIXL agent (UCX backend) of an endpoint; thread-safe (one lock around the agent).
    A `_transport.Transport`, and a registry listener. Its public members beyond the protocol
    (`agent`, `lock`, `in_flight`, the range and request methods) serve the link, prepared
    transfers and transfers below; the underscored ones are its own."""

    name = "nixl"

    def __init__(self, agent_name: str):
        self.agent_name = agent_name
        self.lock = threading.RLock()
        self.agent = new_agent(agent_name)
        if "UCX" not in self.agent.backends:
            raise DevIpcError("NIXL's UCX backend could not be created on this machine")
        self._regs: dict[int, _Local | None] = {}  # registration id -> NIXL side (None: no kind)
        self._bases: list[int] = []  # sorted bases of self._ranges
        self._ranges: list[_Local] = []
        self._peers: dict[str, set[int]] = {}  # agent -> registration ids whose metadata is loaded
        # agent -> connections to it. An agent loaded without one had requests in flight when
        # its last connection closed: unloaded once they ended, as NIXL fails the requests of
        # an agent it unloads at once while UCX may still write their replies (a frozen peer's,
        # once it runs again) into their memory
        self._links: dict[str, int] = {}
        self._decoded = _wire.Decoded(Remote.from_bytes, _DECODED_MAX)
        self.in_flight: set[_Pending] = set()  # posted, not let go of yet
        # (agent, op, local address, id(descriptor), liveness) -> (descriptor, local range,
        # its NIXL requests prepared): synchronous copies of one pair made again (`again`)
        self._again: dict[tuple, tuple[Descriptor, _Local, NixlPrepared]] = {}
        self._page = self.register_range(registry.page().buffer.address, PAGE_BYTES, "DRAM", 0)
        self._scratch = torch.zeros(_SCRATCH_WORDS, dtype=torch.int64)  # liveness words land here
        self.scratch_registration = self.register_range(
            self._scratch.data_ptr(), 8 * _SCRATCH_WORDS, "DRAM", 0
        )
        self._closed = False  # the endpoint adds this transport as a registry listener

    # -- this process's memory --
    def register_range(self, addr: int, nbytes: int, kind: str, dev_id: int) -> _Local:
        dlist = self.agent.register_memory([(addr, nbytes, dev_id, "")], kind)
        partial = self.agent.get_partial_agent_metadata(dlist, inc_conn_info=False)
        local = _Local(addr, nbytes, kind, dev_id, dlist, partial)
        at = bisect.bisect(self._bases, addr)
        self._bases.insert(at, addr)
        self._ranges.insert(at, local)
        return local

    def deregister_range(self, local: _Local) -> None:
        self._forget_again(lambda entry: entry[1] is local)
        at = self._ranges.index(local)
        del self._bases[at], self._ranges[at]
        self.agent.deregister_memory(local.dlist)

    def on_register(self, reg: Registration) -> None:
        """Registry listener: register the storage's memory with the agent too."""
        try:
            kind = memory_kind(reg.device)
        except UnsupportedDeviceError:
            kind = None  # refused when a descriptor of it is asked for
        with self.lock:
            if self._closed or reg.id in self._regs:
                return
            self._regs[reg.id] = (
                None
                if kind is None
                else self.register_range(reg.base, reg.nbytes, kind, _dev_id(reg.device, kind))
            )

    def on_deregister(self, reg: Registration) -> None:
        with self.lock:
            local = self._regs.pop(reg.id, None)
            if local is not None and not self._closed:
                self.deregister_range(local)

    def registered(self, reg_id: int) -> bool:
        """Whether the registration's memory is registered with this agent now."""
        with self.lock:
            return self._regs.get(reg_id) is not None

    def find_range(self, addr: int, nbytes: int) -> _Local | None:
        at = bisect.bisect(self._bases, addr) - 1
        if at >= 0 and addr + nbytes <= self._ranges[at].end:
            return self._ranges[at]
        return None

    # -- what peers need --
    def metadata(self) -> bytes:
        with self.lock:
            return agent_metadata_to_bytes(self.agent_name, self.agent.get_agent_metadata())

    def describe(self, reg: Registration, offset: int, nbytes: int) -> dict:
        extra = self.descriptor_extra(reg, offset, nbytes)
        if reg.device.type != "cpu":  # no events across hosts: the queued work ends now
            synchronize(reg.device)
        return {"extra": extra}

    def descriptor_extra(self, reg: Registration, offset: int, nbytes: int) -> bytes:
        if reg.id not in self._regs:
            self.on_register(reg)  # registered before this transport listened
        local = self._regs.get(reg.id)
        if local is None:
            memory_kind(reg.device)  # raises, saying why
            raise ValueError(f"registration {reg.id} ended")
        return Remote(
            self.agent_name,
            local.kind,
            local.dev_id,
            reg.base + offset,
            nbytes,
            reg.id,
            reg.slot,
            self._page.base,
            local.partial,
        ).to_bytes()

    def connect(self, meta: Metadata) -> "NixlLink":
        return NixlLink(self, self.add_peer(meta.extra))

    def add_peer(self, peer_metadata: bytes) -> str:
        """Load a peer agent's metadata (once per connection to it); the agent's name."""
        name, blob = agent_metadata_from_bytes(peer_metadata)
        with self.lock:
            if self._closed:
                raise ValueError("this NIXL transport is closed")
            try:
                agent = self.agent.add_remote_agent(blob)
            except Exception as error:  # noqa: BLE001 - NIXL's own exception types
                raise InvalidHandleError(
                    f"NIXL could not load the peer's agent metadata: "
                    f"{type(error).__name__}: {error}"
                ) from None
            agent = agent.decode() if isinstance(agent, bytes) else str(agent)
            if agent != name:
                self.agent.remove_remote_agent(agent)
                raise InvalidHandleError(
                    f"NIXL metadata of agent {agent!r} claims to be of {name!r}"
                )
            self._peers.setdefault(agent, set())
            self._links[agent] = self._links.get(agent, 0) + 1
        return agent

    def disconnect(self, agent: str) -> None:
        """One connection to `agent` closed: the agent is unloaded with the last one."""
        with self.lock:
            links = self._links.pop(agent, 0) - 1
            if links > 0:
                self._links[agent] = links
            elif agent in self._peers and not self._closed:
                self._forget_again(lambda entry: entry[2].agent == agent)
                if all(pending.agent != agent for pending in self.in_flight):
                    self._unload(agent)

    def _unload(self, agent: str) -> None:
        del self._peers[agent]
        self.agent.remove_remote_agent(agent)

    # -- synchronous copies of one pair, prepared once (under the lock) --
    def again(self, link: "NixlLink", op: str, local: torch.Tensor, desc: Descriptor) -> bool:
        """`op` of `local` and the whole range of `desc`, through NIXL requests prepared at the
        pair's first copy and kept while its local registration and the peer's agent are loaded
        (`_AGAIN_KEPT` pairs at most): a repost and its wait, as NIXL's own prepared transfer.
        False, for the caller's full path, where the local memory is not a devipc registration
        or an earlier copy of the pair is still in flight (its wait was cut short)."""
        if not local.is_contiguous():
            return False  # a pair's key is its address: a strided view would take its request
        address = local.data_ptr()
        key = (link.agent, op, address, id(desc), link.liveness)
        with self.lock:
            entry = self._again.get(key)  # holds the descriptor: its id is not reused
            if entry is None:
                found = self.find_range(address, desc.nbytes)
                if (
                    self._closed
                    or found is None
                    or found is self._page
                    or found is self.scratch_registration
                ):
                    return False
                if len(self._again) >= _AGAIN_KEPT:
                    self._forget_again(lambda entry: True)
                remotes = self.remotes(
                    link.agent, [(address, desc.nbytes, local.device)], [desc.extra], [desc.shift]
                )
                entry = self._again[key] = (
                    desc,
                    found,
                    NixlPrepared(
                        self,
                        link.agent,
                        op,
                        [(address, desc.nbytes, local.device)],
                        remotes,
                        [],
                        link.liveness,
                    ),
                )
            prepared = entry[2]
            if desc.nbytes >= WATCHED_FROM:  # waited for as any large transfer
                transfer = prepared.repost(local)
            else:
                posted = prepared.start(local)
        if desc.nbytes >= WATCHED_FROM:
            if transfer is None:
                return False
            transfer.wait()
            return True
        return posted is not None and prepared.finish_here(posted)

    def _forget_again(self, which: Callable[[tuple], bool]) -> None:
        for key in [key for key, entry in self._again.items() if which(entry)]:
            entry = self._again.pop(key, None)
            if entry is not None:
                entry[2].close()

    # -- transfers --
    def agent_or_raise(self) -> Any:
        """The agent; ValueError once closed. Call with the lock."""
        if self._closed or self.agent is None:
            raise ValueError("this NIXL transport is closed")
        return self.agent

    def _decode(self, extra: bytes) -> Remote:
        return self._decoded.decode(bytes(extra))

    def remotes(
        self,
        remote_agent: str,
        local: Sequence[tuple[int, int, torch.device]],
        remote_extras: Sequence[bytes],
        shifts: Sequence[int] | None = None,
    ) -> list[Remote]:
        """The peer descriptors' transport parts, checked against `local` (addr, nbytes,
        device) and narrowed to start `shifts` bytes in (sub-ranges)."""
        if len(local) != len(remote_extras):
            raise ValueError(f"{len(local)} local ranges for {len(remote_extras)} remote ones")
        remotes = [self._decode(extra) for extra in remote_extras]
        for i, ((_, nbytes, _), remote) in enumerate(zip(local, remotes)):
            if remote.agent != remote_agent:
                raise InvalidHandleError(
                    f"a descriptor of NIXL agent {remote.agent!r} used on "
                    f"the connection to {remote_agent!r}"
                )
            shift = 0 if shifts is None else shifts[i]
            if shift + nbytes > remote.nbytes or (shifts is None and nbytes != remote.nbytes):
                raise TransferSizeError(
                    f"local range of {nbytes} bytes from byte {shift} of a "
                    f"remote range of {remote.nbytes}"
                )
            if shift or nbytes != remote.nbytes:
                remotes[i] = replace(remote, addr=remote.addr + shift, nbytes=nbytes)
        return remotes

    def post_ranges(
        self,
        op: str,
        remote_agent: str,
        local: Sequence[tuple[int, int, torch.device]],
        remote_extras: Sequence[bytes],
        shifts: Sequence[int] | None = None,
        keep: object = None,
        liveness: bool = True,
    ) -> "NixlTransfer":
        """Start `op` ("READ": remote into local, "WRITE": local into remote) for each pair of
        `local` (addr, nbytes, device) and a peer descriptor's transport part (from `shifts`
        bytes in, when given). `keep` (what holds the local memory) lives until NIXL is done.
        `liveness`: first read the registry words of the registrations (one round trip)."""
        if op not in OPERATIONS:
            raise ValueError(f"op is {READ!r} or {WRITE!r}, not {op!r}")
        remotes = self.remotes(remote_agent, local, remote_extras, shifts)
        with self.lock:
            if self._closed:
                raise ValueError("this NIXL transport is closed")
            if remote_agent not in self._peers:
                raise ValueError(f"not connected to NIXL agent {remote_agent!r}")
            self.load_remotes(remote_agent, remotes)
            if liveness:
                self._check_alive(remote_agent, remotes)
            return self._start(op, remote_agent, local, remotes, keep)

    def load_remotes(self, agent: str, remotes: Iterable[Remote]) -> None:
        """Load each registration's partial metadata the first time it is used."""
        loaded = self._peers[agent]
        for remote in remotes:
            if remote.reg_id not in loaded:
                try:
                    name = self.agent.add_remote_agent(remote.partial)
                except Exception as error:  # noqa: BLE001
                    # NIXL's own exception types, said as devipc's
                    raise InvalidHandleError(
                        f"NIXL could not load a descriptor's metadata: "
                        f"{type(error).__name__}: {error}"
                    ) from None
                if (name.decode() if isinstance(name, bytes) else str(name)) != agent:
                    raise InvalidHandleError("a descriptor's metadata names another agent")
                loaded.add(remote.reg_id)

    def _check_alive(self, agent: str, remotes: Iterable[Remote]) -> None:
        """Read the registry words of the registrations `remotes` name; raise for ended ones."""
        words = {(r.page, r.slot): r.reg_id for r in remotes}
        items = list(words.items())
        for start in range(0, len(items), _SCRATCH_WORDS):
            chunk = items[start : start + _SCRATCH_WORDS]
            scratch = self.scratch_registration.base
            local = [(scratch + 8 * i, 8, 0) for i in range(len(chunk))]
            remote = [(page + word_offset(slot), 8, 0) for (page, slot), _ in chunk]
            handle = self._request(READ, agent, local, "DRAM", remote, "DRAM")
            self.finish_now(_Pending(owned=[handle]), handle, agent)
            for i, (_, reg_id) in enumerate(chunk):
                if int(self._scratch[i]) != reg_id:
                    raise RemoteTensorFreedError(
                        f"remote tensor {reg_id} of NIXL agent {agent!r} was freed or "
                        f"deregistered by its owner. Ask the owner for a new descriptor."
                    )

    def finish_now(self, pending: _Pending, handle: object, agent: str) -> None:
        """Post `handle` as `pending`'s one request (a liveness read, a few µs as a rule) and
        wait for it here; a wait cut short (no answer, Ctrl-C) leaves it to the reaper."""
        self.in_flight.add(pending)
        try:
            pending.post(self, handle, agent)
            backoff = Backoff(LIVENESS_TIMEOUT, first=0.0002, longest=0.0002, spins=1000)
            while not pending.poll(self.agent):
                backoff.pause()
                if backoff.expired():
                    raise PeerGoneError(
                        f"NIXL agent {agent!r} did not answer within {LIVENESS_TIMEOUT} s"
                    )
        except BaseException:
            self.let_go(pending)
            raise
        self.settle(pending)
        if pending.states != ["DONE"]:
            raise PeerGoneError(
                f"NIXL could not read NIXL agent {agent!r}'s registry: the "
                f"peer closed its endpoint or exited"
            )

    def post_handle(self, handle: object, agent: str) -> str:
        try:
            return self.agent.transfer(handle)
        except Exception as error:  # noqa: BLE001 - NIXL's own exception types, said as devipc's
            raise _nixl_error(error, agent) from None

    def _request(
        self,
        op: str,
        agent: str,
        local: list[tuple[int, int, int]],
        local_kind: str,
        remote: list[tuple[int, int, int]],
        remote_kind: str,
    ) -> object:
        try:
            return self.agent.initialize_xfer(
                op,
                self.agent.get_xfer_descs(local, local_kind),
                self.agent.get_xfer_descs(remote, remote_kind),
                agent,
            )
        except Exception as error:  # noqa: BLE001 - NIXL's own exception types, said as devipc's
            raise _nixl_error(error, agent) from None

    def _start(
        self,
        op: str,
        agent: str,
        local: Iterable[tuple[int, int, torch.device]],
        remotes: Iterable[Remote],
        keep: object,
    ) -> "NixlTransfer":
        groups: dict[tuple[str, str], tuple[list, list]] = {}
        pending = _Pending(keep=keep)
        self.in_flight.add(pending)
        total = 0
        try:
            for (addr, nbytes, device), remote in zip(local, remotes):
                total += nbytes
                if nbytes == 0:
                    continue
                found = self.find_range(addr, nbytes)
                if found is None:  # memory devipc does not hold registered: for this transfer
                    kind = memory_kind(device)
                    found = self.register_range(addr, nbytes, kind, _dev_id(device, kind))
                    pending.temps.append(found)
                pair = groups.setdefault((found.kind, remote.kind), ([], []))
                pair[0].append((addr, nbytes, found.dev_id))
                pair[1].append((remote.addr, nbytes, remote.dev_id))
            for (local_kind, remote_kind), (mine, theirs) in groups.items():
                handle = self._request(op, agent, mine, local_kind, theirs, remote_kind)
                pending.owned.append(handle)
                pending.post(self, handle, agent)
        except BaseException:
            self.let_go(pending)  # what was posted still lands: once it did
            raise
        return NixlTransfer(self, agent, pending, total)

    # -- requests in flight (under the lock) --
    def done_with(self, pending: _Pending) -> bool:
        """Whether NIXL is done with `pending`'s requests; if so, what they used is let go of."""
        with self.lock:
            if pending not in self.in_flight:
                return True  # let go of already
            if not pending.poll(self.agent):
                return False
            self.settle(pending)
            return True

    def let_go(self, pending: _Pending) -> None:
        """Nobody will wait for `pending`: let go of it now if NIXL is done, else once it is."""
        if not self.done_with(pending):
            _abandon(self, pending)

    def settle(self, pending: _Pending) -> Exception | None:
        self.in_flight.discard(pending)
        agent = pending.agent
        if (
            agent in self._peers
            and agent not in self._links
            and not self._closed
            and all(other.agent != agent for other in self.in_flight)
        ):
            self._unload(agent)
        return pending.release(self)

    def _drain(self) -> None:
        """Closing: wait for the requests in flight (their peer answers or fails them), then let
        go of them. One that outlives LIVENESS_TIMEOUT keeps its memory for the process's life
        rather than having it written into once reused."""
        backoff = Backoff(LIVENESS_TIMEOUT, first=0.0002, longest=0.01)
        while self.in_flight:
            for pending in [p for p in self.in_flight if p.poll(self.agent)]:
                self.settle(pending)
            if self.in_flight and backoff.expired():
                _log.warning(
                    "devipc.p2p: %d NIXL transfers did not end within %s s of their "
                    "endpoint's close: their memory is kept",
                    len(self.in_flight),
                    LIVENESS_TIMEOUT,
                )
                _stranded.extend(self.in_flight)
                self.in_flight.clear()
            elif self.in_flight:
                backoff.pause()

    def close(self) -> None:
        """Wait for the transfers in flight, deregister everything from the agent and let the
        agent go. Idempotent."""
        registry.remove_listener(self)
        with self.lock:
            if self._closed:
                return
            self._forget_again(lambda entry: True)
            self._closed = True
            self._drain()
            for agent in list(self._peers):
                self.agent.remove_remote_agent(agent)
            for local in list(self._ranges):
                self.deregister_range(local)
            self._peers.clear()
            self._links.clear()
            self._regs.clear()
            self.agent = None


class NixlLink:
    """A connection's peer agent: loaded while the link is open."""

    sub_ranges = True  # `shift` is added to the address the descriptor's NIXL part names

    def __init__(self, transport: NixlTransport, agent: str):
        self._transport, self.agent = transport, agent
        self.liveness = True  # a post first reads the peer's registry words (`Connection`)

    def mapped(self) -> int:
        return 0

    def close(self) -> None:
        self._transport.disconnect(self.agent)

    def _ranges(self, locals_: list, descs: list[Descriptor]) -> list:
        local = []
        for tensor, desc in zip(locals_, descs):
            if not desc.extra:
                raise InvalidHandleError(
                    "this descriptor carries no NIXL part: advertise it "
                    "from an Endpoint(transport='nixl')"
                )
            if not tensor.is_contiguous():
                raise ValueError("the NIXL path moves contiguous local tensors only")
            local.append((tensor.data_ptr(), desc.nbytes, tensor.device))
        return local

    def post(self, op: str, locals_: list, descs: list[Descriptor], wait: bool) -> Transfer:
        local = self._ranges(locals_, descs)
        _synchronize({tensor.device for tensor in locals_})
        handle = self._transport.post_ranges(
            op,
            self.agent,
            local,
            [desc.extra for desc in descs],
            [desc.shift for desc in descs],
            locals_,
            self.liveness,
        )
        return Transfer(handle=handle, keep=(locals_,))

    def again(self, op: str, local: torch.Tensor, desc: Descriptor) -> bool:
        """The connection's shortcut for a synchronous `read`/`write` of one whole descriptor:
        whether it was made (`NixlTransport.again`), else the caller's `post` makes it."""
        if not desc.extra:
            return False  # `post` says why
        if not local.is_cpu:
            _synchronize((local.device,))
        return self._transport.again(self, op, local, desc)

    def prepare(self, op: str, locals_: list, descs: list[Descriptor]) -> "NixlPrepared":
        local = self._ranges(locals_, descs)
        remotes = self._transport.remotes(
            self.agent, local, [desc.extra for desc in descs], [desc.shift for desc in descs]
        )
        return NixlPrepared(self._transport, self.agent, op, local, remotes, locals_)


def _synchronize(devices: Iterable[torch.device]) -> None:
    """NIXL moves the bytes outside the devices' streams: the work queued on them first."""
    for device in devices:
        if device.type != "cpu":
            synchronize(device)


class NixlPrepared:
    """NIXL's prepared descriptor lists (`prep_xfer_dlist`) and requests (`make_prepped_xfer`)
    made once: a post is the liveness read and one `transfer` per memory-kind pair (one, as a
    rule), both prepared handles reposted."""

    def __init__(
        self,
        transport: NixlTransport,
        agent: str,
        op: str,
        local: list,
        remotes: list[Remote],
        keep: list,
        liveness: bool = True,
    ):
        self._transport, self._agent = transport, agent
        self._devices = {device for _, _, device in local if device.type != "cpu"}
        self._nbytes = sum(nbytes for _, nbytes, _ in local)
        self._dlists: list = []
        self._temps: list[_Local] = []
        self.handles: list = []
        self._keep: list | None = keep  # None once closed
        self._in_flight: _Pending | None = None  # the last post, or its liveness read
        self._live: object | None = None  # the prepared read of the registrations' words
        self._ids: list[int] = []
        self._read: ctypes.Array[ctypes.c_int64] = (ctypes.c_int64 * 0)()
        with transport.lock:
            nixl = transport.agent_or_raise()
            try:
                transport.load_remotes(agent, remotes)
                groups: dict[tuple[str, str], tuple[list, list]] = {}
                for (addr, nbytes, device), remote in zip(local, remotes):
                    if nbytes == 0:
                        continue
                    found = transport.find_range(addr, nbytes)
                    if found is None:  # memory devipc does not hold registered: while prepared
                        kind = memory_kind(device)
                        found = transport.register_range(addr, nbytes, kind, _dev_id(device, kind))
                        self._temps.append(found)
                    pair = groups.setdefault((found.kind, remote.kind), ([], []))
                    pair[0].append((addr, nbytes, found.dev_id))
                    pair[1].append((remote.addr, nbytes, remote.dev_id))
                for (local_kind, remote_kind), (mine, theirs) in groups.items():
                    self.handles.append(self._prepped(op, mine, local_kind, theirs, remote_kind))
                words = (
                    sorted({(r.page + word_offset(r.slot), r.reg_id) for r in remotes})
                    if liveness
                    else []
                )
                if len(words) > _SCRATCH_WORDS:
                    raise ValueError(
                        f"a prepared NIXL transfer reaches at most "
                        f"{_SCRATCH_WORDS} registrations, not {len(words)}: "
                        f"prepare it in parts"
                    )
                scratch = transport.scratch_registration.base
                self._ids = [reg_id for _, reg_id in words]
                self._read = (ctypes.c_int64 * len(words)).from_address(scratch)  # lands there
                self._live = (
                    self._prepped(
                        READ,
                        [(scratch + 8 * i, 8, 0) for i in range(len(words))],
                        "DRAM",
                        [(word, 8, 0) for word, _ in words],
                        "DRAM",
                    )
                    if words
                    else None
                )
            except BaseException:
                self._release(nixl)
                raise

    def _prepped(
        self, op: str, mine: list, local_kind: str, theirs: list, remote_kind: str
    ) -> object:
        nixl = self._transport.agent
        try:
            ours = nixl.prep_xfer_dlist("NIXL_INIT_AGENT", mine, local_kind)
            self._dlists.append(ours)
            peer = nixl.prep_xfer_dlist(self._agent, theirs, remote_kind)
            self._dlists.append(peer)
            indices = list(range(len(mine)))
            return nixl.make_prepped_xfer(op, ours, indices, peer, indices)
        except Exception as error:  # noqa: BLE001 - NIXL's own exception types
            raise _nixl_error(error, self._agent) from None

    @property
    def agent(self) -> str:
        return self._agent

    def post(self) -> Transfer:
        _synchronize(self._devices)
        transfer = self.repost()
        if transfer is None:
            raise ValueError(
                "the previous post of this prepared transfer is still in "
                "flight: wait for it before posting again"
            )
        return transfer

    def repost(self, keep: object = None) -> Transfer | None:
        """A post (`keep`, else the local tensors prepared, held until NIXL is done with it);
        None while the previous one is still in flight."""
        with self._transport.lock:
            posted = self.start(keep)
            if posted is None:
                return None
            transfer = NixlTransfer(self._transport, self._agent, posted, self._nbytes)
        return Transfer(handle=transfer)

    def finish_here(self, posted: _Pending) -> bool:
        """Wait for a post (`start`) here, polling first without sleeping (a small transfer:
        its polls are short; NIXL may end it inside its post); True, or what it failed with.
        Cut short (Ctrl-C), it is left to the reaper."""
        transport = self._transport
        error, backoff = None, Backoff(None, first=0.0002, longest=0.0002, spins=1000)
        try:
            while True:
                with transport.lock:
                    if posted not in transport.in_flight:
                        break  # let go of by the transport's close
                    if posted.poll(transport.agent):
                        error = transport.settle(posted)
                        break
                backoff.pause()
        except BaseException:
            transport.let_go(posted)
            raise
        failure = posted.outcome(self._agent, error)
        if failure is not None:
            raise failure
        return True

    def start(self, keep: object) -> _Pending | None:
        """Under the lock: a post (`keep` held until NIXL is done with it): the liveness read,
        then the prepared requests posted; None while the previous post is still in flight."""
        transport, agent = self._transport, self._agent
        transport.agent_or_raise()
        if self._keep is None:
            raise ValueError("this prepared transfer is closed: prepare it again")
        if self._in_flight is not None and not transport.done_with(self._in_flight):
            return None
        if self._live is not None:
            self._in_flight = live = _Pending()
            transport.finish_now(live, self._live, agent)
            words = self._read[:]
            if words != self._ids:
                ended = next(i for w, i in zip(words, self._ids) if w != i)
                raise RemoteTensorFreedError(
                    f"remote tensor {ended} of NIXL agent {agent!r} was freed or "
                    f"deregistered by its owner. Ask the owner for a new descriptor."
                )
        # kept, should it be closed
        self._in_flight = posted = _Pending(keep=self._keep if keep is None else keep)
        transport.in_flight.add(posted)
        try:
            for handle in self.handles:
                posted.post(transport, handle, agent)
        except BaseException:
            transport.let_go(posted)
            raise
        return posted

    def close(self) -> None:
        with self._transport.lock:
            self._release(self._transport.agent)

    def _release(self, nixl: Any) -> None:
        """Let go of the prepared requests and lists, the registrations made for them and the
        local tensors: now, or once the post still in flight ended."""
        transport, posted = self._transport, self._in_flight
        if nixl is not None:  # else the transport closed, and NIXL let go of it all
            gone = posted if posted is not None and not transport.done_with(posted) else _Pending()
            gone.owned += [*self.handles, *([self._live] if self._live else [])]
            gone.dlists += self._dlists
            gone.temps += self._temps
            gone.keep = self._keep if gone.keep is None else gone.keep  # a repost's own
            transport.in_flight.add(gone)
            transport.let_go(gone)
        self.handles, self._live, self._dlists, self._temps, self._keep = [], None, [], [], None
        self._in_flight = None


class NixlTransfer:
    """NIXL requests in flight for one post (of `nbytes` in all); `done()` / `wait(timeout)`.
    Dropped before they ended, they are left to the reaper, with what they use. Made under the
    transport's lock: a small one is polled at once (its failure to post raised here), a large
    one handed to the watcher."""

    __slots__ = ("_transport", "_agent", "_pending", "_finished", "_error")

    def __init__(self, transport: NixlTransport, agent: str, pending: _Pending, nbytes: int):
        self._transport, self._agent, self._pending = transport, agent, pending
        self._finished = False
        self._error: BaseException | None = None
        _watch(transport, pending, nbytes)
        if pending.ended is None:
            self.check()

    def check(self) -> bool:
        """Under the transport's lock: whether all ended (what they used let go of then)."""
        if not self._finished:
            transport, pending, error = self._transport, self._pending, None
            if pending in transport.in_flight:
                if not pending.poll(transport.agent):
                    return False
                error = transport.settle(pending)
            self._finished, self._error = True, pending.outcome(self._agent, error)
        if self._error is not None:
            raise self._error
        return True

    def done(self) -> bool:
        ended = self._pending.ended
        if ended is not None and not self._finished and not ended.is_set() and _watcher.running():
            return False  # the watcher polls it
        with self._transport.lock:
            return self.check()

    def wait(self, timeout: float | None = None) -> None:
        ended, backoff = (
            self._pending.ended,
            Backoff(timeout, first=0.0002, longest=0.0002, spins=1000),
        )
        if ended is not None:  # large: in slices, signals handled between them
            while not ended.wait(
                _SLICE if timeout is None else min(_SLICE, backoff.remaining() or 0)
            ):
                if backoff.expired():
                    raise TimeoutError(f"the NIXL transfer did not finish within {timeout} s")
                if not _watcher.running():  # stopped at exit, or failed to start: poll here
                    with self._transport.lock:
                        if self.check():
                            return
        # past the first ~ms of polls, yield the core to NIXL's progress thread
        while not self.done():
            if backoff.expired():
                raise TimeoutError(f"the NIXL transfer did not finish within {timeout} s")
            backoff.pause()

    def __del__(self) -> None:
        if not self._finished and not sys.is_finalizing():
            _abandon(self._transport, self._pending)


def _nixl_error(error: Exception, agent: str) -> DevIpcError:
    name = type(error).__name__
    if name == "nixlRemoteDisconnectError":
        return PeerGoneError(
            f"NIXL agent {agent!r} disconnected: the peer exited or closed its endpoint"
        )
    if name == "nixlNotFoundError":
        return RemoteTensorFreedError(
            f"NIXL agent {agent!r} does not know this memory (any "
            f"more): ask the owner for a new descriptor"
        )
    return DevIpcError(f"NIXL failed: {name}: {error}")
