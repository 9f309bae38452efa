"""A clean exit after backward passes on openreg.

torch 2.13 stashes a Python object (the caller's `contextvars` context) in every backward's graph
task. An autograd device thread drops its graph task just *after* waking the caller, so a script
whose last statement is `loss.backward()` can reach interpreter finalization while that thread
still holds the task; its release then needs the GIL, Python ends the thread with `pthread_exit`,
and the process aborts with "terminate called without an active exception". Any device with
autograd device threads is exposed; openreg makes sure it is not: at exit (before finalization),
one tiny backward without a stashed object runs on each device's thread. A device thread runs its
graph tasks in order and drops each before taking the next, so once the tiny one is done, nothing
that thread still holds needs Python.
"""

import atexit

import torch

from . import _runtime


def drain_autograd_threads() -> int:
    """One tiny backward per device, run past the stashing wrapper (so it holds nothing of
    Python); a no-op in a process that never used openreg. Returns how many ran to the end."""
    if _runtime.runtime_state() != _runtime.RUNTIME_INITIALIZED:
        return 0  # never used here (or a refused fork child): no device thread ran our work
    engine = torch.autograd.Variable._execution_engine
    drained = 0
    for index in range(_runtime.device_count()):
        leaf = torch.zeros((), device=f"openreg:{index}", requires_grad=True)
        output = leaf * 2  # its backward node runs on the device's autograd thread
        engine.run_backward(
            (output,),
            (torch.ones((), device=output.device),),
            False,
            False,
            (),
            allow_unreachable=True,
            accumulate_grad=True,
        )
        drained += leaf.grad is not None and leaf.grad.item() == 2.0
    return drained


def _at_exit() -> None:
    try:
        drain_autograd_threads()
    except Exception:  # noqa: BLE001 - exiting anyway: never turn an exit into a traceback
        pass


def register() -> None:
    atexit.register(_at_exit)
