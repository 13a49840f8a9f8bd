"""The KV layout of one run and the JSON values stored there (format version 1).

``P = <key_prefix>/<run_id>``; docs/protocol.md is the prose version of this module.

| key | held / written by | value |
|---|---|---|
| ``P/members/<node_id>`` | the node, locked by its session (deleted with it) | :class:`Member` |
| ``P/round/leader`` | the coordinator, locked by its session | :class:`Leader` |
| ``P/round/current`` | the coordinator (CAS), and ``close()`` (CAS) | :class:`Round` |
| ``P/drain/<node_id>`` | an operator (``consul-rdzv drain``) | :class:`Drain` |
| ``H/<job>/rounds/<round>`` | the coordinator, in its seal transaction | a round record |
| ``H/<job>/totals`` | the coordinator, in its seal transaction | the job's totals |
| ``H/<job>/archive/<i>`` | the run's last node (and ``gc``), locked (history_retention) | records |
| ``Q/<host>`` | a node of that host (CAS), an operator (``quarantine``) | a quarantine |

The records and totals are :mod:`consul_rdzv.history`'s.

``H = <key_prefix>/~history/<run_id>``: outside ``P/``, which the coordinator reads whole at
every change (``~`` is not allowed in a run id, so no run's prefix can be ``H``). ``<job>``: the
first round's seal id of one job on the run id (a re-run is a new job).

``Q = <key_prefix>/~quarantine``: one key per quarantined host (the member key's ``host``),
shared by every run under the key prefix (:mod:`consul_rdzv.quarantine`).

Values are JSON objects carrying ``"v": 1``; anything else under the prefix is rejected with a
``RendezvousStateError`` that names the key. Never pickle.
"""

from __future__ import annotations

import json
import urllib.parse
from dataclasses import dataclass, field, fields
from typing import Any

from .client import KVEntry
from .errors import RendezvousStateError

FORMAT_VERSION = 1
#: The folder of the round histories under the key prefix (``~``: never a run id).
HISTORY_DIR = "~history"
#: Rounds kept in detail per job (the totals count every round).
HISTORY_ROUNDS = 1000
#: Node names kept per list in a history record (the count is kept too).
HISTORY_NAMES = 16
#: The folder of the hosts' quarantine under the key prefix (``~``: never a run id).
QUARANTINE_DIR = "~quarantine"


class Keys:
    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.members = f"{prefix}/members/"
        self.round_dir = f"{prefix}/round/"
        self.leader = f"{prefix}/round/leader"
        self.round = f"{prefix}/round/current"
        self.drains = f"{prefix}/drain/"
        key_prefix, _, run_id = prefix.rpartition("/")
        #: H/: the run's round history (outside P/: see the module docstring)
        self.history = f"{key_prefix}/{HISTORY_DIR}/{run_id}/"
        #: Q/: the hosts' quarantine, shared by every run under the key prefix
        self.quarantine = quarantine_dir(key_prefix)

    def quarantined(self, host: str) -> str:
        return quarantine_key(self.quarantine, host)

    def job(self, job: str) -> str:
        return f"{self.history}{job}/"

    def history_round(self, job: str, number: int) -> str:
        return f"{self.history}{job}/rounds/{number:010d}"

    def history_totals(self, job: str) -> str:
        return f"{self.history}{job}/totals"

    def history_archive(self, job: str, part: int) -> str:
        return f"{self.history}{job}/archive/{part:04d}"

    def member(self, node_id: str) -> str:
        return self.members + node_id

    def drain(self, node_id: str) -> str:
        return self.drains + node_id

    def __repr__(self) -> str:
        return f"Keys({self.prefix!r})"


def _decode(entry: KVEntry, what: str) -> dict[str, Any]:
    raw = entry.value or b""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise RendezvousStateError(
            f"Consul key {entry.key!r} does not hold consul-rdzv {what} state ({exc}). Another "
            "program may be using this prefix: delete the key (consul kv delete) or pick another "
            "run id or key_prefix."
        ) from None
    if not isinstance(data, dict) or data.get("v") != FORMAT_VERSION:
        version = data.get("v") if isinstance(data, dict) else None
        raise RendezvousStateError(
            f"Consul key {entry.key!r} holds {what} state of format version {version!r}; this "
            f"consul-rdzv reads version {FORMAT_VERSION}. Run every node with the same "
            "consul-rdzv release, or delete the key."
        )
    return data


def _list(data: dict[str, Any], name: str) -> list:
    value = data.get(name) or []
    if not isinstance(value, list):
        raise ValueError(f"{name} {value!r} is not a list")
    return value


def _encode(obj: Any, *, skip: tuple[str, ...] = ()) -> bytes:
    """JSON with the format version; ``skip`` names fields read from the KV entry, not stored.

    The fields are read as they are (no ``dataclasses.asdict``, which deep-copies every value:
    ten times the cost for a round of 256 ranks, on the seal's path); none of these classes
    nests another dataclass, so the JSON is the same."""
    data = {f.name: getattr(obj, f.name) for f in fields(obj) if f.name not in skip}
    return json.dumps({"v": FORMAT_VERSION, **data}, separators=(",", ":"),
                      sort_keys=True).encode()


@dataclass
class Member:
    node: str
    host: str
    pid: int
    want: int = 0  # lowest round number this node can join (last round it saw + 1)
    rank: int | None = None  # explicit rank request
    endpoint: dict | None = None  # where this node would host the trainer store as rank 0
    meta: dict = field(default_factory=dict)
    incarnation: str = ""  # unique per process (per ConsulRendezvous), see Incarnation
    started: float = 0.0  # wall-clock start of that incarnation: the newest one wins a node id
    min_nodes: int = 0  # this node's settings, for operators (consul-rdzv status)
    max_nodes: int = 0
    #: why this node's Consul node holds it out of rounds (a critical node check, maintenance:
    #: consul_rdzv.health); "" while it may train
    health: str = ""
    at: float = 0.0  # wall-clock time of this announcement (the round history's clock)
    # filled from the KV entry, not stored
    create_index: int = field(default=0, compare=False)
    modify_index: int = field(default=0, compare=False)
    session: str | None = field(default=None, compare=False)

    def encode(self) -> bytes:
        return _encode(self, skip=("create_index", "modify_index", "session"))

    @classmethod
    def decode(cls, entry: KVEntry) -> Member:
        data = _decode(entry, "member")
        try:
            return cls(
                node=str(data["node"]), host=str(data.get("host", "")), pid=int(data.get("pid", 0)),
                want=int(data.get("want", 0)),
                rank=None if data.get("rank") is None else int(data["rank"]),
                endpoint=data.get("endpoint"), meta=dict(data.get("meta") or {}),
                incarnation=str(data.get("incarnation", "")),
                started=float(data.get("started", 0.0)),
                min_nodes=int(data.get("min_nodes", 0)), max_nodes=int(data.get("max_nodes", 0)),
                health=str(data.get("health") or ""),
                at=float(data.get("at", 0.0)),
                create_index=entry.create_index,
                modify_index=entry.modify_index, session=entry.session,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise RendezvousStateError(
                f"Consul key {entry.key!r} holds a malformed member value ({exc!r})."
            ) from None


@dataclass
class Leader:
    node: str
    session: str
    since: float

    def encode(self) -> bytes:
        return _encode(self)

    @classmethod
    def decode(cls, entry: KVEntry) -> Leader:
        data = _decode(entry, "leader")
        return cls(node=str(data.get("node", "")), session=str(data.get("session", "")),
                   since=float(data.get("since", 0.0)))


@dataclass
class Round:
    """A sealed round (``ranks`` non-empty) or just the closed marker (``round`` 0)."""

    round: int = 0
    ranks: list[str] = field(default_factory=list)  # node ids; index = rank
    store: dict | None = None  # {"host": ..., "port": ...} of rank 0's trainer store
    members_index: int = 0  # X-Consul-Index of the member snapshot the round was sealed from
    joined_index: int = 0  # the newest ModifyIndex among the participants' keys in that snapshot
    coordinator: str = ""
    seal_id: str = ""
    first_join: float = 0.0  # wall-clock figures for the benchmark
    quorum_at: float = 0.0
    sealed_at: float = 0.0
    min_nodes: int = 0  # the sealing coordinator's settings: they decide the round's room
    max_nodes: int = 0
    closed: dict | None = None  # {reason, at, by, outcome: "finished" / "failed" / "closed"}
    #: The process of each rank: the first INCARNATION_TAG hex digits of its incarnation id
    #: (service.incarnation_tag). Every node reads this value at each seal, so it names each
    #: rank by as few bytes as tell processes apart: no hosts (their member keys and services
    #: show them), no full incarnation ids.
    incarnations: list[str] = field(default_factory=list)
    #: The job's round history as it goes (H/<job>/): its id, its totals, the last endings
    job: str = ""
    totals: dict = field(default_factory=dict)
    recent: list = field(default_factory=list)
    modify_index: int = field(default=0, compare=False)
    #: The session holding the key: a finished run's closed marker kept for a while
    session: str | None = field(default=None, compare=False)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def encode(self) -> bytes:
        return _encode(self, skip=("modify_index", "session"))

    @classmethod
    def decode(cls, entry: KVEntry) -> Round:
        data = _decode(entry, "round")
        try:
            ranks = [str(n) for n in _list(data, "ranks")]
            if len(set(ranks)) != len(ranks):
                raise ValueError("a node appears twice in ranks")
            incarnations = [str(i) for i in _list(data, "incarnations")]
            if incarnations and len(incarnations) != len(ranks):
                raise ValueError(f"{len(incarnations)} incarnations for {len(ranks)} ranks")
            store = data.get("store")
            if store is not None and not (
                    isinstance(store, dict) and isinstance(store.get("host"), str)
                    and isinstance(store.get("port"), int)):
                raise ValueError(f"store {store!r} is not {{host, port}}")
            closed = data.get("closed")
            if closed is not None and not isinstance(closed, dict):
                raise ValueError(f"closed {closed!r} is not an object")
            totals = data.get("totals") or {}
            if not isinstance(totals, dict):
                raise ValueError(f"totals {totals!r} is not an object")
            return cls(
                round=int(data.get("round", 0)), ranks=ranks, store=store,
                members_index=int(data.get("members_index", 0)),
                joined_index=int(data.get("joined_index", 0)),
                incarnations=incarnations,
                coordinator=str(data.get("coordinator", "")), seal_id=str(data.get("seal_id", "")),
                first_join=float(data.get("first_join", 0.0)),
                quorum_at=float(data.get("quorum_at", 0.0)),
                sealed_at=float(data.get("sealed_at", 0.0)),
                min_nodes=int(data.get("min_nodes", 0)), max_nodes=int(data.get("max_nodes", 0)),
                closed=closed, job=str(data.get("job", "")), totals=totals,
                recent=[r for r in _list(data, "recent") if isinstance(r, dict)],
                modify_index=entry.modify_index, session=entry.session,
            )
        except (TypeError, ValueError) as exc:
            raise RendezvousStateError(
                f"Consul key {entry.key!r} holds a malformed round value ({exc})."
            ) from None


@dataclass
class Drain:
    """An operator's request that one process of a node leave the run for good."""

    node: str
    incarnation: str = ""  # the process to drain ("": any process with this node id)
    by: str = ""
    reason: str = ""
    at: float = 0.0
    modify_index: int = field(default=0, compare=False)

    def encode(self) -> bytes:
        return _encode(self, skip=("modify_index",))

    @classmethod
    def decode(cls, entry: KVEntry) -> Drain:
        data = _decode(entry, "drain")
        return cls(node=str(data.get("node", "")), incarnation=str(data.get("incarnation", "")),
                   by=str(data.get("by", "")), reason=str(data.get("reason", "")),
                   at=float(data.get("at", 0.0)), modify_index=entry.modify_index)


@dataclass
class RunState:
    """Everything under ``P/`` at one index."""

    members: dict[str, Member] = field(default_factory=dict)
    leader: Leader | None = None
    leader_session: str | None = None
    round: Round | None = None
    drains: dict[str, Drain] = field(default_factory=dict)

    @classmethod
    def parse(cls, keys: Keys, entries: list[KVEntry]) -> RunState:
        state = cls()
        for entry in entries:
            if entry.key.startswith(keys.members):
                node = entry.key[len(keys.members):]
                member = Member.decode(entry)
                if member.node != node:
                    raise RendezvousStateError(
                        f"Consul key {entry.key!r} claims node {member.node!r}; the key and the "
                        "value must name the same node."
                    )
                state.members[node] = member
            elif entry.key == keys.leader:
                state.leader_session = entry.session
                if entry.session and entry.value:
                    state.leader = Leader.decode(entry)
            elif entry.key == keys.round:
                state.round = Round.decode(entry)
            elif entry.key.startswith(keys.drains) and not entry.key.endswith("/"):
                drain = Drain.decode(entry)
                state.drains[entry.key[len(keys.drains):]] = drain
            elif entry.key.endswith("/"):
                continue  # folder markers made by the UI
            else:
                raise RendezvousStateError(
                    f"Unexpected Consul key {entry.key!r} under the run's prefix {keys.prefix!r}. "
                    "Delete it or use another run id / key_prefix."
                )
        return state


# ----------------------------------------------------------------------------- quarantine


def quarantine_dir(key_prefix: str) -> str:
    """``Q/``: the folder of the hosts' quarantine keys under ``key_prefix``."""
    return f"{key_prefix}/{QUARANTINE_DIR}/"


def quarantine_key(folder: str, host: str) -> str:
    """A host's quarantine key in ``folder`` (the host name percent-quoted: one key segment)."""
    return folder + urllib.parse.quote(host, safe="")


# ----------------------------------------------------------------------------- round history


def history_value(data: dict[str, Any]) -> bytes:
    """A history record (or totals, or an archive part) as stored: JSON with the version."""
    return json.dumps({"v": FORMAT_VERSION, **data}, separators=(",", ":"),
                      sort_keys=True).encode()


def decode_history(entry: KVEntry) -> dict[str, Any]:
    """A history value; a RendezvousStateError naming the key if it is not one."""
    return _decode(entry, "round history")


@dataclass
class History:
    """One job's round history as read from ``H/<job>/``: records oldest first."""

    job: str
    records: list[dict] = field(default_factory=list)
    totals: dict = field(default_factory=dict)
    #: the archive's session (the job ended and its history is kept for history_retention)
    session: str | None = None

    @classmethod
    def parse(cls, keys: Keys, entries: list[KVEntry]) -> list[History]:
        """Every job under ``H/``, the newest (latest first sealed) last."""
        jobs: dict[str, History] = {}
        for entry in entries:
            rest = entry.key[len(keys.history):]
            if entry.key.endswith("/") or "/" not in rest:
                continue
            job, _, name = rest.partition("/")
            hist = jobs.setdefault(job, cls(job))
            data = decode_history(entry)
            if name == "totals":
                hist.totals = data
            elif name.startswith("rounds/"):
                hist.records.append(data)
            elif name.startswith("archive/"):
                hist.records.extend(r for r in data.get("records") or [] if isinstance(r, dict))
                hist.session = hist.session or entry.session
            else:
                raise RendezvousStateError(
                    f"Unexpected Consul key {entry.key!r} in the round history of "
                    f"{keys.history!r}. Delete it."
                )
        for hist in jobs.values():
            unique = {int(r.get("round", 0)): r for r in hist.records}
            hist.records = [unique[n] for n in sorted(unique)]
        return sorted(jobs.values(), key=lambda h: float(h.totals.get("since") or 0.0))
