"""A node's backlog policy (shared/backlog.py): earned by a full window of short attempts,
lost to long ones or a hand-back; a fixed backlog is always offered."""

from __future__ import annotations

from collections import deque

from hypothesis import given
from hypothesis import strategies as st

from shared.backlog import Backlog, hold_again, next_in_line, remove, take


def test_a_node_starts_without_a_backlog_and_earns_one_by_a_window_of_short_attempts() -> None:
    b = Backlog(16, hold_s=2.0, window=32)
    assert b.advertised == 0
    changed = [b.ran(0.001) for _ in range(32)]
    assert changed == [False] * 31 + [True]  # only once the window is full
    assert b.advertised == 16
    assert not b.ran(0.001)  # no change: nothing to write


def test_long_attempts_withdraw_it_and_the_gap_keeps_it_from_flapping() -> None:
    b = Backlog(4, hold_s=2.0, window=4)
    for _ in range(4):
        b.ran(0.1)
    assert b.on
    assert not b.ran(1.5)  # mean 0.45 s: above a quarter of hold_s, not above half: still on
    assert b.ran(3.0)  # mean 1.175 s > 1 s: off
    assert not b.on
    assert not any(b.ran(0.6) for _ in range(4))  # mean 0.6 s: between the lines, stays off
    assert b.ran(0.1)  # mean 0.475 s: under a quarter of hold_s, on again
    assert b.on


def test_a_hand_back_withdraws_it_until_a_new_window_of_short_attempts() -> None:
    b = Backlog(8, hold_s=1.0, window=8)
    for _ in range(8):
        b.ran(0.01)
    assert b.handed_back()
    assert b.advertised == 0
    assert not b.handed_back()  # already off: nothing to write
    for _ in range(7):
        assert not b.ran(0.01)  # the old window does not count
    assert b.ran(0.01)
    assert b.advertised == 8


def test_a_fixed_backlog_is_always_offered() -> None:
    b = Backlog(4, hold_s=None)
    assert b.advertised == 4
    assert not any(b.ran(100.0) for _ in range(100))
    assert not b.handed_back()
    assert b.advertised == 4


def test_no_backlog_when_the_limit_is_zero() -> None:
    b = Backlog(0, hold_s=2.0, window=2)
    assert not any(b.ran(0.0) for _ in range(10))
    assert b.advertised == 0


@given(st.lists(st.floats(min_value=0, max_value=10, allow_nan=False), max_size=200))
def test_it_advertises_nothing_or_the_limit_and_reports_every_change(runs: list[float]) -> None:
    b = Backlog(5, hold_s=1.0, window=8)
    before = b.advertised
    for r in runs:
        changed = b.ran(r)
        assert b.advertised in (0, 5)
        assert changed == (b.advertised != before)
        before = b.advertised


def test_a_backlog_is_as_deep_as_its_attempts_are_short() -> None:
    """`r` rounds deep, its last held dispatch waits about `r` attempts: the lines (a quarter
    and a half of hold_s) apply to `r` times the mean, and the deepest that fits is offered."""
    b = Backlog(8, hold_s=2.0, window=4, slots=4)  # two rounds of 4 at most
    assert [b.ran(0.35) for _ in range(4)] == [False, False, False, True]
    assert b.advertised == 4  # 0.35 s <= 0.5 s for one round; 2 x 0.35 s is not
    assert not b.ran(0.1)  # mean 0.2875 s, x2 = 0.575 s: still one round
    assert b.ran(0.1)  # mean 0.225 s, x2 = 0.45 s <= 0.5 s: two rounds, the whole limit
    assert b.advertised == 8
    assert not b.ran(0.9)  # mean 0.3625 s, x2 = 0.725 s: between the lines, still two
    assert b.ran(1.9)  # mean 0.75 s, x2 = 1.5 s > 1 s: back to the one round under 1 s
    assert b.advertised == 4
    assert b.ran(1.9)  # mean 1.2 s > 1 s even for one round: off
    assert b.advertised == 0


@given(st.lists(st.floats(min_value=0, max_value=3, allow_nan=False), max_size=200))
def test_it_advertises_whole_rounds_within_the_limit_and_reports_every_change(
    runs: list[float],
) -> None:
    b = Backlog(10, hold_s=1.0, window=4, slots=3)  # four rounds, the last one short
    levels = {0, 3, 5, 8, 10}  # ceil(10 * r / 4) for r in 0..4
    before = b.advertised
    window: list[float] = []
    for r in runs:
        changed = b.ran(r)
        window = [*window, r][-4:]
        assert b.advertised in levels
        assert changed == (b.advertised != before)
        # once judged, what is offered never has its last held dispatch wait past half of
        # hold_s (at the window's mean)
        if len(window) == 4:
            assert b.depth * (sum(window) / 4) <= 0.5 + 1e-9
        before = b.advertised


def test_the_default_backlog_is_four_rounds_of_slots_and_a_number_is_taken_as_it_is() -> None:
    from shared.settings import Settings

    assert Settings(slots=16).backlog_limit == 64
    assert Settings(slots=16, prefetch=5).backlog_limit == 5
    assert Settings(slots=16, prefetch=0).backlog_limit == 0


def test_held_dispatches_start_in_the_lines_order() -> None:
    """A lower score goes first (0.0 and negatives are scores too), ties and the unscored
    (placed when nothing waited) in arrival order, the unscored first."""
    assert next_in_line([5.0, -1.0, 0.0, None, 0.0], 5) == [3, 1, 2, 4, 0]
    assert next_in_line([1.0, 2.0, 3.0], 2) == [0, 1]
    assert next_in_line([], 3) == []


class _Held:
    def __init__(self, line: float | None, received_at: float) -> None:
        self.line, self.received_at = line, received_at


def test_held_taken_out_of_order_go_back_in_arrival_order() -> None:
    """The line's first is taken from the middle; put back unclaimed, it goes back among the
    held by arrival, so the hand-back (oldest first) still finds the oldest at the front."""
    old, new, newest = _Held(9.0, 1.0), _Held(1.0, 2.0), _Held(5.0, 3.0)
    held = deque([old, new, newest])
    assert take(held, 1) == [new]
    assert list(held) == [old, newest]
    hold_again(held, [new])
    assert list(held) == [old, new, newest]


def test_remove_takes_out_only_those_still_held_by_identity_keeping_the_order() -> None:
    """The held dispatches whose task moved on are removed after a read; a claim may have
    taken some meanwhile (those are the claim's), and two entries of one attempt are equal
    in every field yet only the one named goes."""
    a, b, c, twin = _Held(1.0, 1.0), _Held(2.0, 2.0), _Held(3.0, 3.0), _Held(2.0, 2.0)
    held = deque([a, b, c, twin])
    claimed = take(held, 1)  # a, meanwhile
    assert remove(held, [a, b]) == [b]
    assert list(held) == [c, twin]
    assert claimed == [a]
    assert remove(held, []) == []
