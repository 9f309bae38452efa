"""`torch.openreg.Stream`, `Event`, `stream()` and `set_stream`: what `torch.cuda` offers for
streams and events, so device-generic code written against `torch.cuda` runs on openreg.

`Stream` is a `torch.Stream`; `Event` wraps a runtime event, because `torch.Event` cannot make an
interprocess event or carry an IPC handle. As with CUDA, an interprocess event's handle names the
event: every process that opened it may record it, and waits are for its latest record. Events
pickle (for `torch.multiprocessing`) as their IPC handle, like `torch.cuda.Event`.
"""

from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any, NoReturn, Self

import torch

from . import _runtime
from ._current import PRIVATEUSE1, current_device, current_stream, index_of, set_device

__all__ = ["Event", "Stream", "StreamContext", "default_stream", "set_stream", "stream"]


def _openreg_stream(stream: torch.Stream | None) -> torch.Stream:
    """`stream`, checked to be an openreg stream; None: the current stream of the current device."""
    if stream is None:
        return current_stream()
    if not isinstance(stream, torch.Stream):
        raise TypeError(f"expected an openreg stream, got {type(stream).__name__}")
    if stream.device.type != "openreg":
        raise ValueError(f"expected an openreg stream, got a stream of {stream.device}")
    return stream


def _native(stream: torch.Stream) -> int:
    return _runtime.stream_from_id(stream.device_index, stream.stream_id)


class Stream(torch.Stream):
    """A new stream of an openreg device (`device` None: the current one). The runtime has no
    priorities: `priority` is accepted, as torch.cuda.Stream's, and has no effect.

    `Stream(stream_id=..., device_index=..., device_type=...)` names an existing stream instead.
    """

    def __new__(
        cls, device: torch.device | str | int | None = None, priority: int = 0, **kwargs: Any
    ) -> Self:
        if kwargs:
            return super().__new__(cls, **kwargs)
        index = index_of(device)
        return super().__new__(cls, torch.device("openreg", index), priority=priority)

    def wait_event(self, event: "Event | torch.Event") -> None:
        """Work queued on this stream afterwards waits for `event`'s latest record."""
        if isinstance(event, Event):
            event.wait(self)
        else:
            super().wait_event(event)

    def wait_stream(self, stream: torch.Stream | None) -> None:
        """Work queued on this stream afterwards waits for the work queued on `stream` so far."""
        self.wait_event(Stream.record_event(_openreg_stream(stream)))

    def record_event(  # type: ignore[override]
        self: torch.Stream,
        event: "Event | None" = None,
    ) -> "Event":
        """Records `event` (a new Event if None) on this stream and returns it."""
        if event is None:
            event = Event()
        event.record(self)
        return event

    def __repr__(self) -> str:
        return f"<torch.openreg.Stream device=openreg:{self.device_index} id={self.stream_id}>"


class Event:
    """An openreg event, as torch.cuda.Event: a point in a stream's work to wait for or time.

    `blocking` is accepted for torch.cuda.Event's signature; every wait already sleeps instead of
    spinning. An `interprocess` event cannot time (as in CUDA); its `ipc_handle()` opens in another
    process with `Event.from_ipc_handle`.
    """

    _event: int  # None only while half-made or once destroyed

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        if interprocess and enable_timing:
            raise ValueError(
                "an interprocess openreg event cannot measure time: "
                "create it with enable_timing=False (as in CUDA)"
            )
        # set first, so __del__ of a half-made event does nothing
        self._event = None  # type: ignore[assignment]
        self.enable_timing, self.blocking, self.interprocess = (
            bool(enable_timing),
            bool(blocking),
            bool(interprocess),
        )
        self.device: torch.device | None = None  # the device of the first stream it is recorded on
        self._event = _runtime.event_create(
            interprocess=self.interprocess, timing=self.enable_timing
        )

    @classmethod
    def from_ipc_handle(cls, device: torch.device | str | int | None, handle: bytes) -> "Event":
        """The interprocess event named by `handle` (from `ipc_handle()` in another process)."""
        index = index_of(device)
        event = cls.__new__(cls)
        event._event = None  # type: ignore[assignment]
        event.enable_timing, event.blocking, event.interprocess = False, False, True
        event.device = torch.device("openreg", index)
        event._event = _runtime.ipc_open_event_handle(handle)
        return event

    @property
    def event_id(self) -> int:
        """The runtime's event (an orEvent_t), as an int."""
        return self._event

    def record(self, stream: torch.Stream | None = None) -> None:
        """Records this event on `stream` (None: the current stream); a later record replaces the
        one waits are for."""
        stream = _openreg_stream(stream)
        target = torch.device("openreg", stream.device_index)
        if self.device is not None and self.device != target:
            raise ValueError(
                f"this event belongs to {self.device}; it cannot be recorded on a "
                f"stream of {target}"
            )
        _runtime.event_record(self._event, _native(stream))
        self.device = target

    def wait(self, stream: torch.Stream | None = None) -> None:
        """Work queued on `stream` (None: the current stream) afterwards waits for this event's
        latest record, as it is now."""
        _runtime.stream_wait_event(_native(_openreg_stream(stream)), self._event)

    def query(self) -> bool:
        """True when the latest record has completed (or there was none)."""
        return _runtime.event_query(self._event)

    def synchronize(self) -> None:
        """Waits for the latest record to complete."""
        _runtime.event_synchronize(self._event)

    def elapsed_time(self, end_event: "Event") -> float:
        """Milliseconds from this event's record to `end_event`'s; both need enable_timing."""
        return _runtime.event_elapsed_ms(self._event, end_event._event)

    def ipc_handle(self) -> bytes:
        """Bytes naming this event in other processes (interprocess events only)."""
        if not self.interprocess:
            raise ValueError("only an openreg Event(interprocess=True) has an IPC handle")
        return _runtime.ipc_get_event_handle(self._event)

    def __reduce__(self) -> NoReturn:
        raise TypeError(
            "an openreg Event holds a runtime pointer; only multiprocessing's pickler "
            "(torch.multiprocessing included) sends it, as its IPC handle"
        )

    def __del__(self) -> None:
        event, self._event = getattr(self, "_event", None), None  # type: ignore[assignment]
        if event is not None and _runtime is not None:  # None late in interpreter shutdown
            _runtime.event_destroy(event)

    def __repr__(self) -> str:
        kind = "interprocess " if self.interprocess else ""
        return f"<torch.openreg.Event {kind}{self._event:#x} device={self.device}>"


def _rebuild_event(device_index: int | None, handle: bytes) -> Event:
    return Event.from_ipc_handle(device_index, handle)


def _reduce_event(event: Event) -> tuple[Callable[..., Event], tuple[int | None, bytes]]:
    """How torch.multiprocessing sends an Event: as its IPC handle, like torch.cuda.Event."""
    index = event.device.index if event.device is not None else current_device()
    return _rebuild_event, (index, event.ipc_handle())


ForkingPickler.register(Event, _reduce_event)


def default_stream(device: torch.device | str | int | None = None) -> Stream:
    """The default stream (id 0) of `device`."""
    index = index_of(device)
    return Stream(stream_id=0, device_index=index, device_type=PRIVATEUSE1)


def set_stream(stream: torch.Stream | None) -> None:
    """Makes `stream` the current stream of its device, and its device the current device (as
    torch.cuda.set_stream). None does nothing."""
    if stream is None:
        return
    stream = _openreg_stream(stream)
    set_device(stream.device_index)
    _runtime.exchange_stream(stream.device_index, stream.stream_id)


class StreamContext:
    """Makes `stream` current (and its device) inside the `with`, then restores both; None does
    nothing."""

    def __init__(self, stream: torch.Stream | None) -> None:
        self.stream = None if stream is None else _openreg_stream(stream)
        self._restore: tuple[int, int, int] | None = None

    def __enter__(self) -> torch.Stream | None:
        if self.stream is None:
            return None
        index = self.stream.device_index
        self._restore = (current_device(), index, _runtime.current_stream_id(index))
        set_stream(self.stream)
        return self.stream

    def __exit__(self, *exc_info: object) -> None:
        if self._restore is None:
            return
        device, index, stream_id = self._restore
        self._restore = None
        _runtime.exchange_stream(index, stream_id)
        set_device(device)


def stream(stream: torch.Stream | None) -> StreamContext:
    """`with torch.openreg.stream(s):` queues work on `s` inside the block."""
    return StreamContext(stream)
