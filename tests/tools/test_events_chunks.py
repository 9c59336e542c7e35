"""The fleet publisher's table of what Redis holds: which key changes a router hears of, per
group and usable, and the keys it believes present (what a resync compares with Redis)."""

from __future__ import annotations

from hma_redis.tools.events.chunks import Change, ChunkTable, Layout

H = "ab" * 32


def test_a_group_is_present_only_with_every_ranks_key_and_usable_only_with_every_group() -> None:
    table = ChunkTable("hma")
    assert table.set_layout("ns", Layout(num_groups=2, world_size=2)) == []
    assert table.apply(f"hma:ns:g0:{H}:r0", True) == []
    assert table.apply(f"hma:ns:g0:{H}:r1", True) == [Change("ns", H, 0, True)]
    assert table.apply(f"hma:ns:g1:{H}:r1", True) == []
    assert table.apply(f"hma:ns:g1:{H}:r0", True) == [
        Change("ns", H, None, True),
        Change("ns", H, 1, True),
    ]
    assert table.apply(f"hma:ns:g1:{H}:r0", True) == []  # written twice: nothing new
    assert table.apply(f"hma:ns:g0:{H}:r1", False) == [
        Change("ns", H, None, False),
        Change("ns", H, 0, False),
    ]
    assert table.keys() == {f"hma:ns:g0:{H}:r0", f"hma:ns:g1:{H}:r0", f"hma:ns:g1:{H}:r1"}
    assert len(table) == 3


def test_a_layout_learnt_late_makes_held_chunks_usable() -> None:
    table = ChunkTable("hma")
    assert table.apply(f"hma:ns:g0:{H}", True) == [Change("ns", H, 0, True)]
    assert table.apply(f"hma:ns:g1:{H}", True) == [Change("ns", H, 1, True)]
    assert table.set_layout("ns", Layout(num_groups=2, world_size=1)) == [
        Change("ns", H, None, True)
    ]
    assert table.keys() == {f"hma:ns:g0:{H}", f"hma:ns:g1:{H}"}


def test_keys_outside_the_scope_and_removals_of_unknown_keys_change_nothing() -> None:
    table = ChunkTable("hma", namespace="ns")
    for key in (
        f"hma:other:g0:{H}",  # another namespace
        f"other:ns:g0:{H}",  # another prefix
        f"hma:ns:seen:g0:{H}",  # an admission marker
        "hma:ns:info",
        "hma:events",
        f"hma:ns:g0:{H}:x1",  # no rank suffix of the tier's
        f"hma:ns:g01:{H}",  # no group number of the tier's
        "hma:ns:g0:nothex",
    ):
        assert table.apply(key, True) == [], key
    assert table.apply(f"hma:ns:g0:{H}", False) == []
    assert len(table) == 0 and table.keys() == frozenset()


def test_info_fields_give_the_layout_and_odd_ones_none() -> None:
    fields = {
        "num_groups": "2",
        "world_size": "1",
        "g0.kind": "full_attention",
        "g1.kind": "sliding_window:32",
    }
    assert Layout.from_info(fields) == Layout(
        2, 1, ("full_attention", "sliding_window"), (None, 32)
    )
    assert Layout.from_info({"num_groups": "two"}) is None
    assert Layout.from_info({"world_size": "1"}) is None
    assert Layout.from_info({"num_groups": "0"}) is None
