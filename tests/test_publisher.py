"""The weight publisher: pack_module, fan-out to subscribers in spawned processes, acknowledged
generations, copy and in-place modes, late and dead subscribers, a killed publisher, bad tokens,
and nothing left behind; in both openreg IPC modes."""

import contextlib
import gc
import os
import re
import signal
import threading

import _workers
import pytest
import torch
from _support import FRESH_TIMEOUT, TIMEOUT, open_fds, recv, use_ucx_loopback, wait_until

import devipc

pytestmark = pytest.mark.usefixtures("ipc_mode")


# What a weight-sync user never meets in an error: the machinery beneath the publisher.
_MACHINERY = re.compile(
    r"arena|attachment|slot|ACKS|consumer|chunk|record|devipc handle", re.IGNORECASE
)


def _in_user_words(error):
    message = str(error)
    assert not _MACHINERY.search(message), f"{type(error).__name__}: {message}"
    return message


def _drain():
    """Until this process holds no send: views that the frames of a caught exception hold (a
    cycle, with its traceback) go with a collection, not at once."""
    gc.collect()
    torch.accelerator.synchronize()
    wait_until(lambda: devipc.stats()["sent"] == 0, "every send ended", collect=True)


def _subscribe(children, publisher, generations, into=False):
    proc, conn = children.start_piped(
        _workers.weight_subscriber, publisher.token(), generations, into
    )
    assert recv(conn) == ("subscribed", "openreg:0")
    return proc, conn


def test_pack_module_keeps_identity_ties_and_buffers_and_the_optimizer_works():
    model = _workers.TinyGPT()
    early = torch.optim.SGD(model.parameters(), lr=0.5)  # made before packing
    parameters = list(model.parameters())
    scratch = model.scratch
    before = _workers.snapshot(model)
    packed = devipc.pack_module(model)
    assert list(model.parameters()) == parameters  # the same objects
    assert set(packed) == set(model.state_dict())
    storages = {t.untyped_storage().data_ptr() for t in model.state_dict().values()}
    assert len(storages) == 1  # parameters and the persistent buffer, one allocation
    assert model.head.weight is model.embed.weight  # still tied
    assert packed["head.weight"].data_ptr() == packed["embed.weight"].data_ptr()
    assert model.scratch is scratch and scratch.untyped_storage().data_ptr() not in storages
    assert _workers.snapshot(model) == before
    model(torch.tensor([[1, 2, 3]], device="openreg")).square().mean().backward()
    early.step()
    assert {t.untyped_storage().data_ptr() for t in model.state_dict().values()} == storages
    assert model.block.weight.cpu().tolist() != before["block.weight"]  # trained in place
    handle = devipc.share_state_dict(model.state_dict(), copy=False)  # the recipe now works
    opened = devipc.open_state_dict(handle)
    assert torch.equal(opened["block.weight"].cpu(), model.block.weight.cpu())
    del opened
    _drain()


def test_views_of_many_storages_name_pack_module():
    model = _workers.TinyGPT()
    with pytest.raises(ValueError, match="pack_module"):
        devipc.share_state_dict(model.state_dict(), copy=False)
    with pytest.raises(ValueError, match="pack_module"):
        devipc.WeightPublisher(model)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        devipc.pack_module(model.state_dict())


@pytest.mark.parametrize("copy", [False, True])
def test_two_subscribers_see_every_generation_exactly(children, copy):
    model = _workers.TinyGPT()
    devipc.pack_module(model)
    exports = devipc.stats()["exports"]
    with devipc.WeightPublisher(model, copy=copy) as publisher:
        views = _subscribe(children, publisher, 3, into=False)
        engine = _subscribe(children, publisher, 3, into=True)
        fds = open_fds()  # the pipes to the subscribers, its control and counter files included
        publisher.wait_subscribers(2, timeout=TIMEOUT)  # both opened their tokens
        with pytest.raises(TimeoutError, match="2 of 3"):
            publisher.wait_subscribers(3, timeout=0.1)
        for step in range(3):
            _workers.train_step(model, float(step + 1))
            expected = _workers.snapshot(model)
            assert publisher.publish(timeout=TIMEOUT) == step  # both acknowledged
            for _, conn in (views, engine):
                generation, seen = recv(conn)
                assert generation == step
                assert seen.keys() == expected.keys()
                assert seen == expected, (copy, step)
        for _, conn in (views, engine):
            assert recv(conn) == "closed"
        children.join_ok()
        assert all(s["state"] == "closed" for s in publisher.subscribers().values())
    children.reap()  # our ends of the pipes
    del model, publisher
    _drain()
    wait_until(
        lambda: devipc.stats()["exports"] <= exports, "the packed memory let go", collect=True
    )
    assert open_fds() < fds


def _new_values(weights, seed):
    """What a training step writes: other values every time. Their digest."""
    generator = torch.Generator().manual_seed(seed)
    for tensor in weights.values():
        tensor.copy_(torch.randn(tensor.shape, generator=generator))
    return _workers.digest(weights)


def test_one_publisher_serves_more_than_64_subscribers_every_byte_exact(children):
    """The cap was 64 subscribers a publisher: 66 here, 33 in each of two processes."""
    weights = devipc.pack(
        {
            "embed": torch.empty(64, 256, device="openreg"),
            "bias": torch.empty(256, device="openreg"),
        }
    )
    with devipc.WeightPublisher(weights) as publisher:
        groups = [
            children.start_piped(
                _workers.weight_subscribers, [publisher.token() for _ in range(33)], 3
            )[1]
            for _ in range(2)
        ]
        for conn in groups:  # 33 subscribers opened one after the other
            assert recv(conn, 2 * FRESH_TIMEOUT) == "subscribed"
        publisher.wait_subscribers(66, timeout=TIMEOUT)
        for generation in range(3):
            expected = _new_values(weights, generation)
            assert publisher.publish(timeout=TIMEOUT) == generation  # all 66 acknowledged
            for conn in groups:
                assert recv(conn) == [(generation, expected)] * 33
        for conn in groups:
            assert recv(conn) == "closed"
        children.join_ok()
        assert [s["state"] for s in publisher.subscribers().values()] == ["closed"] * 66
    children.reap()
    del weights, publisher
    _drain()


def test_with_copy_the_trainer_writes_at_once_and_subscribers_never_see_it(children):
    model = _workers.TinyGPT()
    with devipc.WeightPublisher(model, copy=True) as publisher:  # no packing needed: a copy
        _, conn = _subscribe(children, publisher, 4)
        for step in range(4):
            _workers.train_step(model, float(step + 1))
            expected = _workers.snapshot(model)
            generation = publisher.publish(wait=False)
            _workers.train_step(model, -1.0)  # the next step writes while the engine may read
            seen_generation, seen = recv(conn)
            assert seen_generation == generation == step
            assert seen == expected, step
        publisher.wait_acks(3, timeout=TIMEOUT)
        assert recv(conn) == "closed"
    _drain()


def test_a_late_subscriber_gets_the_newest_generation(children):
    model = _workers.TinyGPT()
    with devipc.WeightPublisher(model, copy=True) as publisher:
        for step in range(3):
            _workers.train_step(model, float(step + 1))
            publisher.publish(timeout=TIMEOUT)  # nobody subscribed: nothing to wait for
        expected = _workers.snapshot(model)
        _, conn = _subscribe(children, publisher, 1)
        generation, seen = recv(conn)
        assert generation == 2 and seen == expected
        assert recv(conn) == "closed"
    _drain()


def test_a_dead_subscriber_is_named_once_and_never_waited_for_again(children):
    model = _workers.TinyGPT()
    devipc.pack_module(model)
    with devipc.WeightPublisher(model) as publisher:
        hanging, conn = children.start_piped(
            _workers.weight_subscriber_that_hangs, publisher.token()
        )
        _, live = _subscribe(children, publisher, 2)
        assert recv(conn) == "subscribed"
        with pytest.raises(devipc.AckTimeoutError, match="not acknowledged generation 0") as late:
            publisher.publish(timeout=0.5)  # alive, not acknowledging: a timeout
        assert late.value.published == 0  # it went out: the wait for its acknowledgements ended
        assert recv(conn) == ("got", 0)
        assert recv(live)[0] == 0
        os.kill(hanging.pid, signal.SIGKILL)
        hanging.join(TIMEOUT)
        with pytest.raises(devipc.ConsumerDiedError, match=f"pid {hanging.pid}") as died:
            publisher.wait_acks(0, timeout=TIMEOUT)
        assert "subscriber" in _in_user_words(died.value)
        publisher.wait_acks(0, timeout=TIMEOUT)  # the live one's acknowledgement
        assert publisher.publish(timeout=TIMEOUT) == 1  # without the dead one, no hang
        assert recv(live)[0] == 1
        assert recv(live) == "closed"
    _drain()


def test_a_subscriber_dying_while_publish_waits_is_named_with_the_generation_that_went_out(
    children,
):
    """Issue 47: from ConsumerDiedError alone, the trainer could not tell whether `publish` had
    published its generation."""
    model = _workers.TinyGPT()
    devipc.pack_module(model)
    with devipc.WeightPublisher(model) as publisher:
        hanging, conn = children.start_piped(
            _workers.weight_subscriber_that_hangs, publisher.token()
        )
        assert recv(conn) == "subscribed"

        def kill_once_it_holds_the_generation():
            recv(conn)  # ("got", 0): it holds it and will never acknowledge
            os.kill(hanging.pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_once_it_holds_the_generation)
        killer.start()
        with pytest.raises(devipc.ConsumerDiedError, match=f"pid {hanging.pid}") as died:
            publisher.publish(timeout=TIMEOUT)
        killer.join(TIMEOUT)
        assert died.value.published == 0 == publisher.generation
        assert publisher.publish(timeout=TIMEOUT) == 1  # nobody left to wait for
    _drain()


@pytest.mark.parametrize("transport", ["ipc", "nixl"])
def test_a_publish_that_raises_says_whether_its_generation_went_out(transport, monkeypatch):
    """copy=True: an AckTimeoutError from the wait for a buffer still held (nothing went out)
    or from the wait for the new generation's acknowledgements (it went out)."""
    use_ucx_loopback(monkeypatch)  # nixl: to this host only
    model = _workers.TinyGPT()
    with devipc.WeightPublisher(model, copy=True, transport=transport) as publisher:
        subscriber = devipc.WeightSubscriber(publisher.token())
        assert publisher.publish(wait=False) == 0
        assert subscriber.wait(timeout=TIMEOUT) == 0  # held, not acknowledged
        with pytest.raises(devipc.AckTimeoutError, match="generation 1") as late:
            publisher.publish(timeout=0.2)  # the other buffer: out, then not acknowledged
        assert late.value.published == 1
        with pytest.raises(devipc.AckTimeoutError, match="generation 0") as held:
            publisher.publish(timeout=0.2)  # generation 0's buffer, still held
        assert held.value.published is None and publisher.generation == 1
        subscriber.ack()
        assert subscriber.wait(timeout=TIMEOUT) == 1
        subscriber.ack()
        assert publisher.publish(wait=False) == 2  # both buffers free again
        subscriber.close()
    _drain()


@pytest.mark.parametrize("transport", ["ipc", "nixl"])
def test_copy_false_refuses_at_once_a_publish_before_the_last_one_was_acknowledged(
    transport, monkeypatch
):
    """Issue 47: a second `publish(wait=False)` before the engines acknowledged waited 60 s,
    then raised AckTimeoutError; the trainer's write in between landed under their reads."""
    use_ucx_loopback(monkeypatch)  # nixl: to this host only
    model = _workers.TinyGPT()
    devipc.pack_module(model)
    with devipc.WeightPublisher(model, transport=transport) as publisher:
        subscriber = devipc.WeightSubscriber(publisher.token())
        assert publisher.publish(wait=False) == 0
        assert subscriber.wait(timeout=TIMEOUT) == 0  # reading it, not acknowledged yet
        for wait in (False, True):
            with pytest.raises(
                ValueError,
                match=(
                    rf"subscribers 0 \(pid {os.getpid()}, attached, acknowledged -1\) have not "
                    rf"acknowledged generation 0: .*once wait_acks\(0\) returned.*nothing was "
                    rf"published"
                ),
            ) as refused:
                publisher.publish(wait=wait, timeout=TIMEOUT)
            assert not re.search("arena|consumer|record", str(refused.value))  # user words
            assert publisher.generation == 0
        subscriber.ack()
        publisher.wait_acks(0, timeout=TIMEOUT)
        assert publisher.publish(wait=False) == 1
        assert subscriber.wait(timeout=TIMEOUT) == 1
        subscriber.ack()
        subscriber.close()
    _drain()


def test_a_killed_publisher_ends_the_subscribers_wait(children):
    publisher, conn = children.start_piped(_workers.weight_publisher_child)
    subscriber = devipc.WeightSubscriber(recv(conn))
    conn.send("publish")
    assert recv(conn) == 0
    assert subscriber.wait(timeout=TIMEOUT) == 0
    assert torch.equal(subscriber.tensors()["mask"].cpu(), torch.tril(torch.ones(4, 4)))
    subscriber.ack()
    os.kill(publisher.pid, signal.SIGKILL)
    publisher.join(TIMEOUT)
    with pytest.raises(devipc.PeerGoneError, match=f"pid {publisher.pid}") as gone:
        subscriber.wait(timeout=TIMEOUT)
    assert "WeightPublisher" in _in_user_words(gone.value)
    subscriber.close()


def test_bad_tokens_and_closed_publishers_are_clear_errors():
    model = _workers.TinyGPT()
    devipc.pack_module(model)
    publisher = devipc.WeightPublisher(model)
    token = publisher.token()
    with pytest.raises(devipc.InvalidHandleError):
        devipc.WeightSubscriber(token[:-3])
    other = devipc.share(torch.ones(2, device="openreg"))
    with pytest.raises(devipc.InvalidHandleError):
        devipc.WeightSubscriber(bytes(other))  # another kind of handle
    assert other.revoke()
    subscriber = devipc.WeightSubscriber(token)
    with pytest.raises(devipc.InvalidHandleError, match="already opened"):
        devipc.WeightSubscriber(token)
    with pytest.raises(ValueError, match="wait"):
        subscriber.tensors()
    with pytest.raises(TimeoutError):
        subscriber.wait(timeout=0.05)
    unopened = publisher.token()
    publisher.close()
    with pytest.raises(devipc.PeerGoneError, match="closed"):
        subscriber.wait(timeout=TIMEOUT)
    with pytest.raises(devipc.InvalidHandleError):
        devipc.WeightSubscriber(unopened)  # revoked with the publisher
    subscriber.close()
    with pytest.raises(ValueError, match="transport"):
        devipc.WeightPublisher(model, transport="rdma")
    _drain()


def test_copy_into_names_what_does_not_match():
    model = _workers.TinyGPT()
    devipc.pack_module(model)
    with devipc.WeightPublisher(model) as publisher:
        subscriber = devipc.WeightSubscriber(publisher.token())
        publisher.publish(wait=False)
        subscriber.wait(timeout=TIMEOUT)
        wrong = {
            **_workers.TinyGPT().state_dict(),
            "block.weight": torch.zeros(3, device="openreg"),
        }
        with pytest.raises(ValueError, match="'block.weight'.*\\(3,\\).*\\(8, 8\\)"):
            subscriber.copy_into(wrong)
        with pytest.raises(KeyError, match="mask"):
            subscriber.copy_into({"block.weight": torch.zeros(8, 8, device="openreg")})
        engine = _workers.TinyGPT()
        subscriber.copy_into(engine)
        assert torch.equal(engine.block.weight.cpu(), model.block.weight.cpu())
        subscriber.ack()
        subscriber.close()
    _drain()


@pytest.mark.filterwarnings("ignore:devipc. .* sends were never opened")  # 1,024 of them
def test_every_error_a_weight_sync_user_meets_speaks_of_publishers_and_subscribers():
    """Issue 31: tokens, subscribers, publishers and generations, never the arena beneath."""
    model = _workers.TinyGPT()
    devipc.pack_module(model)
    publisher = devipc.WeightPublisher(model)
    token = publisher.token()
    errors = []  # their messages: an exception kept would keep its frames' objects alive

    def caught(kind, call, *args, **kwargs):
        with pytest.raises(kind) as raised:
            call(*args, **kwargs)
        errors.append(_in_user_words(raised.value))

    for bad in (token[:10], token[:40], token[:-3], b"xx" + token[2:], token + b"x", "text"):
        caught(devipc.InvalidHandleError, devipc.WeightSubscriber, bad)
    opened = []
    for at in range(20, len(token), 37):  # damaged fields, wherever they fall
        damaged = token[:at] + bytes([token[at] ^ 0xFF]) + token[at + 1 :]
        try:
            devipc.WeightSubscriber(damaged).close()  # a byte free to differ
            opened.append(at)
        except devipc.DevIpcError as error:  # InvalidHandleError, or PeerGoneError: its pid
            errors.append(_in_user_words(error))
    torch.accelerator.synchronize()
    devipc.ipc_collect()
    assert devipc.stats()["sent"] == (0 if opened else 1), (opened, devipc.stats())
    token = publisher.token()  # (a damaged one that opened spent the first)
    subscriber = devipc.WeightSubscriber(token)
    caught(devipc.InvalidHandleError, devipc.WeightSubscriber, token)
    caught(ValueError, subscriber.tensors)
    caught(ValueError, subscriber.ack)
    caught(TimeoutError, subscriber.wait, timeout=0.05)
    caught(TimeoutError, publisher.wait_subscribers, 2, timeout=0.05)
    publisher.publish(wait=False)
    caught(devipc.AckTimeoutError, publisher.wait_acks, 0, timeout=0.05)
    subscriber.wait(timeout=TIMEOUT)
    engine = _workers.TinyGPT().state_dict()
    caught(ValueError, subscriber.copy_into, {**engine, "mask": torch.zeros(3, device="openreg")})
    caught(KeyError, subscriber.copy_into, engine, names={"mask": "causal_mask"})
    subscriber.ack()
    tokens = []
    with pytest.raises(ValueError) as full:
        for _ in range(1030):  # up to 1,024 subscribers a publisher
            tokens.append(publisher.token())
    errors.append(_in_user_words(full.value))
    publisher.close()
    caught(devipc.PeerGoneError, subscriber.wait, timeout=TIMEOUT)
    caught(ValueError, publisher.publish)
    subscriber.close()
    caught(ValueError, subscriber.wait, timeout=TIMEOUT)
    caught(devipc.InvalidHandleError, devipc.WeightSubscriber, tokens[0])  # revoked
    assert len(errors) >= 18, errors
    del full
    _drain()


def test_an_asyncio_loop_awaits_generations_for_two_subscribers():
    """An engine's own event loop serves two subscribers: each awaits every generation
    (`wait_async`), reads it and acknowledges, while the trainer publishes from its thread."""
    import asyncio

    model = _workers.TinyGPT()
    devipc.pack_module(model)
    steps = 4
    with devipc.WeightPublisher(model) as publisher:
        subscribers = [devipc.WeightSubscriber(publisher.token()) for _ in range(2)]
        sent: list = []

        def trainer():
            for step in range(steps):
                _workers.train_step(model, float(step))
                sent.append(_workers.snapshot(model))
                publisher.publish(timeout=TIMEOUT)  # returns once both engines acknowledged

        async def engine(subscriber):
            seen = []
            for _ in range(steps):
                generation = await subscriber.wait_async(timeout=TIMEOUT)
                seen.append(
                    (
                        generation,
                        {
                            name: tensor.cpu().tolist()
                            for name, tensor in subscriber.tensors().items()
                        },
                    )
                )
                subscriber.ack()
            return seen

        async def engines():
            return await asyncio.gather(*(engine(subscriber) for subscriber in subscribers))

        thread = threading.Thread(target=trainer, daemon=True)
        thread.start()
        got = asyncio.run(engines())
        thread.join(TIMEOUT)
        assert not thread.is_alive()
        for seen in got:
            assert [generation for generation, _ in seen] == list(range(steps))
            for (_, tensors), want in zip(seen, sent):
                assert tensors == want
        with pytest.raises(TimeoutError, match="no new generation within 0.05 s"):
            asyncio.run(subscribers[0].wait_async(timeout=0.05))
        with pytest.raises(ValueError, match="timeout must be a positive number"):
            asyncio.run(subscribers[0].wait_async(timeout=0))
        publisher.close()
        with pytest.raises(devipc.PeerGoneError, match="closed"):
            asyncio.run(subscribers[1].wait_async(timeout=TIMEOUT))
        for subscriber in subscribers:
            subscriber.close()
    _drain()


def test_an_old_token_opened_after_the_trainer_wrote_waits_for_the_next_generation(children):
    """copy=False: once publish() returned the trainer writes its weights; a token made before
    and opened after must not be handed the generation being overwritten."""
    model = _workers.TinyGPT()
    devipc.pack_module(model)
    with devipc.WeightPublisher(model) as publisher:
        early, late = publisher.token(), publisher.token()
        _workers.train_step(model, 0.0)
        assert publisher.publish(timeout=TIMEOUT) == 0  # nobody opened a token yet
        _workers.train_step(model, 1.0)  # the next step, not published
        here = devipc.WeightSubscriber(early)
        with pytest.raises(TimeoutError):
            here.wait(timeout=0.2)  # generation 0 is no longer what the memory holds
        _, conn = children.start_piped(_workers.weight_subscriber, late, 1, True)
        assert recv(conn) == ("subscribed", "openreg:0")
        expected = _workers.snapshot(model)
        assert publisher.publish(wait=False) == 1
        assert here.wait(timeout=TIMEOUT) == 1
        assert all(t.eq(1.0).all() for n, t in here.tensors().items() if n != "mask")
        here.ack()
        publisher.wait_acks(1, timeout=TIMEOUT)  # the child was waited for too
        assert recv(conn) == (1, expected)
        assert recv(conn) == "closed"
        here.close()
    _drain()


@pytest.mark.parametrize("transport", ["ipc", "nixl"])
def test_weights_that_left_the_packed_allocation_are_not_published_stale(transport, monkeypatch):
    use_ucx_loopback(monkeypatch)  # nixl: to this host only
    model = _workers.TinyGPT()
    packed = devipc.pack_module(model)
    with devipc.WeightPublisher(model, transport=transport) as publisher:
        publisher.publish(timeout=TIMEOUT)
        model.double()  # every floating tensor gets new memory
        with pytest.raises(ValueError, match="'embed.weight' no longer lies where"):
            publisher.publish(timeout=TIMEOUT)
    model = _workers.TinyGPT()
    packed = devipc.pack_module(model)
    storage = packed["block.weight"].untyped_storage()
    with devipc.WeightPublisher(model, transport=transport) as publisher:
        keep = torch.empty(storage.nbytes(), dtype=torch.uint8, device="openreg")
        keep.untyped_storage().copy_(storage)
        storage.resize_(0)  # FSDP frees the flat parameter after the forward...
        storage.resize_(keep.numel())  # ...and gathers it again into new memory
        storage.copy_(keep.untyped_storage())
        with pytest.raises(ValueError, match="resized"):
            publisher.publish(timeout=TIMEOUT)
    weights = devipc.pack(
        {"a": torch.ones(4, device="openreg"), "b": torch.ones(4, device="openreg")}
    )
    with devipc.WeightPublisher(weights, transport=transport) as publisher:
        assert publisher.publish(timeout=TIMEOUT) == 0
        weights["b"] = torch.zeros(4, device="openreg")
        with pytest.raises(ValueError, match="'b' no longer lies where"):
            publisher.publish(timeout=TIMEOUT)
    del packed, weights, keep
    _drain()


def _forged(token, rows):
    """`token`'s attachment with another table: a token damaged where only the buffer's size
    can tell."""
    from devipc._core._table import Table
    from devipc._weights._publisher_local import LocalToken

    return LocalToken.from_bytes(token)._replace(table=Table(*zip(*rows))).to_bytes()


def test_a_refused_damaged_token_leaves_the_genuine_one_openable():
    model = _workers.TinyGPT()
    devipc.pack_module(model)
    with devipc.WeightPublisher(model) as publisher:
        token = publisher.token()
        beyond = _forged(token, [("w", torch.float32, (4,), (1,), 1 << 30)])  # past the end
        with pytest.raises(devipc.InvalidHandleError):
            devipc.WeightSubscriber(beyond)
        subscriber = devipc.WeightSubscriber(token)  # not used up
        publisher.publish(wait=False)
        assert subscriber.wait(timeout=TIMEOUT) == 0
        subscriber.ack()
        subscriber.close()
    _drain()


@pytest.mark.parametrize("copy", [False, True])
def test_publishes_from_two_threads_take_turns(copy):
    model = _workers.TinyGPT()
    devipc.pack_module(model)
    with devipc.WeightPublisher(model, copy=copy) as publisher:
        subscriber = devipc.WeightSubscriber(publisher.token())
        got, errors = [], []

        def publish_some():
            try:
                got.extend(publisher.publish(wait=False) for _ in range(100))
            except BaseException as error:  # noqa: BLE001 - reported below
                errors.append(error)

        threads = [threading.Thread(target=publish_some) for _ in range(2)]
        if copy:  # the subscriber acknowledges as it goes: copy=True waits two back

            def acknowledge():
                while len(got) < 200 and not errors:
                    with contextlib.suppress(TimeoutError):
                        subscriber.wait(timeout=0.05)
                        subscriber.ack()

            threads.append(threading.Thread(target=acknowledge))
        else:
            subscriber.close()  # copy=False: nobody to wait for
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT)
        assert not errors
        assert sorted(got) == list(range(200))  # each call its own generation
        assert publisher.generation == 199
        subscriber.close()
    _drain()


def test_close_from_another_thread_ends_waits_clearly():
    model = _workers.TinyGPT()
    devipc.pack_module(model)
    publisher = devipc.WeightPublisher(model)
    subscriber = devipc.WeightSubscriber(publisher.token())
    other = devipc.WeightSubscriber(publisher.token())
    raised = []

    def wait_acks():
        try:
            publisher.publish(timeout=TIMEOUT)  # the subscribers never acknowledge
        except BaseException as error:  # noqa: BLE001 - checked below
            raised.append(error)

    def wait_generation():
        try:
            other.wait(timeout=TIMEOUT)
            other.wait(timeout=TIMEOUT)  # nothing more comes
        except BaseException as error:  # noqa: BLE001 - checked below
            raised.append(error)

    waiters = [threading.Thread(target=wait_acks), threading.Thread(target=wait_generation)]
    for thread in waiters:
        thread.start()
    assert subscriber.wait(timeout=TIMEOUT) == 0
    wait_until(lambda: other.generation == 0, "the second subscriber waits again")
    other.close()  # under its wait
    waiters[1].join(TIMEOUT)
    publisher.close()  # under its wait for acknowledgements
    waiters[0].join(TIMEOUT)
    assert not any(thread.is_alive() for thread in waiters)
    messages = sorted(str(error) for error in raised)
    assert all(type(error) is ValueError for error in raised), raised
    assert messages == ["this WeightPublisher was closed", "this WeightSubscriber was closed"]
    with pytest.raises(ValueError, match="WeightPublisher is closed"):
        publisher.publish()
    with pytest.raises(ValueError, match="WeightSubscriber is closed"):
        other.wait(timeout=1)
    subscriber.close()
    _drain()


def test_a_token_says_its_transport_first_and_reads_back_as_a_named_record():
    from devipc._core import _wire
    from devipc._weights._common import token_reader
    from devipc._weights._publisher_local import LocalToken

    model = _workers.TinyGPT()
    devipc.pack_module(model)
    with devipc.WeightPublisher(model) as publisher:
        token = publisher.token()
        assert token_reader(token)[0] == "ipc"
        record = LocalToken.from_bytes(token)
        assert record.to_bytes() == token
        assert len(record.table) == len(publisher._backend)
        with pytest.raises(devipc.InvalidHandleError, match="transport 'ipc', not 'nixl'"):
            token_reader(token, "nixl")
        with pytest.raises(devipc.InvalidHandleError, match="token transport"):
            devipc.WeightSubscriber(_wire.Writer(_wire.WEIGHTS).int(7).done())  # no such one
        with devipc.WeightSubscriber(token) as subscriber:  # the genuine one still opens
            publisher.publish(wait=False)
            assert subscriber.wait(timeout=TIMEOUT) == 0
            subscriber.ack()


@pytest.mark.parametrize("copy", [False, True])
def test_a_cpu_trainer_feeds_openreg_and_cpu_engines_exactly_every_generation(children, copy):
    """Issue 31: a trainer on the CPU publishes through torch's own shared memory; an engine
    reads it zero-copy on the CPU, another copies it into its openreg model."""
    model = _workers.TinyGPT("cpu")
    if not copy:
        devipc.pack_module(model)  # into torch's shared memory
    with devipc.WeightPublisher(model, copy=copy) as publisher:
        assert publisher.device == torch.device("cpu")
        engines = []
        for into, engine_device in ((False, "cpu"), (True, "openreg")):
            proc, conn = children.start_piped(
                _workers.weight_subscriber, publisher.token(), 3, into, None, engine_device, True
            )
            assert recv(conn) == ("subscribed", "cpu")
            engines.append(conn)
        fds = open_fds()
        publisher.wait_subscribers(2, timeout=TIMEOUT)
        for step in range(3):
            _workers.train_step(model, float(step + 1))
            expected = _workers.snapshot(model)
            assert publisher.publish(timeout=TIMEOUT, checksum=True) == step
            for conn in engines:
                assert recv(conn) == (step, expected), (copy, step)
        for conn in engines:
            assert recv(conn) == "closed"
        children.join_ok()
    children.reap()
    assert open_fds() < fds


@pytest.mark.parametrize("copy", [False, True])
def test_an_openreg_trainer_feeds_a_cpu_engine_without_a_copy(children, copy):
    """Issue 31: openreg's memory is host memory (its hooks say "DRAM"): a CPU engine maps it
    and reads CPU tensors over the very bytes the trainer published."""
    model = _workers.TinyGPT()
    if not copy:
        devipc.pack_module(model)
    with devipc.WeightPublisher(model, copy=copy) as publisher:
        _, conn = children.start_piped(
            _workers.weight_subscriber, publisher.token(), 3, True, "cpu", "cpu", True
        )
        assert recv(conn) == ("subscribed", "cpu")
        publisher.wait_subscribers(1, timeout=TIMEOUT)
        for step in range(3):
            _workers.train_step(model, float(step + 1))
            expected = _workers.snapshot(model)
            assert publisher.publish(timeout=TIMEOUT, checksum=True) == step
            assert recv(conn) == (step, expected), (copy, step)
        assert recv(conn) == "closed"
        children.join_ok()
        # here too, to see the bytes shared: the trainer's next write shows through the views
        subscriber = devipc.WeightSubscriber(publisher.token(), device="cpu")
        publisher.publish(wait=False)
        subscriber.wait(timeout=TIMEOUT)
        views = subscriber.tensors()
        assert views["block.weight"].device == torch.device("cpu")
        if not copy:
            _workers.train_step(model, 42.0)
            torch.accelerator.synchronize()
            assert views["block.weight"][0, 0].item() == 42.0  # the trainer's memory itself
        subscriber.ack()
        subscriber.close()
        del views
    children.reap()
    _drain()


@pytest.mark.parametrize("copy", [False, True])
@pytest.mark.parametrize("device", ["openreg", "cpu"])
@pytest.mark.parametrize("transport", ["ipc", "nixl"])
def test_a_forged_generation_fails_its_checksum(transport, device, copy, monkeypatch):
    """Issue 31: `publish(checksum=True)` sends the generation's CRC-32; a subscriber's
    `verify()` finds bytes that differ from what was published, after a bf16 copy_into too."""
    use_ucx_loopback(monkeypatch)  # nixl: to this host only
    model = _workers.TinyGPT(device)
    if not copy:
        devipc.pack_module(model)
    with devipc.WeightPublisher(model, copy=copy, transport=transport) as publisher:
        subscriber = devipc.WeightSubscriber(publisher.token())
        publisher.publish(wait=False)
        subscriber.wait(timeout=TIMEOUT)
        with pytest.raises(ValueError, match="without a checksum.*checksum=True"):
            subscriber.verify()
        subscriber.ack()
        for step in range(2):
            _workers.train_step(model, step + 0.5)
            publisher.publish(wait=False, checksum=True)
            subscriber.wait(timeout=TIMEOUT)
            subscriber.verify()  # the bytes as published
            engine = _workers.TinyGPT(device).to(torch.bfloat16)
            subscriber.copy_into(engine)
            subscriber.verify()  # reading them changed nothing
            views = subscriber.tensors()
            views["mask"][1, 2] += 1  # one byte of the generation forged where it is read
            with pytest.raises(devipc.ChecksumError, match=f"generation {step + 1}") as forged:
                subscriber.verify()
            _in_user_words(forged.value)
            views["mask"][1, 2] -= 1
            subscriber.verify()
            subscriber.ack()
            del views
        subscriber.close()
    _drain()


def test_cpu_engines_and_cpu_tensors_get_advice_they_can_follow(monkeypatch):
    """Issue 31: what cannot be read on the CPU says which copy to make; CPU weights open on
    the CPU; CPU tensors sent one by one are torch's to share, and the error says so."""
    from devipc_openreg import _ipc_hooks

    cpu_model = _workers.TinyGPT("cpu")
    with devipc.WeightPublisher(cpu_model, copy=True) as publisher:
        with pytest.raises(ValueError, match="open it on the CPU") as wrong:
            devipc.WeightSubscriber(publisher.token(), device="openreg")
        _in_user_words(wrong.value)
        devipc.WeightSubscriber(publisher.token()).close()  # the refused token's place is free
    model = _workers.TinyGPT()
    devipc.pack_module(model)
    monkeypatch.setattr(_ipc_hooks.OpenRegIpcHooks, "memory_kind", lambda self, index: "VRAM")
    with devipc.WeightPublisher(model) as publisher:
        token = publisher.token()
        with pytest.raises(devipc.UnsupportedDeviceError, match="copy_into a CPU model") as vram:
            devipc.WeightSubscriber(token, device="cpu")
        _in_user_words(vram.value)
        subscriber = devipc.WeightSubscriber(token)  # refused before its one open was spent
        publisher.publish(wait=False)
        subscriber.wait(timeout=TIMEOUT)
        engine = _workers.TinyGPT("cpu")
        subscriber.copy_into(engine)  # the copy the advice names
        assert _workers.snapshot(engine) == _workers.snapshot(model)
        subscriber.ack()
        subscriber.close()
    with pytest.raises(devipc.UnsupportedDeviceError, match="torch shares them") as cpu:
        devipc.share(torch.ones(3))
    assert "move the tensor to the CPU" not in str(cpu.value)
    _drain()
