"""devipc._tools._bench.ipc's floor of a message in the reduction's shape: it unpickles to what the
consumer echoes without opening anything, and the send its reduction made is taken back."""

import torch

import devipc
from devipc._tools._bench import ipc


def test_the_reduction_floor_opens_nothing_and_leaves_no_send():
    import devipc_openreg  # noqa: F401

    before = devipc.stats()
    shaped, message = ipc.reduction_floor("openreg", count=5)
    assert shaped > 0 and message > 0
    after = devipc.stats()
    assert after["unopened"] == before["unopened"] and after["sent"] <= before["sent"]
    # the message itself is the reduction's: a function and its 15 arguments
    tensor = torch.full((8,), 7, dtype=torch.int32, device="openreg")
    function, args = ipc._ReductionShaped(tensor).__reduce__()
    assert function(*args) == 7 and len(args) == 15
    assert devipc.stats()["unopened"] == before["unopened"]
