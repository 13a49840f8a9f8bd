"""Operations on a whole run, for the nodes and for ``consul-rdzv`` alike: close it, drain a node
out of it, and remove what it left in Consul once it is over.

* **close** (:func:`close`): a compare-and-set loop on ``P/round/current`` that writes the
  closed marker, ``{reason, at, by, outcome}`` (:func:`closed_marker`); with a ``seal_id``,
  only while that round is still the current one. ``ConsulRendezvous.close()`` and
  ``close_if_current()`` and ``consul-rdzv close`` all close through it.
* **drain** (:func:`drain`): ``consul-rdzv drain`` writes a drain request (``P/drain/<node>``,
  naming the process) and destroys the node's session, which deletes its member key; the node
  reads the request at its next join and leaves for good, withdrawing it
  (:func:`withdraw_drain`).
* **clean-up**: the last node to leave a run removes what the run left (:func:`clean_up`), and
  keeps a closed run's marker for ``closed_retention``; ``consul-rdzv gc`` deletes what nodes
  that died could not remove (:func:`gc_verdict` decides, :func:`delete_run` deletes).

The keys and values are :mod:`consul_rdzv.layout`'s; docs/protocol.md tells the protocol.
Every write is conditional (CAS, ``delete-cas``, ``check-index``), so an operation that races
with a node changes nothing the node has written since it was read.
"""

from __future__ import annotations

import contextlib
import enum
import time
from dataclasses import dataclass

from .client import MAX_TXN_OPS, ConsulClient, KVEntry, txn_kv
from .errors import ConsulError, ConsulNotFound, ConsulTxnConflict
from .layout import Drain, History, Keys, Member, Round, history_value

#: How a run was closed (the ``outcome`` of its closed marker): its job finished (a node's work
#: succeeded), failed (a node's workers failed past --max-restarts), or closed otherwise
#: (``close()``, ``set_closed()``, an operator).
OUTCOME_FINISHED = "finished"
OUTCOME_FAILED = "failed"
OUTCOME_CLOSED = "closed"


# ----------------------------------------------------------------------------- close


def closed_marker(reason: str, by: str, outcome: str = OUTCOME_CLOSED) -> dict:
    """The ``closed`` record of a round value: why, when, by whom, how the job ended."""
    return {"reason": reason, "at": time.time(), "by": by, "outcome": outcome}


class Closing(enum.Enum):
    """What :func:`close` did."""

    CLOSED = "closed"  # it wrote the closed marker
    ALREADY = "already closed"  # the run was closed already: nothing changed
    MOVED_ON = "moved on"  # the round of ``seal_id`` is no longer the current one: not closed
    CONTENDED = "contended"  # the round key kept changing until the deadline: not closed


@dataclass
class CloseResult:
    result: Closing
    #: The round value as last read (with the marker this call wrote, if it wrote one).
    round: Round

    @property
    def closed(self) -> bool:
        """The run is closed now."""
        return self.result in (Closing.CLOSED, Closing.ALREADY)


def close(client: ConsulClient, keys: Keys, *, reason: str, by: str,
          outcome: str = OUTCOME_CLOSED, seal_id: str | None = None,
          deadline: float) -> CloseResult:
    """Mark the run closed: a CAS on its round key (a round sealed meanwhile is read again).

    ``seal_id``: only if the current round is still the one sealed with it (the closer's job
    has not moved on without it). Gives up (:attr:`Closing.CONTENDED`) once the monotonic
    ``deadline`` has passed; Consul's errors are raised (:class:`ConsulError`).
    """
    while True:
        res = client.kv_get(keys.round, consistent=True, deadline=deadline)
        current = Round.decode(res.data) if res.data else Round()
        if current.closed:
            return CloseResult(Closing.ALREADY, current)
        if seal_id is not None and current.seal_id != seal_id:
            return CloseResult(Closing.MOVED_ON, current)
        current.closed = closed_marker(reason, by, outcome)
        cas = res.data.modify_index if res.data else 0
        if client.kv_put(keys.round, current.encode(), cas=cas, deadline=deadline):
            return CloseResult(Closing.CLOSED, current)
        if time.monotonic() > deadline:
            return CloseResult(Closing.CONTENDED, current)


# ----------------------------------------------------------------------------- drain


@dataclass
class Drained:
    """What :func:`drain` found and did."""

    #: The node's member key as found: None if the node is not in the run (nothing was done).
    entry: KVEntry | None = None
    #: The drain request written for the node's process (None: no session to drain; a member
    #: key without one is deleted at the index read).
    request: Drain | None = None
    member: Member | None = None
    #: The member key is gone (Consul deleted it with the session) within the timeout.
    gone: bool = False


def drain(client: ConsulClient, keys: Keys, node_id: str, *, by: str, reason: str,
          timeout: float) -> Drained:
    """Take a node out of the run now, as if it stopped, and for good.

    Writes the drain request naming the process (the incarnation in its member value: the
    node refuses its next round and leaves, while a later process with the same node id may
    join again), then destroys the node's session; Consul deletes the session's keys (Behavior
    delete) as part of that, which this waits for, at most ``timeout`` seconds.
    """
    entry = client.kv_get(keys.member(node_id)).data
    if entry is None:
        return Drained()
    if not entry.session:
        client.kv_delete(keys.member(node_id), cas=entry.modify_index)
        return Drained(entry, gone=True)
    member = Member.decode(entry)
    request = Drain(node=node_id, incarnation=member.incarnation, by=by, reason=reason,
                    at=time.time())
    client.kv_put(keys.drain(node_id), request.encode())
    with contextlib.suppress(ConsulNotFound):
        client.session_destroy(entry.session)
    index, deadline = 0, time.monotonic() + timeout
    while time.monotonic() < deadline:
        res = client.kv_get(keys.member(node_id), index=index or None, wait=1.0)
        if res.data is None or res.data.session != entry.session:
            return Drained(entry, request, member, gone=True)
        index = res.index
    return Drained(entry, request, member, gone=False)


def withdraw_drain(client: ConsulClient, keys: Keys, node_id: str, request: Drain, *,
                   deadline: float) -> None:
    """Delete a drain request, only as it was read (a newer one stays)."""
    client.txn([txn_kv("delete-cas", keys.drain(node_id), index=request.modify_index)],
               deadline=deadline)


# ----------------------------------------------------------------------------- clean-up


def marker_session_name(run_id: str) -> str:
    """The name of the session that keeps a finished run's closed marker."""
    return f"consul-rdzv {run_id} ended"[:128]


@dataclass(frozen=True)
class CleanUp:
    """What :func:`clean_up` did."""

    #: It removed (or tried to remove, at the indexes read) what the run left.
    removed: bool = False
    #: The closed marker stays, locked by a session of TTL closed_retention.
    kept_marker: bool = False
    #: The round history's jobs archived (kept for history_retention) or removed.
    history: int = 0


def clean_up(client: ConsulClient, keys: Keys, *, run_id: str, closed_retention: float,
             deadline: float, history_retention: float = 0.0) -> CleanUp:
    """Leaving as the run's last member: remove what the run left in Consul.

    Drain requests (for processes that are gone) and the round key are deleted, each at the
    index read (``delete-cas``), so a node that joins meanwhile at worst finds no round and
    starts from round 1. A *closed* run's marker is kept instead, shrunk to the closed record,
    for ``closed_retention``: it is locked by a session of that TTL (no checks), so Consul
    deletes it by itself one to two TTLs later, and until then a straggler of the job that ended
    is refused (``ConsulRendezvous._reopen``). Member and leader keys go with their sessions;
    keys that are not consul-rdzv's are left alone. Nothing is done while a member key or a
    held leader key is there. The round history is archived for ``history_retention``
    (:func:`archive_history`).
    """
    if client.kv_keys(keys.members, deadline=deadline):
        return CleanUp()
    res = client.kv_list(keys.prefix + "/", deadline=deadline)
    ops: list[dict] = []  # the round's first: they must share one transaction
    drains: list[dict] = []
    retained: Round | None = None
    closed: dict | None = None
    for entry in res.data:
        if entry.key.startswith(keys.members) and not entry.key.endswith("/"):
            return CleanUp()  # a node joined meanwhile
        if entry.key == keys.leader and entry.session:
            return CleanUp()  # a coordinator is at work
        if entry.key.startswith(keys.drains) and not entry.key.endswith("/"):
            drains.append(txn_kv("delete-cas", entry.key, index=entry.modify_index))
        elif entry.key == keys.round:
            current = Round.decode(entry)
            closed = current.closed
            if current.closed and entry.session:
                continue  # kept already (a node that left before us)
            if current.closed and closed_retention:
                retained = Round(round=current.round, seal_id=current.seal_id,
                                 closed=current.closed)
                ops.append(txn_kv("check-index", entry.key, index=entry.modify_index))
            else:
                ops.append(txn_kv("delete-cas", entry.key, index=entry.modify_index))
    session = None
    if retained is not None:
        session = client.session_create(
            name=marker_session_name(run_id), node_checks=[], behavior="delete",
            lock_delay="0s", ttl=f"{closed_retention:.0f}s", deadline=deadline)
        ops.append(txn_kv("lock", keys.round, value=retained.encode(), session=session))
    ops += drains
    try:
        for chunk in range(0, len(ops), MAX_TXN_OPS):
            with contextlib.suppress(ConsulTxnConflict):
                client.txn(ops[chunk:chunk + MAX_TXN_OPS], deadline=deadline)
    finally:
        if session is not None and not _holds(client, keys.round, session, deadline):
            with contextlib.suppress(ConsulError):
                client.session_destroy(session, deadline=deadline)
    archived = archive_history(client, keys, run_id=run_id, retention=history_retention,
                               closed=closed, deadline=deadline)
    return CleanUp(removed=bool(ops), kept_marker=retained is not None, history=archived)


#: An archive part holds at most this many bytes of records (a Consul value holds 512 KiB, and
#: a transaction 512 KiB with its values in base64).
ARCHIVE_PART_BYTES = 256 * 1024


def history_session_name(run_id: str) -> str:
    """The name of the session that keeps an ended run's round history."""
    return f"consul-rdzv {run_id} history"[:128]


def archive_history(client: ConsulClient, keys: Keys, *, run_id: str, retention: float,
                    closed: dict | None = None, deadline: float) -> int:
    """The run ended: keep each job's round history for ``retention`` seconds, then Consul
    removes it by itself (0: remove it now). How many jobs were archived or removed.

    A job's records (``H/<job>/rounds/...``) are packed into a few archive parts, which, with its
    totals (marked with the end: when, and the closed record if the run was closed), are locked
    by one session of TTL ``retention`` (behaviour delete, no checks); then the records are
    deleted. A job archived already (every key locked) is left as it is.
    """
    entries = client.kv_list(keys.history, deadline=deadline).data
    jobs = {h.job: h for h in History.parse(keys, entries)}
    loose = {h for h in jobs if any(e.key.startswith(keys.job(h)) and not e.session
                                    for e in entries)}
    if not loose:
        return 0
    if not retention:
        for job in sorted(loose):
            client.txn([txn_kv("delete-tree", keys.job(job))], deadline=deadline)
        return len(loose)
    session = client.session_create(
        name=history_session_name(run_id), node_checks=[], behavior="delete", lock_delay="0s",
        ttl=f"{retention:.0f}s", deadline=deadline)
    now = time.time()
    # Nodes that leave at once may each find themselves the last and archive together: a lock
    # refused means another leaver holds that job's archive, which stays its own. A session that
    # locked nothing is destroyed (it would be left for a whole retention); one that locked a
    # part keeps it (destroying it would delete that part).
    held: list[str] = []
    unknown = False
    try:
        for job in sorted(loose):
            with contextlib.suppress(ConsulTxnConflict):
                _archive_job(client, keys, jobs, job, entries, session, closed, now, deadline,
                             held)
    except BaseException:
        unknown = True  # keep the session: Consul removes it after the retention
        raise
    finally:
        if not held and not unknown:
            with contextlib.suppress(ConsulError):
                client.session_destroy(session, deadline=deadline)
    return len(loose)


def _archive_job(client: ConsulClient, keys: Keys, jobs: dict, job: str, entries: list[KVEntry],
                 session: str, closed: dict | None, now: float, deadline: float,
                 held: list[str]) -> None:
    """Pack one job's records into archive parts and its totals, locked by ``session``; each
    key locked is appended to ``held``."""
    hist = jobs[job]
    parts: list[list[dict]] = [[]]
    size = 0
    for rec in hist.records:
        n = len(history_value(rec))
        if parts[-1] and size + n > ARCHIVE_PART_BYTES:
            parts.append([])
            size = 0
        parts[-1].append(rec)
        size += n
    for i, part in enumerate(parts):
        client.txn([txn_kv("lock", keys.history_archive(job, i),
                           value=history_value({"records": part}), session=session)],
                   deadline=deadline)
        held.append(keys.history_archive(job, i))
    totals = dict(hist.totals, ended_at=hist.totals.get("ended_at") or now)
    if closed is not None and job == max(jobs, key=lambda j: float(
            jobs[j].totals.get("since") or 0.0)):
        totals.setdefault("closed", closed)
    ops = [txn_kv("lock", keys.history_totals(job), value=history_value(totals),
                  session=session),
           txn_kv("delete-tree", f"{keys.job(job)}rounds/")]
    stale = [e.key for e in entries if e.key.startswith(f"{keys.job(job)}archive/")
             and e.key >= keys.history_archive(job, len(parts))]
    ops += [txn_kv("delete", key) for key in stale[:MAX_TXN_OPS - len(ops)]]
    client.txn(ops, deadline=deadline)
    held.append(keys.history_totals(job))


def _holds(client: ConsulClient, key: str, session: str, deadline: float) -> bool:
    with contextlib.suppress(ConsulError):
        entry = client.kv_get(key, deadline=deadline).data
        return entry is not None and entry.session == session
    return False


# ----------------------------------------------------------------------------- gc


class Verdict(enum.Enum):
    """What ``consul-rdzv gc`` does with a run, and why."""

    INVALID = "invalid"  # keys that are not consul-rdzv state: never touched
    LIVE = "live"  # a live node (a member key)
    CLOSED = "closed"  # closed, no live node: deleted
    STARTING = "starting"  # passing service instances: nodes registering
    RECENT = "recent"  # no live node, but activity within older_than
    ABANDONED = "abandoned"  # no live node, no passing instance, idle for older_than: deleted

    @property
    def delete(self) -> bool:
        return self in (Verdict.CLOSED, Verdict.ABANDONED)


def gc_verdict(*, invalid: bool, nodes: int, closed: bool, passing: int, idle: float | None,
               older_than: float) -> Verdict:
    """Whether ``gc`` deletes a run: one that ended (closed, no live node) or was abandoned (no
    live node, no passing service instance, no activity recorded for ``older_than`` seconds).
    ``idle``: seconds since the latest time recorded in its values (None: none recorded)."""
    if invalid:
        return Verdict.INVALID
    if nodes:
        return Verdict.LIVE
    if closed:
        return Verdict.CLOSED
    if passing:
        return Verdict.STARTING
    if idle is not None and idle < older_than:
        return Verdict.RECENT
    return Verdict.ABANDONED


def delete_run(client: ConsulClient, entries: list[KVEntry]) -> None:
    """Delete a run's keys, each only if unchanged since it was read (``delete-cas``; a
    :class:`ConsulTxnConflict` if one changed), and the session that keeps a finished run's
    closed marker (closed_retention), if any: an ended run leaves nothing."""
    ops = [txn_kv("delete-cas", e.key, index=e.modify_index) for e in entries]
    for start in range(0, len(ops), MAX_TXN_OPS):
        client.txn(ops[start:start + MAX_TXN_OPS])
    for session in {e.session for e in entries if e.session and e.key.endswith("/round/current")}:
        with contextlib.suppress(ConsulError):
            client.session_destroy(session)
