"""Fork poisoning as CUDA does it: a child forked after its parent used openreg is refused every
device call with CUDA's kind of message; a child forked before any use works.

Each case runs in a fresh interpreter (this one has used openreg long ago), which forks with
multiprocessing's 'fork' context and hears from the child through a pipe, within a bounded time.
"""

import textwrap

import pytest
from _support import TIMEOUT, json_of

FORK = textwrap.dedent("""
    import json, multiprocessing, sys, torch

    def attempt(fn):
        try:
            fn()
            return "ok"
        except Exception as error:
            return f"{type(error).__name__}: {error}"

    def child(conn, inherited):
        calls = {
            "set_device": lambda: torch.openreg.set_device(0),
            "current_device": torch.openreg.current_device,
            "accelerator_index": torch.accelerator.current_device_index,
            "lazy_init": torch.openreg._lazy_init,
            "allocate": lambda: torch.empty(4, device="openreg"),
            "copy_to_device": lambda: torch.ones(4).to("openreg"),
            "copy_to_host": lambda: inherited.cpu() if inherited is not None else
                            torch.ones(4, device="openreg").cpu(),
            "pin_memory": lambda: torch.ones(4).pin_memory(),
            "manual_seed": lambda: torch.manual_seed(1),  # skips openreg in a bad fork, like CUDA
        }
        out = {name: attempt(fn) for name, fn in calls.items()}
        out["bad_fork"] = torch.openreg._is_in_bad_fork()
        out["device_count"] = torch.openreg.device_count()  # counting is allowed, as with CUDA
        out["works"] = out["allocate"] == "ok" and torch.ones(3, device="openreg").sum().item()
        del inherited  # tearing inherited tensors down must not crash
        conn.send(out)

    use_first = sys.argv[1] == "use"
    inherited = torch.arange(4.0, device="openreg") if use_first else None
    parent_initialized = torch.openreg.is_initialized()
    ctx = multiprocessing.get_context("fork")
    ours, theirs = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=child, args=(theirs, inherited))
    proc.start()
    try:
        out = ours.recv() if ours.poll(TIMEOUT) else "no answer"
        proc.join(TIMEOUT)
    finally:
        if proc.is_alive():
            proc.kill()
    out = {"child": out, "exitcode": proc.exitcode, "parent_initialized": parent_initialized,
           "parent_still_works": torch.ones(2, device="openreg").sum().item()}
    print(json.dumps(out))
""")

REFUSED = [
    "set_device",
    "current_device",
    "accelerator_index",
    "lazy_init",
    "allocate",
    "copy_to_device",
    "copy_to_host",
    "pin_memory",
]


def run(mode):
    code = f"TIMEOUT = {TIMEOUT}\n" + FORK.replace("sys.argv[1]", repr(mode))
    return json_of(code)


def test_child_forked_after_use_is_refused_with_cudas_message():
    out = run("use")
    assert out["parent_initialized"] and out["exitcode"] == 0
    child = out["child"]
    assert child["bad_fork"] is True
    for call in REFUSED:
        assert child[call].startswith("RuntimeError: "), (call, child[call])
        assert (
            "Cannot re-initialize openreg in forked subprocess. To use openreg with "
            "multiprocessing, you must use the 'spawn' start method" in child[call]
        ), call
        assert "OutOfMemoryError" not in child[call]
    assert child["manual_seed"] == "ok" and child["device_count"] == 2
    assert child["works"] is False
    assert out["parent_still_works"] == 2.0


def test_child_forked_before_any_use_works():
    out = run("no use")
    assert not out["parent_initialized"] and out["exitcode"] == 0
    child = out["child"]
    assert child["bad_fork"] is False
    assert all(child[call] == "ok" for call in REFUSED + ["manual_seed"]), child
    assert child["works"] == 3.0
    assert out["parent_still_works"] == 2.0  # the child's use does not poison its parent


@pytest.mark.parametrize(
    "use, initialized",
    [
        ("pass", False),
        ("torch.openreg.device_count(); torch.manual_seed(0)", False),
        ("torch.zeros(1, device='openreg')", True),
    ],
)
def test_only_real_use_initializes(use, initialized):
    """Importing torch, counting devices and seeding leave forked children usable, as in CUDA."""
    code = f"import json, torch; {use}; print(json.dumps(torch.openreg.is_initialized()))"
    assert json_of(code) is initialized
