"""Placement: filter reasons, score order, ties, selectors, and a property over random nodes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.placement import Need, NodeState, choose, fits, place_many, score


def node(nid: str, **kw: object) -> NodeState:
    base: dict[str, object] = {"slots": 4, "cpu": 8.0, "memory_mb": 16_000, "gpu": 0}
    base.update(kw)
    return NodeState(id=nid, **base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("need", "nodes", "reason"),
    [
        (Need(), [], "no ready node"),
        (Need(), [node("a", ready=False)], "no ready node"),
        (Need(gpu=2), [node("a"), node("b", gpu=1)], "no node has gpu >= 2"),
        (Need(cpu=16), [node("a")], "no node has cpu >= 16"),
        (Need(memory_mb=32_000), [node("a")], "no node has memory_mb >= 32000"),
        (
            Need(selector={"zone": "eu"}),
            [node("a", labels={"zone": "us"})],
            "no node matches selector zone=eu",
        ),
        (Need(), [node("a", used_slots=4)], "all 1 node(s) that fit are full"),
        (Need(cpu=4), [node("a", used_cpu=6.0)], "all 1 node(s) that fit are full"),
    ],
)
def test_filter_reasons(need: Need, nodes: list[NodeState], reason: str) -> None:
    choice = choose(need, nodes)
    assert choice.node is None
    assert choice.reason == reason


def test_prefers_the_emptier_node() -> None:
    busy = node("a", used_slots=3, used_cpu=6.0)
    idle = node("b")
    assert choose(Need(cpu=1), [busy, idle]).node == idle


def test_prefers_lower_load() -> None:
    assert choose(Need(), [node("a", load=0.9), node("b", load=0.1)]).node.id == "b"  # type: ignore[union-attr]


def test_affinity_breaks_even_scores() -> None:
    need = Need(affinity={"disk": "ssd"})
    nodes = [node("a"), node("b", labels={"disk": "ssd"})]
    assert choose(need, nodes).node.id == "b"  # type: ignore[union-attr]


def test_a_task_placed_again_goes_to_another_node_when_one_fits() -> None:
    """A retry (after its attempt was lost, say) or a dispatch handed back avoids the node of
    its last attempt, however well that node scores; alone, it takes it."""
    best, worse = node("a", labels={"disk": "ssd"}), node("b", load=0.9, used_slots=3)
    need = Need(affinity={"disk": "ssd"}, avoid="a")
    assert choose(need, [best, worse]).node.id == "b"  # type: ignore[union-attr]
    assert choose(need, [best]).node.id == "a"  # type: ignore[union-attr]
    full = node("b", used_slots=4)
    assert choose(need, [best, full]).node.id == "a"  # type: ignore[union-attr]
    assert choose(Need(affinity={"disk": "ssd"}), [best, worse]).node.id == "a"  # type: ignore[union-attr]


def test_ties_go_to_the_lowest_id() -> None:
    nodes = [node("c"), node("a"), node("b")]
    assert choose(Need(), nodes).node.id == "a"  # type: ignore[union-attr]


def test_a_tie_goes_to_a_node_heard_from_on_time_over_one_gone_quiet() -> None:
    """A node frozen or cut off stays live until its TTL, its last load still on its row:
    between equal scores, one heard from over LATE_S later than another loses."""
    quiet, beating = node("a", heard_at=1000.0), node("b", heard_at=1007.0)
    assert choose(Need(), [quiet, beating]).node.id == "b"  # type: ignore[union-attr]
    on_time = node("a", heard_at=1006.5)  # within LATE_S: the lowest id, as ever
    assert choose(Need(), [on_time, beating]).node.id == "a"  # type: ignore[union-attr]
    busy = node("b", heard_at=1007.0, load=0.9)  # a better score still wins
    assert choose(Need(), [quiet, busy]).node.id == "a"  # type: ignore[union-attr]


def test_selector_must_match_every_label() -> None:
    need = Need(selector={"zone": "eu", "disk": "ssd"})
    nodes = [node("a", labels={"zone": "eu"}), node("b", labels={"zone": "eu", "disk": "ssd"})]
    assert choose(need, nodes).node.id == "b"  # type: ignore[union-attr]


def test_place_many_sees_earlier_reservations() -> None:
    nodes = [node("a", slots=1, gpu=2), node("b", slots=5)]
    needs = [(i, Need(gpu=1)) for i in range(3)]
    placed, unplaced = place_many(needs, nodes)
    assert placed == {0: "a"}
    assert {k: c.reason for k, c in unplaced.items()} == {
        1: "all 1 node(s) that fit are full",
        2: "all 1 node(s) that fit are full",
    }
    assert all(c.fits_later for c in unplaced.values())


def test_a_task_no_node_can_take_does_not_wait_for_room() -> None:
    nodes = [node("a", slots=1, used_slots=1)]
    assert choose(Need(), nodes).fits_later
    assert not choose(Need(gpu=1), nodes).fits_later
    assert not choose(Need(selector={"zone": "eu"}), nodes).fits_later


def test_score_counts_only_resources_the_node_has() -> None:
    plain = node("a", gpu=0)
    assert 0 <= score(plain, Need()) <= 1


nodes_st = st.lists(
    st.builds(
        NodeState,
        id=st.text("abcdef", min_size=1, max_size=3),
        slots=st.integers(1, 4),
        cpu=st.sampled_from([0.0, 1.0, 2.0, 8.0]),
        memory_mb=st.sampled_from([0, 512, 4096]),
        gpu=st.integers(0, 2),
        labels=st.dictionaries(st.sampled_from(["zone", "disk"]), st.sampled_from(["x", "y"])),
        ready=st.booleans(),
        load=st.floats(0, 1),
        used_slots=st.integers(0, 4),
        used_cpu=st.sampled_from([0.0, 1.0, 4.0]),
        used_memory_mb=st.sampled_from([0, 256, 4096]),
        used_gpu=st.integers(0, 2),
    ),
    max_size=6,
    unique_by=lambda n: n.id,
)
need_st = st.builds(
    Need,
    cpu=st.sampled_from([0.0, 0.5, 1.0, 4.0]),
    memory_mb=st.sampled_from([0, 256, 1024]),
    gpu=st.integers(0, 2),
    selector=st.dictionaries(st.sampled_from(["zone", "disk"]), st.sampled_from(["x", "y"])),
)


@settings(max_examples=500, deadline=None)
@given(need=need_st, nodes=nodes_st)
def test_a_chosen_node_satisfies_every_requirement(need: Need, nodes: list[NodeState]) -> None:
    choice = choose(need, nodes)
    if choice.node is None:
        assert not any(fits(n, need) for n in nodes)
        assert choice.reason
        return
    n = choice.node
    assert n.ready
    assert n.used_slots < n.slots
    assert n.used_cpu + need.cpu <= n.cpu + 1e-9
    assert n.used_memory_mb + need.memory_mb <= n.memory_mb
    assert n.used_gpu + need.gpu <= n.gpu
    assert all(n.labels.get(k) == v for k, v in need.selector.items())


@settings(max_examples=200, deadline=None)
@given(needs=st.lists(need_st, max_size=12), nodes=nodes_st)
def test_place_many_never_overcommits(needs: list[Need], nodes: list[NodeState]) -> None:
    placed, _ = place_many(list(enumerate(needs)), nodes)
    for n in nodes:
        mine = [needs[i] for i, nid in placed.items() if nid == n.id]
        if not mine:
            continue
        assert n.used_slots + len(mine) <= n.slots
        assert n.used_cpu + sum(m.cpu for m in mine) <= n.cpu + 1e-9
        assert n.used_memory_mb + sum(m.memory_mb for m in mine) <= n.memory_mb
        assert n.used_gpu + sum(m.gpu for m in mine) <= n.gpu


def test_a_backlog_takes_dispatches_beyond_the_slots_but_no_more_resources() -> None:
    """A node with prefetch holds up to slots + prefetch attempts (the extra ones wait there
    for a slot); cpu, memory and gpu are reserved for every one of them as ever."""
    full = node("a", slots=2, prefetch=2, used_slots=2)
    assert fits(full, Need())
    assert not fits(node("a", slots=2, prefetch=2, used_slots=4), Need())
    assert not fits(node("a", slots=2, prefetch=2, used_slots=2, used_cpu=8.0), Need(cpu=1))
    placed, unplaced = place_many([(i, Need()) for i in range(6)], [full])  # type: ignore[misc]
    assert len(placed) == 2
    assert len(unplaced) == 4
    # among nodes with a backlog, the emptier one (by its whole capacity) goes first
    assert choose(Need(), [full, node("b", slots=2, prefetch=2, used_slots=1)]).node.id == "b"  # type: ignore[union-attr]
