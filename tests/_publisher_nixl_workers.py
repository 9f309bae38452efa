"""The child of test_publisher_nixl.py's Ctrl-C case: a NIXL publisher and its subscriber in one
process (two endpoints reach each other as across hosts), so a crash is the child's exit code."""
import signal
import time

import torch

import devipc
from devipc.p2p import _nixl


def interrupted_pull(conn, nbytes: int) -> None:
    """Ctrl-C lands while wait() pulls a generation of `nbytes` (raised by the pull's own post,
    so it is in flight); then tensors() refuses the memory the cut pull may still write, and the
    next wait() pulls the generation whole."""
    import devipc_openreg  # noqa: F401 - the device, also where autoload is off

    weights = {"w": torch.full((nbytes // 4,), 3.0, device="openreg")}
    publisher = devipc.WeightPublisher(weights, copy=True, transport="nixl")
    subscriber = devipc.WeightSubscriber(publisher.token())
    publisher.publish(wait=False)
    started = time.monotonic()
    subscriber.wait(timeout=60)
    pull = time.monotonic() - started  # the whole pull, its start-up included
    subscriber.ack()
    weights["w"].fill_(5.0)
    request, post, big, sent = _nixl.NixlTransport._request, _nixl.NixlTransport._post, set(), []

    def spied_request(self, op, agent, local, *rest):
        handle = request(self, op, agent, local, *rest)
        if sum(size for _, size, _ in local) >= nbytes:
            big.add(id(handle))
        return handle

    def spied_post(self, handle, agent):
        state = post(self, handle, agent)
        if id(handle) in big and not sent:
            sent.append(time.monotonic())
            signal.raise_signal(signal.SIGINT)
        return state

    _nixl.NixlTransport._request, _nixl.NixlTransport._post = spied_request, spied_post
    publisher.publish(wait=False)
    try:
        subscriber.wait(timeout=60)
        latency = None
    except KeyboardInterrupt:
        latency = time.monotonic() - sent[0]
    _nixl.NixlTransport._request, _nixl.NixlTransport._post = request, post
    try:
        subscriber.tensors()
        refused = False
    except ValueError:
        refused = True
    generation = subscriber.wait(timeout=60)
    whole = bool((subscriber.tensors()["w"] == 5.0).all())
    subscriber.ack()
    subscriber.close()
    publisher.close()
    conn.send({"pull": pull, "latency": latency, "refused": refused, "generation": generation,
               "whole": whole})
