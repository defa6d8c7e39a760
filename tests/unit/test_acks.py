"""Acknowledging dispatches several at once (services.executor.node.Acks): a multiple-ack only
when every delivery it reaches is being acknowledged, checked against a model of RabbitMQ's
channel over random deliveries and completions."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given
from hypothesis import strategies as st

from services.executor.node import Acks
from tests.fakes import StubMessage


@dataclass(eq=False)  # compared, and hashed, by identity, as a channel is
class Channel:
    """What RabbitMQ knows of one channel: the deliveries not acknowledged yet."""

    open: set[int] = field(default_factory=set)
    is_closed: bool = False
    frames: int = 0


@dataclass(eq=False)
class Delivery(StubMessage):
    """A delivery whose acknowledgements act on its channel as RabbitMQ's would."""

    async def ack(self, multiple: bool = False) -> None:
        await super().ack(multiple)
        channel = self.channel
        assert isinstance(channel, Channel)
        assert self.delivery_tag in channel.open, "acknowledged twice"
        channel.frames += 1
        if multiple:
            channel.open -= {t for t in channel.open if t <= (self.delivery_tag or 0)}
        else:
            channel.open.discard(self.delivery_tag or 0)


def deliver(acks: Acks, channel: Channel, n: int, first: int = 1) -> list[Delivery]:
    out = []
    for tag in range(first, first + n):
        message = Delivery(b"", channel=channel, delivery_tag=tag)
        channel.open.add(tag)
        acks.received(message)
        out.append(message)
    return out


async def test_in_order_completions_go_in_one_frame() -> None:
    acks, channel = Acks(), Channel()
    m = deliver(acks, channel, 5)
    await acks.ack(m[:3])
    assert channel.open == {4, 5}
    assert channel.frames == 1
    assert m[2].acked_multiple == 1


async def test_an_open_earlier_delivery_keeps_the_acks_single() -> None:
    acks, channel = Acks(), Channel()
    m = deliver(acks, channel, 4)
    await acks.ack([m[1], m[2]])  # 1 still runs: a multiple-ack would take it too
    assert channel.open == {1, 4}
    assert channel.frames == 2
    await acks.ack([m[3], m[0]])
    assert channel.open == set()
    assert channel.frames == 3


async def test_channels_apart_and_a_closed_one_forgotten() -> None:
    acks, old, new = Acks(), Channel(), Channel()
    gone = deliver(acks, old, 3)
    old.is_closed = True  # RabbitMQ requeued what it held
    fresh = deliver(acks, new, 2)
    await acks.ack(fresh)
    assert new.open == set()
    assert new.frames == 1
    assert old.open == {1, 2, 3}, "nothing may be acknowledged on a closed channel"
    assert all(m.acked == 0 for m in gone)


async def test_messages_without_a_tag_are_acknowledged_one_by_one() -> None:
    untagged = [StubMessage(b"") for _ in range(3)]
    await Acks().ack([*untagged, None])
    assert [(m.acked, m.acked_multiple) for m in untagged] == [(1, 0)] * 3


@given(st.data())
async def test_no_multiple_ack_reaches_a_delivery_still_in_work(data: st.DataObject) -> None:
    acks, channel = Acks(), Channel()
    n = data.draw(st.integers(1, 40))
    in_work = deliver(acks, channel, n)
    while in_work:
        picks = st.lists(st.sampled_from(in_work), min_size=1, unique_by=lambda m: m.delivery_tag)
        done = data.draw(picks)
        await acks.ack(done)
        finished = {m.delivery_tag for m in done}
        in_work = [m for m in in_work if m.delivery_tag not in finished]
        assert channel.open == {m.delivery_tag for m in in_work}, "a delivery in work was acked"
    assert channel.open == set()
