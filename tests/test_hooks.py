import pytest
import torch

import devipc
from devipc._core._hooks import hooks_for


class _Broken(devipc.hooks.IpcHooks):
    def supports_ipc(self):
        raise RuntimeError("driver exploded")


class _Unable(devipc.hooks.IpcHooks):
    pass


def test_defaults_say_no_ipc():
    hooks = devipc.hooks.IpcHooks()
    assert hooks.supports_ipc() is False
    assert hooks.ipc_event_handle_size() == 0
    assert hooks.requires_event_sync() is False
    assert hooks.get_ipc_event_handle(torch.device("cpu")) == b""
    with pytest.raises(NotImplementedError, match="get_ipc_mem_handle"):
        hooks.get_ipc_mem_handle(0)
    with pytest.raises(NotImplementedError, match="open_ipc_mem_handle"):
        hooks.open_ipc_mem_handle(b"")


def test_optional_hooks_default_to_the_safe_answer():
    hooks = devipc.hooks.IpcHooks()
    memory = devipc.hooks.OpenedMemory(0, 64, torch.device("openreg", 0), lambda: None)
    assert hooks.can_map_on(memory, torch.device("openreg", 0))
    assert not hooks.can_map_on(memory, torch.device("openreg", 1))
    assert hooks.device_identity(torch.device("openreg", 0)) == b""
    assert hooks.memory_kind(0) is None  # not registrable with a network engine


def test_the_hooks_beyond_the_methods_are_declared_with_their_defaults():
    """`make_resizable` and `copy_batch` are part of the contract: a device without them keeps
    defaults callers use as they are, no lookup by name."""
    hooks = devipc.hooks.IpcHooks()
    storage = torch.UntypedStorage(8)
    assert hooks.make_resizable(storage) is None and storage.nbytes() == 8  # nothing done
    assert hooks.copy_batch is None  # no batch: copies go pair by pair
    assert _Unable().copy_batch is None


def test_unregistered_devices_do_not_support_ipc():
    assert devipc.hooks.device_supports_ipc("no_such_device") is False
    assert devipc.hooks.device_supports_ipc("cuda") is False
    assert devipc.hooks.get_ipc_hooks("no_such_device") is None


def test_supports_ipc_never_throws():
    devipc.hooks.register_ipc_hooks("fakedev", _Broken())
    try:
        assert devipc.hooks.device_supports_ipc("fakedev") is False
    finally:
        devipc.hooks.unregister_ipc_hooks("fakedev")


def test_error_names_the_device_and_says_what_to_do():
    devipc.hooks.register_ipc_hooks("fakedev", _Unable())
    try:
        with pytest.raises(devipc.UnsupportedDeviceError) as error:
            hooks_for(_FakeDevice())
        assert "fakedev:1" in str(error.value)
        assert "register_ipc_hooks" in str(error.value)
        assert "never copies silently" in str(error.value)
    finally:
        devipc.hooks.unregister_ipc_hooks("fakedev")


class _FakeDevice:
    type = "fakedev"

    def __str__(self):
        return "fakedev:1"


@pytest.mark.parametrize("device_type", ["cpu", "cuda", "meta"])
def test_torch_owned_devices_cannot_be_taken_over(device_type):
    with pytest.raises(ValueError, match="torch shares"):
        devipc.hooks.register_ipc_hooks(device_type, devipc.hooks.IpcHooks())


def test_hooks_registered_already_are_replaced_only_when_asked():
    first, second = _Unable(), _Unable()
    devipc.hooks.register_ipc_hooks("fakedev", first)
    try:
        devipc.hooks.register_ipc_hooks("fakedev", first)  # the same ones again: idempotent
        with pytest.raises(
            ValueError,
            match=r"'fakedev' has IPC hooks registered already "
            r"\(test_hooks._Unable\): pass replace=True",
        ):
            devipc.hooks.register_ipc_hooks("fakedev", second)
        assert devipc.hooks.get_ipc_hooks("fakedev") is first
        devipc.hooks.register_ipc_hooks("fakedev", second, replace=True)
        assert devipc.hooks.get_ipc_hooks("fakedev") is second
    finally:
        devipc.hooks.unregister_ipc_hooks("fakedev")


def test_hooks_must_implement_the_contract():
    with pytest.raises(TypeError, match="IpcHooks"):
        devipc.hooks.register_ipc_hooks("fakedev", object())


def test_later_spelling_follows_event_size():
    class WithEvents(devipc.hooks.IpcHooks):
        def ipc_event_handle_size(self):
            return 64

    assert WithEvents().requires_event_sync() is True


def test_a_memory_handle_is_a_pair_or_a_record_with_handle_and_offset():
    IpcMemHandle = devipc.hooks.IpcMemHandle
    assert IpcMemHandle.of((b"h", 8)) == (b"h", 8) == IpcMemHandle(handle=b"h", offset=8)

    class Record:  # the RFC's pull requests: IpcMemHandle{offset, handle}
        offset, handle = 8, b"h"

    assert IpcMemHandle.of(Record()) == (b"h", 8)
    for wrong in (b"h", None, (b"h", 8, 0)):
        with pytest.raises(TypeError, match="get_ipc_mem_handle must return"):
            IpcMemHandle.of(wrong)
