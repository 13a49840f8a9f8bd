"""The KV values' encoding (consul_rdzv/layout.py): what is stored, what is read back."""

from __future__ import annotations

import json

from consul_rdzv.client import KVEntry
from consul_rdzv.layout import FORMAT_VERSION, Drain, Leader, Member, Round


def entry(value: bytes, *, session: str | None = None) -> KVEntry:
    return KVEntry(key="p/k", value=value, create_index=7, modify_index=9, lock_index=1,
                   flags=0, session=session)


def test_member_value_holds_every_field_but_the_entry_s_own():
    member = Member(node="n1", host="h1", pid=42, want=3, rank=1,
                    endpoint={"host": "127.0.0.1", "port": 29500}, meta={"zone": "a"},
                    incarnation="abc", started=1.5, min_nodes=2, max_nodes=4, health="",
                    at=2.5, create_index=5, modify_index=6, session="s")
    data = json.loads(member.encode())
    assert data == {"v": FORMAT_VERSION, "node": "n1", "host": "h1", "pid": 42, "want": 3,
                    "rank": 1, "endpoint": {"host": "127.0.0.1", "port": 29500},
                    "meta": {"zone": "a"}, "incarnation": "abc", "started": 1.5,
                    "min_nodes": 2, "max_nodes": 4, "health": "", "at": 2.5}
    back = Member.decode(entry(member.encode(), session="s2"))
    assert back == member  # the indexes and session come from the entry (not compared)
    assert (back.create_index, back.modify_index, back.session) == (7, 9, "s2")


def test_round_value_round_trips_and_keeps_nested_values():
    sealed = Round(round=4, ranks=["a", "b"], store={"host": "h", "port": 1}, members_index=3,
                   joined_index=2, coordinator="a", seal_id="x", min_nodes=2, max_nodes=2,
                   incarnations=["0123456789ab", "ba9876543210"], job="j",
                   totals={"rounds": 4, "causes": {"lost": 1}}, recent=[{"cause": "lost"}],
                   modify_index=11, session="s")
    data = json.loads(sealed.encode())
    assert "modify_index" not in data and "session" not in data
    assert data["totals"] == {"rounds": 4, "causes": {"lost": 1}}
    assert data["recent"] == [{"cause": "lost"}]
    assert Round.decode(entry(sealed.encode())) == sealed


def test_encoding_is_canonical_and_compact():
    """Sorted keys, no spaces: equal states give equal bytes."""
    raw = Leader(node="n", session="s", since=1.0).encode()
    assert raw == b'{"node":"n","session":"s","since":1.0,"v":%d}' % FORMAT_VERSION
    drain = Drain(node="n", incarnation="i", by="op", reason="r", at=3.0, modify_index=5)
    assert json.loads(drain.encode()) == {"v": FORMAT_VERSION, "node": "n", "incarnation": "i",
                                          "by": "op", "reason": "r", "at": 3.0}
    assert Drain.decode(entry(drain.encode())) == drain
