"""Exceptions, split by cause: the device cannot share, the handle is bad, the peer is gone."""


class DevIpcError(RuntimeError):
    """Base class of every devipc error."""


class UnsupportedDeviceError(DevIpcError):
    """The tensor's device has no IPC hooks (or says it cannot share): nothing was sent."""


class InvalidHandleError(DevIpcError, ValueError):
    """A handle is forged, truncated, stale, or names something that is not what it claims to be;
    also a handle this process may not open (other user, PID namespace, non-dumpable producer)."""


class PeerGoneError(DevIpcError):
    """The process that exported a handle has exited before the handle was opened."""


class ReshareError(DevIpcError):
    """A tensor received through IPC was sent on again, which is not supported yet."""
