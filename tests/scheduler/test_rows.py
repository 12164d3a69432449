"""How a frontal server cuts rows among its clients (scheduler/rows.py), driven as pure functions."""

from __future__ import annotations

import collections

from scheduler.rows import LOCAL_EDGE, cut_rows, local_first, note_cut, owed_more

EQUAL = [("a", 1.0), ("b", 1.0), ("c", 1.0), ("d", 1.0)]


def cut_batches(clients, batches: int, per_batch: int, micro_batches: int = 4, rows: int = 4, min_task_rows: int = 4):
    """Cut `batches` batches as a frontal server does: the clients of each micro-batch, per batch."""
    credit, out = {}, []
    for _ in range(batches):
        members, got = [], collections.Counter()
        for _ in range(micro_batches):
            for client, a, b in cut_rows(0, rows, clients, credit, min_task_rows, members, per_batch):
                got[client] += b - a
        out.append(got)
    return out


def test_a_batch_goes_to_one_client_and_the_next_batch_to_the_next():
    batches = cut_batches(EQUAL, 8, per_batch=1)
    assert [dict(b) for b in batches[:4]] == [{"a": 16}, {"b": 16}, {"c": 16}, {"d": 16}]
    assert sum(batches, collections.Counter()) == {"a": 32, "b": 32, "c": 32, "d": 32}


def test_two_members_a_batch_split_it_and_shares_follow_the_weights_over_batches():
    batches = cut_batches(EQUAL, 4, per_batch=2)
    assert all(len(b) == 2 and sorted(b.values()) == [8, 8] for b in batches)
    fast = [("a", 3.0), ("b", 1.0), ("c", 1.0), ("d", 1.0)]
    total = sum(cut_batches(fast, 24, per_batch=1), collections.Counter())
    assert total["a"] == 3 * total["b"] == 3 * total["c"] == 3 * total["d"]


def test_members_that_leave_are_replaced_only_when_none_is_left():
    credit, members = {}, []
    assert [c for c, _, _ in cut_rows(0, 4, EQUAL, credit, 4, members, 2)] == ["a"]
    assert members == ["a", "b"]
    left = [c for c in EQUAL if c[0] != "a"]
    assert [c for c, _, _ in cut_rows(0, 4, left, credit, 4, members, 2)] == ["b"]  # the member still here
    assert members == ["a", "b"]
    rest = [c for c in EQUAL if c[0] in ("c", "d")] + [("e", 1.0)]  # a and b gone, e new
    assert [c for c, _, _ in cut_rows(0, 4, rest, credit, 4, members, 2)] == ["c"]
    assert members == ["c", "d"]  # the two owed the most (e is owed only this micro-batch's share)


def test_per_batch_as_large_as_the_clients_is_the_plain_cut():
    """Without a restriction (or with room for every client) every micro-batch is cut as before."""
    for per_batch, members in ((0, []), (4, []), (9, []), (1, None)):
        plain = cut_rows(0, 4, EQUAL, {}, 1)
        assert (
            cut_rows(0, 4, EQUAL, {}, 1, members, per_batch)
            == plain
            == [("a", 0, 1), ("b", 1, 2), ("c", 2, 3), ("d", 3, 4)]
        )
        assert members in ([], None)


def test_a_client_is_owed_the_rest_of_a_batch_only_while_it_got_a_piece_of_every_micro_batch():
    cuts = {}
    note_cut(cuts, 7, {"a"})
    assert owed_more(cuts, 7, "a", 4) and not owed_more(cuts, 7, "b", 4) and not owed_more(cuts, 8, "a", 4)
    note_cut(cuts, 7, {"a", "b"})
    assert owed_more(cuts, 7, "a", 4) and not owed_more(cuts, 7, "b", 4)  # b missed the first
    note_cut(cuts, 7, {"b"})
    assert not owed_more(cuts, 7, "a", 4)  # a missed this one: the rest may not be its
    cuts = {}
    for _ in range(4):
        note_cut(cuts, 3, {"a"})
    assert not owed_more(cuts, 3, "a", 4)  # every micro-batch is cut: nothing more to come


def test_a_free_server_worker_goes_first_unless_another_client_is_much_faster():
    clients = [("srv-f", 1.0), ("srv-b", 1.0), ("vol-1", 1.0), ("vol-2", 1.0)]
    local = {"srv-f", "srv-b"}
    assert local_first(clients, local, busy=set()) == {"srv-f", "srv-b"}
    assert local_first(clients, local, busy={"srv-f"}) == {"srv-b"}
    assert local_first(clients, local, busy={"srv-f", "srv-b"}) == set()
    assert local_first(clients, set(), busy=set()) == set()
    fast = [("srv-f", 1.0), ("srv-b", 1.0), ("vol-1", LOCAL_EDGE * 1.01), ("vol-2", 1.0)]
    assert local_first(fast, local, busy=set()) == set()  # the volunteer finishes first despite its transfers
    assert local_first(fast, local, busy={"vol-1"}) == {"srv-f", "srv-b"}  # ... unless it is busy
    edge = [("srv-f", 1.0), ("vol-1", LOCAL_EDGE)]
    assert local_first(edge, {"srv-f"}, busy=set()) == {"srv-f"}


def test_members_come_from_the_first_clients_by_the_rows_they_are_owed_then_from_the_rest():
    credit = {"a": 0.0, "b": 5.0, "c": 9.0, "d": 1.0}
    members = []
    pieces = cut_rows(0, 4, EQUAL, credit, 4, members, 1, first={"a", "d"})
    assert members == ["d"] and [c for c, _, _ in pieces] == ["d"]  # d is owed more than a; c is not first
    members = []
    cut_rows(0, 4, EQUAL, credit, 4, members, 3, first={"a"})
    assert members == ["a", "c", "b"]  # the first one, then the rest by the rows they are owed
    members = ["b"]  # a batch's members, once chosen, keep it
    assert [c for c, _, _ in cut_rows(0, 4, EQUAL, credit, 4, members, 1, first={"a"})] == ["b"]
    # with every client a member of every batch (the paper's split) there is nothing to choose
    assert cut_rows(0, 4, EQUAL, {}, 1, [], 4, first={"a"}) == cut_rows(0, 4, EQUAL, {}, 1)
