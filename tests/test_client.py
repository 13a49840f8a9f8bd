"""ConsulClient against real Consul agents: every call, the session semantics the rendezvous
relies on, blocking queries, each error class, and token secrecy.

Waits on Consul's asynchronous behaviour (check state, session invalidation) poll a condition
until a deadline; a fixed sleep appears only as failure injection (a write or a restart that is
meant to happen while another call is in flight).
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import threading
import time
import uuid

import pytest
from rdzv_nodes import wait_for

from consul_rdzv.client import (
    MAX_TXN_BYTES,
    MAX_TXN_OPS,
    MAX_VALUE_BYTES,
    BlockingIndex,
    ConsulClient,
    KVEntry,
    Step,
    txn_kv,
)
from consul_rdzv.config import ConsulConfig
from consul_rdzv.errors import (
    ConsulBadRequest,
    ConsulConfigError,
    ConsulError,
    ConsulNotFound,
    ConsulPermissionDenied,
    ConsulSessionInvalid,
    ConsulTxnConflict,
    ConsulUnavailableError,
)

# ----------------------------------------------------------------------------- helpers


class Services:
    """Registers services with a TTL check on the shared agent; deregisters them afterwards."""

    def __init__(self, client: ConsulClient, prefix: str) -> None:
        self.client = client
        self.prefix = prefix
        self.ids: list[str] = []

    def register(self, suffix: str = "svc", *, ttl: str = "30s", meta: dict | None = None,
                 status: str = "passing") -> tuple[str, str, dict]:
        service_id = f"{self.prefix}-{suffix}"
        check_id = f"{service_id}-hb"
        definition = {
            "ID": service_id,
            "Name": service_id,
            "Address": "127.0.0.1",
            "Tags": ["consul-rdzv-test"],
            "Meta": meta or {"round": "0"},
            "Check": {
                "CheckID": check_id,
                "Name": f"heartbeat of {service_id}",
                "TTL": ttl,
                "Status": status,
                "DeregisterCriticalServiceAfter": "1m",
            },
        }
        self.client.agent_service_register(definition)
        if service_id not in self.ids:
            self.ids.append(service_id)
        return service_id, check_id, definition

    def cleanup(self) -> None:
        for service_id in self.ids:
            with contextlib.suppress(ConsulNotFound):
                self.client.agent_service_deregister(service_id, deadline=time.monotonic() + 5)


@pytest.fixture
def services(consul, prefix):
    svc = Services(consul, prefix)
    yield svc
    svc.cleanup()


@pytest.fixture
def sessions(consul):
    """Create sessions that are destroyed (if still there) at teardown."""
    created: list[str] = []

    def make(**kwargs) -> str:
        kwargs.setdefault("name", f"test-{uuid.uuid4().hex[:8]}")
        sid = consul.session_create(**kwargs)
        created.append(sid)
        return sid

    yield make
    for sid in created:
        consul.session_destroy(sid, deadline=time.monotonic() + 5)


def passing_ids(client: ConsulClient, name: str) -> list[str]:
    return [e["Service"]["ID"] for e in client.health_service(name, passing=True).data]


def catalog_check_status(client: ConsulClient, name: str, check_id: str) -> str | None:
    for entry in client.health_service(name, passing=False).data:
        for check in entry["Checks"]:
            if check["CheckID"] == check_id:
                return check["Status"]
    return None


class Thread(threading.Thread):
    """A thread that re-raises its exception on join_checked()."""

    def __init__(self, target) -> None:
        super().__init__(target=self._run, daemon=True)
        self._fn = target
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            self._fn()
        except BaseException as exc:  # pragma: no cover - reported by join_checked
            self.error = exc

    def join_checked(self, timeout: float = 60.0) -> None:
        self.join(timeout)
        assert not self.is_alive(), "helper thread did not finish"
        if self.error is not None:
            raise self.error


# ----------------------------------------------------------------------------- status / catalog


def test_status_leader_returns_raft_address_if_agent_is_up(consul):
    leader = consul.status_leader()
    host, _, port = leader.rpartition(":")
    assert host == "127.0.0.1"
    assert int(port) > 0


def test_catalog_nodes_lists_agent_node_if_agent_is_up(consul, agent):
    nodes = consul.catalog_nodes()
    mine = [n for n in nodes if n["Node"] == agent.node_name]
    assert len(mine) == 1
    assert mine[0]["Address"] == "127.0.0.1"


# ----------------------------------------------------------------------------- agent services


def test_agent_service_register_shows_passing_instance_if_check_starts_passing(consul, services):
    service_id, check_id, _ = services.register(meta={"round": "7"})
    registered = consul.agent_services()[service_id]
    assert registered["Service"] == service_id
    assert registered["Meta"] == {"round": "7"}
    check = consul.agent_checks()[check_id]
    assert (check["Status"], check["Type"], check["ServiceID"]) == ("passing", "ttl", service_id)
    assert wait_for(lambda: passing_ids(consul, service_id) == [service_id], 10,
                    "instance listed as passing", 0.05)


def test_agent_service_deregister_removes_service_and_check_if_registered(consul, services):
    service_id, check_id, _ = services.register()
    consul.agent_service_deregister(service_id)
    assert service_id not in consul.agent_services()
    assert check_id not in consul.agent_checks()
    assert consul.health_service(service_id, passing=False).data == []


def test_agent_service_deregister_raises_not_found_if_service_is_unknown(consul, prefix):
    with pytest.raises(ConsulNotFound, match="Unknown service ID"):
        consul.agent_service_deregister(f"{prefix}-nope")


@pytest.mark.parametrize(("status", "consul_status"), [("warn", "warning"), ("fail", "critical")])
def test_agent_check_update_drops_instance_from_passing_if_warn_or_fail(
        consul, services, status, consul_status):
    service_id, check_id, _ = services.register()
    wait_for(lambda: passing_ids(consul, service_id) == [service_id], 10, "instance passing", 0.05)
    consul.agent_check_update(check_id, status, note=f"set to {status} by the test")
    check = consul.agent_checks()[check_id]
    assert check["Status"] == consul_status
    assert check["Output"] == f"set to {status} by the test"
    wait_for(lambda: passing_ids(consul, service_id) == [], 10, "instance dropped from passing",
             0.05)
    # still registered, only not passing
    assert catalog_check_status(consul, service_id, check_id) == consul_status
    consul.agent_check_update(check_id, "pass")
    assert consul.agent_checks()[check_id]["Status"] == "passing"
    wait_for(lambda: passing_ids(consul, service_id) == [service_id], 10, "instance back", 0.05)


def test_agent_check_update_raises_value_error_if_status_is_unknown(consul, services):
    _, check_id, _ = services.register()
    before = consul.requests_sent
    with pytest.raises(ValueError, match="pass, warn or fail"):
        consul.agent_check_update(check_id, "critical")
    assert consul.requests_sent == before
    assert consul.agent_checks()[check_id]["Status"] == "passing"


def test_agent_check_update_raises_not_found_if_check_is_unknown(consul, prefix):
    with pytest.raises(ConsulNotFound, match="Unknown check ID") as info:
        consul.agent_check_update(f"{prefix}-nope", "pass")
    assert info.value.status == 404


# ----------------------------------------------------------------------------- sessions


def test_session_create_binds_service_check_if_service_checks_given(consul, services, sessions):
    _, check_id, _ = services.register()
    sid = sessions(service_checks=[check_id], behavior="delete", lock_delay="0s")
    info = consul.session_info(sid)
    assert info["ID"] == sid
    assert info["Behavior"] == "delete"
    assert info["LockDelay"] == 0
    assert [c["ID"] for c in info["ServiceChecks"]] == [check_id]


def test_session_renew_returns_session_if_it_exists(consul, sessions):
    sid = sessions(ttl="30s")
    renewed = consul.session_renew(sid)
    assert renewed["ID"] == sid
    assert renewed["TTL"] == "30s"


def test_session_renew_raises_session_invalid_if_session_was_destroyed(consul):
    sid = consul.session_create(name="short-lived")
    assert consul.session_info(sid)["ID"] == sid
    consul.session_destroy(sid)
    assert consul.session_info(sid) is None
    with pytest.raises(ConsulSessionInvalid, match=sid):
        consul.session_renew(sid)


@pytest.mark.parametrize("check_id", ["invalid-session", "session-not-found:ttl:1"])
def test_not_found_naming_session_in_its_ids_is_not_an_invalid_session(consul, prefix, check_id):
    """Errors are classified by what Consul says, not by ids the request carries: a check whose
    id contains 'session' and 'invalid' (or 'not found') is a missing check, not a lost
    session (a node would otherwise rejoin instead of re-registering its check)."""
    with pytest.raises(ConsulNotFound) as info:
        consul.agent_check_update(f"{prefix}-{check_id}", "pass")
    assert not isinstance(info.value, ConsulSessionInvalid)
    assert check_id in str(info.value)


def test_session_create_raises_bad_request_without_retrying_if_behavior_is_bogus(consul):
    started = time.monotonic()
    with pytest.raises(ConsulBadRequest, match="Invalid Behavior setting 'bogus'"):
        consul.session_create(name="bogus", behavior="bogus", deadline=time.monotonic() + 10)
    assert time.monotonic() - started < 2.0  # a permanent error is not retried to the deadline


def test_session_create_raises_bad_request_if_ttl_is_out_of_range(consul):
    with pytest.raises(ConsulBadRequest, match="Invalid Session TTL") as info:
        consul.session_create(name="bad-ttl", ttl="1s", deadline=time.monotonic() + 10)
    assert not isinstance(info.value, ConsulSessionInvalid)


def test_session_create_raises_bad_request_if_lock_delay_is_malformed(consul):
    with pytest.raises(ConsulBadRequest, match="invalid duration") as info:
        consul.session_create(name="bad-delay", lock_delay="soon")
    assert info.value.status == 400


def test_session_create_raises_unavailable_at_deadline_if_check_is_not_registered(consul, prefix):
    # "Missing check registration" is retried: the agent may not have synced the check yet.
    with pytest.raises(ConsulUnavailableError, match="Missing check"):
        consul.session_create(name="x", service_checks=[f"{prefix}-nope"],
                              deadline=time.monotonic() + 0.3)


# ----------------------------------------------------------------------------- session semantics


def _bound_lock(consul, services, sessions, prefix, **register_kwargs):
    service_id, check_id, definition = services.register(**register_kwargs)
    sid = sessions(service_checks=[check_id], behavior="delete", lock_delay="0s")
    key = f"{prefix}/member"
    assert consul.kv_put(key, b"me", acquire=sid) is True
    assert consul.kv_get(key).data.session == sid
    return service_id, check_id, definition, sid, key


def test_session_key_is_deleted_if_bound_check_goes_critical(consul, services, sessions, prefix):
    _, check_id, _, sid, key = _bound_lock(consul, services, sessions, prefix)
    consul.agent_check_update(check_id, "fail")
    wait_for(lambda: consul.kv_get(key).data is None, 10, "key deleted by session invalidation",
             0.05)
    assert consul.session_info(sid) is None


def test_session_key_is_deleted_if_bound_check_ttl_expires(consul, services, sessions, prefix):
    _, check_id, _, sid, key = _bound_lock(consul, services, sessions, prefix, ttl="1s")
    started = time.monotonic()
    wait_for(lambda: consul.kv_get(key).data is None, 15, "key deleted after the TTL expired", 0.05)
    assert time.monotonic() - started >= 0.5  # the check was passing until its TTL ran out
    assert consul.agent_checks()[check_id]["Status"] == "critical"
    assert consul.session_info(sid) is None


def test_session_survives_if_bound_check_only_warns(consul, services, sessions, prefix):
    service_id, check_id, _, sid, key = _bound_lock(consul, services, sessions, prefix)
    consul.agent_check_update(check_id, "warn")
    wait_for(lambda: catalog_check_status(consul, service_id, check_id) == "warning", 10,
             "warning synced to the catalog", 0.05)
    assert consul.session_info(sid)["ID"] == sid
    assert consul.kv_get(key).data.session == sid


def test_session_survives_if_service_is_reregistered_with_same_check(
        consul, services, sessions, prefix):
    service_id, check_id, definition, sid, key = _bound_lock(consul, services, sessions, prefix)
    for round_no in range(1, 4):
        definition = {**definition, "Meta": {"round": str(round_no)}}
        consul.agent_service_register(definition)

    def synced():
        instances = consul.catalog_service(service_id)
        return instances and instances[0]["ServiceMeta"] == {"round": "3"}

    wait_for(synced, 10, "re-registration synced to the catalog", 0.05)
    assert consul.agent_services()[service_id]["Meta"] == {"round": "3"}
    assert consul.agent_checks()[check_id]["Status"] == "passing"
    assert catalog_check_status(consul, service_id, check_id) == "passing"
    assert consul.session_info(sid)["ID"] == sid
    entry = consul.kv_get(key).data
    assert (entry.value, entry.session) == (b"me", sid)
    # and the session is still bound to the check: failing it still deletes the key
    consul.agent_check_update(check_id, "fail")
    wait_for(lambda: consul.kv_get(key).data is None, 10, "key deleted after re-registration", 0.05)


# ----------------------------------------------------------------------------- KV


def test_kv_get_returns_entry_if_key_exists(consul, prefix):
    key = f"{prefix}/a"
    assert consul.kv_put(key, b"\x00value\xff", flags=42) is True
    result = consul.kv_get(key)
    entry = result.data
    assert isinstance(entry, KVEntry)
    assert (entry.key, entry.value, entry.flags, entry.session) == (key, b"\x00value\xff", 42, None)
    assert entry.create_index == entry.modify_index >= 1
    assert result.index >= entry.modify_index


def test_kv_get_returns_entry_with_value_none_if_key_holds_no_bytes(consul, prefix):
    assert consul.kv_put(f"{prefix}/empty", b"") is True
    entry = consul.kv_get(f"{prefix}/empty").data
    assert entry is not None  # the key exists ...
    assert entry.value is None  # ... and Consul sends its empty value as null


def test_kv_get_returns_none_if_key_is_missing(consul, prefix):
    result = consul.kv_get(f"{prefix}/missing")
    assert result.data is None
    assert result.index >= 1


def test_kv_list_returns_every_key_under_prefix_if_recursing(consul, prefix):
    for key in ("a", "b/c", "b/d/e"):
        consul.kv_put(f"{prefix}/{key}", key.encode())
    consul.kv_put(f"{prefix}-sibling", b"not mine")
    result = consul.kv_list(f"{prefix}/")
    assert {e.key: e.value for e in result.data} == {
        f"{prefix}/a": b"a", f"{prefix}/b/c": b"b/c", f"{prefix}/b/d/e": b"b/d/e"}
    assert result.index >= max(e.modify_index for e in result.data)


def test_kv_list_returns_empty_list_if_prefix_has_no_keys(consul, prefix):
    result = consul.kv_list(f"{prefix}/")
    assert result.data == []
    assert result.index >= 1


def test_kv_keys_lists_key_names_if_prefix_has_keys(consul, prefix):
    for key in ("a", "b/c", "b/d"):
        consul.kv_put(f"{prefix}/{key}", b"x")
    assert consul.kv_keys(f"{prefix}/") == [f"{prefix}/a", f"{prefix}/b/c", f"{prefix}/b/d"]
    assert consul.kv_keys(f"{prefix}/", separator="/") == [f"{prefix}/a", f"{prefix}/b/"]
    assert consul.kv_keys(f"{prefix}/nothing/") == []


def test_kv_put_returns_cas_outcome_if_cas_given(consul, prefix):
    key = f"{prefix}/cas"
    assert consul.kv_put(key, b"one", cas=0) is True  # create-only
    assert consul.kv_put(key, b"two", cas=0) is False  # exists already
    first = consul.kv_get(key).data
    assert first.value == b"one"
    assert consul.kv_put(key, b"three", cas=first.modify_index) is True
    assert consul.kv_put(key, b"four", cas=first.modify_index) is False  # stale index
    assert consul.kv_get(key).data.value == b"three"


def test_kv_put_acquires_and_releases_lock_if_session_holds_it(consul, sessions, prefix):
    key = f"{prefix}/lock"
    a, b = sessions(), sessions()
    assert consul.kv_put(key, b"a", acquire=a) is True
    held = consul.kv_get(key).data
    assert (held.session, held.lock_index, held.value) == (a, 1, b"a")
    assert consul.kv_put(key, b"b", acquire=b) is False
    assert consul.kv_put(key, b"b", release=b) is False
    assert consul.kv_get(key).data.session == a
    assert consul.kv_put(key, b"released", release=a) is True
    released = consul.kv_get(key).data
    assert (released.session, released.value) == (None, b"released")
    assert consul.kv_put(key, b"b", acquire=b) is True
    assert consul.kv_get(key).data.lock_index == 2


def test_kv_put_raises_session_invalid_if_acquire_session_does_not_exist(consul, prefix):
    with pytest.raises(ConsulSessionInvalid, match="invalid session"):
        consul.kv_put(f"{prefix}/lock", b"x", acquire=str(uuid.uuid4()))
    assert consul.kv_get(f"{prefix}/lock").data is None


@pytest.mark.parametrize("combo", [{"cas": 0, "acquire": "s"}, {"cas": 5, "release": "s"},
                                   {"acquire": "s", "release": "s"}])
def test_kv_put_raises_value_error_if_two_of_cas_acquire_release(consul, prefix, combo):
    before = consul.requests_sent
    with pytest.raises(ValueError, match="cannot be combined"):
        consul.kv_put(f"{prefix}/k", b"x", **combo)
    assert consul.requests_sent == before
    assert consul.kv_get(f"{prefix}/k").data is None


def test_kv_put_raises_value_error_if_value_exceeds_limit(consul, prefix):
    before = consul.requests_sent
    with pytest.raises(ValueError, match="bytes"):
        consul.kv_put(f"{prefix}/big", b"x" * (MAX_VALUE_BYTES + 1))
    assert consul.requests_sent == before


def test_kv_delete_respects_cas_if_index_given(consul, prefix):
    key = f"{prefix}/del"
    consul.kv_put(key, b"v1")
    stale = consul.kv_get(key).data.modify_index
    consul.kv_put(key, b"v2")
    current = consul.kv_get(key).data.modify_index
    assert consul.kv_delete(key, cas=stale) is False
    assert consul.kv_get(key).data.value == b"v2"
    assert consul.kv_delete(key, cas=current) is True
    assert consul.kv_get(key).data is None


def test_kv_delete_removes_subtree_if_recurse(consul, prefix):
    for key in ("a", "b/c"):
        consul.kv_put(f"{prefix}/{key}", b"x")
    consul.kv_put(f"{prefix}-keep", b"x")
    assert consul.kv_delete(f"{prefix}/", recurse=True) is True
    assert consul.kv_list(f"{prefix}/").data == []
    assert consul.kv_get(f"{prefix}-keep").data.value == b"x"


# ----------------------------------------------------------------------------- txn


def test_txn_applies_all_ops_and_returns_new_modify_index_if_none_fails(consul, prefix):
    consul.kv_put(f"{prefix}/old", b"old")
    before = consul.kv_get(f"{prefix}/old").data.modify_index
    ops = [
        txn_kv("set", f"{prefix}/a", value=b"1"),
        txn_kv("cas", f"{prefix}/b", value=b"2", index=0),
        txn_kv("cas", f"{prefix}/old", value=b"new", index=before),
        txn_kv("get", f"{prefix}/a"),
    ]
    result = consul.txn(ops)
    assert len(result.data) == 4
    indexes = {entry.modify_index for entry in result.data}
    assert len(indexes) == 1  # one Raft entry for the whole transaction
    new_index = indexes.pop()
    assert new_index > before
    assert [e.key for e in result.data] == [f"{prefix}/a", f"{prefix}/b", f"{prefix}/old",
                                           f"{prefix}/a"]
    assert result.data[3].value == b"1"
    assert consul.kv_get(f"{prefix}/old").data.modify_index == new_index
    assert consul.kv_get(f"{prefix}/b").data.value == b"2"


def test_txn_results_skip_deletes_and_expand_trees_if_ops_mix_verbs(consul, sessions, prefix):
    sid = sessions()
    consul.kv_put(f"{prefix}/gone", b"x")
    consul.kv_put(f"{prefix}/t/1", b"1")
    consul.kv_put(f"{prefix}/t/2", b"2")
    assert consul.kv_put(f"{prefix}/held", b"h", acquire=sid) is True
    result = consul.txn([
        txn_kv("delete", f"{prefix}/gone"),  # no result
        txn_kv("check-not-exists", f"{prefix}/gone"),  # no result
        txn_kv("check-session", f"{prefix}/held", session=sid),  # one (value blanked)
        txn_kv("get-tree", f"{prefix}/t/"),  # one per entry
        txn_kv("set", f"{prefix}/s", value=b"y"),  # one
    ])
    assert [(e.key, e.value) for e in result.data] == [
        (f"{prefix}/held", None), (f"{prefix}/t/1", b"1"), (f"{prefix}/t/2", b"2"),
        (f"{prefix}/s", None)]
    assert result.data[0].session == sid
    assert consul.kv_get(f"{prefix}/gone").data is None


def test_txn_raises_conflict_naming_failed_op_if_cas_is_stale(consul, prefix):
    consul.kv_put(f"{prefix}/k", b"v")
    stale = consul.kv_get(f"{prefix}/k").data.modify_index
    consul.kv_put(f"{prefix}/k", b"v2")
    ops = [
        txn_kv("set", f"{prefix}/new", value=b"1"),
        txn_kv("cas", f"{prefix}/k", value=b"v3", index=stale),
    ]
    with pytest.raises(ConsulTxnConflict) as info:
        consul.txn(ops)
    exc = info.value
    assert exc.status == 409
    assert len(exc.errors) == 1
    assert exc.errors[0].op_index == 1
    assert exc.errors[0].op == ops[1]
    assert "index is stale" in exc.errors[0].what
    assert "op 1" in str(exc)
    # rolled back: the first op left no trace
    assert consul.kv_get(f"{prefix}/new").data is None
    assert consul.kv_get(f"{prefix}/k").data.value == b"v2"


def test_txn_raises_conflict_naming_op_if_verb_is_unknown(consul, prefix):
    ops = [txn_kv("bogus", f"{prefix}/k", value=b"1")]
    with pytest.raises(ConsulTxnConflict, match="unknown KV verb") as info:
        consul.txn(ops)
    assert [(e.op_index, e.op) for e in info.value.errors] == [(0, ops[0])]


def test_txn_raises_bad_request_if_body_is_malformed(consul, prefix):
    with pytest.raises(ConsulBadRequest, match="Failed to parse body") as info:
        consul.txn([{"Bogus": {"Verb": "set", "Key": f"{prefix}/k"}}])
    assert info.value.status == 400


def test_txn_accepts_64_ops_if_at_limit(consul, prefix):
    ops = [txn_kv("set", f"{prefix}/{i:02d}", value=b"x") for i in range(MAX_TXN_OPS)]
    assert len(consul.txn(ops).data) == MAX_TXN_OPS
    assert len(consul.kv_keys(f"{prefix}/")) == MAX_TXN_OPS


@pytest.mark.parametrize("shape", ["too-many-ops", "too-many-bytes", "empty"])
def test_txn_raises_value_error_before_any_request_if_over_limits(consul, prefix, shape):
    if shape == "too-many-ops":
        ops = [txn_kv("set", f"{prefix}/{i}", value=b"x") for i in range(MAX_TXN_OPS + 1)]
    elif shape == "too-many-bytes":
        big = b"x" * (MAX_TXN_BYTES // 3)  # each op fits, the base64 payload does not
        ops = [txn_kv("set", f"{prefix}/{i}", value=big) for i in range(3)]
        assert len(json.dumps(ops)) > MAX_TXN_BYTES
    else:
        ops = []
    before = consul.requests_sent
    with pytest.raises(ValueError, match=r"at most|at least"):
        consul.txn(ops)
    assert consul.requests_sent == before
    assert consul.kv_keys(f"{prefix}/") == []


def test_txn_kv_encodes_value_and_options_if_given():
    op = txn_kv("lock", "k", value=b"\x01\x02", index=7, session="sid")
    assert op == {"KV": {"Verb": "lock", "Key": "k", "Index": 7, "Session": "sid",
                         "Value": base64.b64encode(b"\x01\x02").decode()}}
    assert txn_kv("get", "k") == {"KV": {"Verb": "get", "Key": "k"}}


# ----------------------------------------------------------------------------- blocking queries


def _blocked_read_woken_by_write(read, write):
    """Run ``read()`` while another thread runs ``write()`` ~0.3 s later.

    Returns (result, seconds the read took, seconds between the write and the read returning).
    """
    times = {}

    def writer():
        time.sleep(0.3)  # failure injection: the write lands while the read is blocked
        times["write"] = time.monotonic()
        write()

    thread = Thread(writer)
    started = time.monotonic()
    thread.start()
    result = read()
    returned = time.monotonic()
    thread.join_checked()
    return result, returned - started, returned - times["write"]


def test_kv_get_blocking_wakes_soon_if_another_thread_writes_the_key(consul, agent, prefix):
    key = f"{prefix}/watched"
    consul.kv_put(key, b"old")
    first = consul.kv_get(key)
    writer = agent.client()
    try:
        result, took, after_write = _blocked_read_woken_by_write(
            lambda: consul.kv_get(key, index=first.index, wait=5),
            lambda: writer.kv_put(key, b"new"))
    finally:
        writer.close()
    assert result.data.value == b"new"
    assert result.index > first.index
    assert after_write >= 0  # it was still blocked when the write happened
    assert took < 2.0  # woken by the write, long before wait=5 elapsed


def test_kv_list_blocking_wakes_soon_if_another_thread_writes_under_prefix(
        consul, agent, prefix):
    consul.kv_put(f"{prefix}/a", b"1")
    first = consul.kv_list(f"{prefix}/")
    writer = agent.client()
    try:
        result, took, after_write = _blocked_read_woken_by_write(
            lambda: consul.kv_list(f"{prefix}/", index=first.index, wait=5),
            lambda: writer.kv_put(f"{prefix}/b", b"2"))
    finally:
        writer.close()
    assert {e.key: e.value for e in result.data} == {f"{prefix}/a": b"1", f"{prefix}/b": b"2"}
    assert result.index > first.index
    assert after_write >= 0
    assert took < 2.0


def test_health_service_blocking_wakes_soon_if_check_goes_critical(consul, agent, services):
    service_id, check_id, _ = services.register()
    first = wait_for(lambda: (r := consul.health_service(service_id, passing=True)).data and r,
                     10, "instance passing", 0.05)
    writer = agent.client()
    try:
        result, took, after_write = _blocked_read_woken_by_write(
            lambda: consul.health_service(service_id, passing=True, index=first.index, wait=5),
            lambda: writer.agent_check_update(check_id, "fail"))
    finally:
        writer.close()
    assert result.data == []
    assert result.index > first.index
    assert after_write >= 0
    assert took < 2.0


def test_kv_get_blocking_returns_same_index_after_wait_if_nothing_changes(consul, prefix):
    key = f"{prefix}/quiet"
    consul.kv_put(key, b"v")
    first = consul.kv_get(key)
    started = time.monotonic()
    again = consul.kv_get(key, index=first.index, wait=0.5)
    took = time.monotonic() - started
    assert took >= 0.4
    assert took < 3.0
    assert again.index == first.index
    assert again.data == first.data


def test_kv_get_does_not_block_if_index_is_below_one(consul, prefix):
    consul.kv_put(f"{prefix}/k", b"v")
    started = time.monotonic()
    consul.kv_get(f"{prefix}/k", index=0, wait=5)
    consul.kv_get(f"{prefix}/k", index=None, wait=5)
    assert time.monotonic() - started < 2.0


def test_blocking_index_resets_to_zero_if_index_goes_backwards():
    idx = BlockingIndex()
    assert idx.param is None
    assert idx.update(10) is Step.MOVED
    assert idx.param == 10
    assert idx.update(10) is Step.SAME  # a return is not a change
    assert idx.update(12) is Step.MOVED
    assert idx.param == 12
    assert idx.update(3) is Step.RESET
    assert idx.index == 0 and idx.resets == 1
    assert idx.param is None  # the next query does not block
    assert idx.update(3) is Step.MOVED
    assert idx.param == 3


def test_blocking_index_sends_one_once_answered_with_zero():
    """Consul: 'it is always safe to use an index of 1': an answer of 0 must never make the
    next query a non-blocking one (a busy loop)."""
    idx = BlockingIndex()
    assert idx.update(0) is Step.SAME
    assert idx.param == 1
    assert idx.update(0) is Step.SAME
    assert idx.param == 1
    assert idx.update(5) is Step.MOVED
    assert idx.update(0) is Step.RESET
    assert idx.update(0) is Step.SAME
    assert idx.param == 1


def test_borrowed_index_compares_its_first_answer_by_raft_order_then_its_own():
    """A borrowed start (the seal's snapshot index): a lower first answer is 'nothing written
    under this query since', not 'backwards'; later answers compare with the query's own."""
    idx = BlockingIndex(100, borrowed=True)
    assert idx.param == 100
    assert idx.update(40) is Step.SAME  # the prefix's own, lower index: no change, no reset
    assert idx.param == 40 and idx.resets == 0
    assert idx.update(40) is Step.SAME
    assert idx.update(120) is Step.MOVED
    assert idx.update(110) is Step.RESET  # now it is this query's own answer that went back
    moved = BlockingIndex(100, borrowed=True)
    assert moved.update(101) is Step.MOVED


def test_blocking_index_rebase_and_reset():
    idx = BlockingIndex(100, borrowed=True)
    idx.rebase(50)  # a fresh read after a failure: no comparison, and the borrow is over
    assert idx.param == 50
    assert idx.update(49) is Step.RESET
    idx.rebase(0)
    assert idx.param == 1
    idx.reset()
    assert idx.param is None


@pytest.mark.parametrize("sequence", [[0], [5, 0], [1, 0, 0], [-4], [7, -1, 2], [3, 3, 1, 9, 2]])
def test_blocking_index_never_yields_param_below_one_if_fed_any_sequence(sequence):
    idx = BlockingIndex()
    for returned in sequence:
        idx.update(returned)
        assert idx.param is None or idx.param >= 1
        assert idx.index >= 0


def test_blocking_index_detects_reset_if_dev_agent_restarts(fresh_agent, prefix):
    client = fresh_agent.client()
    try:
        for i in range(30):  # push the Raft index well above where a new dev agent starts
            client.kv_put(f"{prefix}/{i}", b"x")
        idx = BlockingIndex()
        assert idx.update(client.kv_list(f"{prefix}/").index) is Step.MOVED
        before = idx.index
        fresh_agent.restart()
        # the old index is ahead of the new agent's: the query waits, then returns a lower one
        after = client.kv_list(f"{prefix}/", index=idx.param, wait=0.5)
        assert after.data == []  # the dev agent forgot everything
        assert after.index < before
        assert idx.update(after.index) is Step.RESET
        assert idx.param is None
        # recovery: reads from scratch see new writes and the index tracks forward again
        client.kv_put(f"{prefix}/again", b"y")
        fresh = client.kv_list(f"{prefix}/", index=idx.param, wait=5)
        assert [e.key for e in fresh.data] == [f"{prefix}/again"]
        assert idx.update(fresh.index) is Step.MOVED
        assert idx.param == fresh.index >= 1
    finally:
        client.close()


# ----------------------------------------------------------------------------- unavailable


def test_call_raises_unavailable_naming_address_if_agent_is_stopped(fresh_agent):
    client = fresh_agent.client()
    try:
        assert client.status_leader()
        fresh_agent.stop()
        started = time.monotonic()
        with pytest.raises(ConsulUnavailableError) as info:
            client.kv_get("anything", deadline=time.monotonic() + 0.5)
        took = time.monotonic() - started
    finally:
        client.close()
    assert 0.4 <= took < 5.0  # retried until the deadline, then gave up
    assert fresh_agent.address in str(info.value)
    assert info.value.retryable is True


def test_call_succeeds_if_agent_comes_back_before_deadline(fresh_agent, prefix):
    client = fresh_agent.client()
    fresh_agent.stop()

    def come_back():
        time.sleep(1.0)  # failure injection: the outage lasts about a second
        fresh_agent.restart()

    thread = Thread(come_back)
    started = time.monotonic()
    thread.start()
    try:
        sent_before = client.requests_sent
        assert client.kv_put(f"{prefix}/k", b"back", deadline=time.monotonic() + 30) is True
        took = time.monotonic() - started
        retries = client.requests_sent - sent_before
        thread.join_checked()
        assert client.kv_get(f"{prefix}/k").data.value == b"back"
    finally:
        client.close()
    assert took >= 0.9  # it did wait through the outage
    assert retries > 1


@pytest.mark.parametrize(("read_timeout", "lower", "upper"), [
    # every attempt times out after 0.5 s: the retries stop 1 s after the first failure, not
    # at the caller's far deadline
    (0.5, 1.4, 5.0),
    # the first attempt times out after 4 s; the retries may only use what is left of the 1 s
    # window, not a whole read timeout each (which ended the call after 8 s: a cut-off client
    # agent made next_round() fail 5 s later than docs/deployment.md says)
    (4.0, 4.9, 6.5),
])
def test_a_failing_call_ends_within_its_read_timeout_plus_retry_timeout(
        fresh_agent, read_timeout, lower, upper):
    # A frozen agent holds every request; the caller's deadline is far off.
    client = ConsulClient(fresh_agent.config(), timeout=read_timeout, retry_timeout=1.0)
    try:
        fresh_agent.freeze()
        try:
            started = time.monotonic()
            with pytest.raises(ConsulUnavailableError, match="timed out"):
                client.status_leader(deadline=started + 30)
            took = time.monotonic() - started
        finally:
            fresh_agent.thaw()
        assert lower <= took < upper, f"gave up after {took:.2f}s"
        assert client.request_counts["GET status"] >= 2
    finally:
        client.close()


def test_an_answer_slower_than_the_read_timeout_is_retried(fresh_agent):
    # The first attempt times out (the agent is frozen for 1.2 s, the read timeout is 0.5 s);
    # the call is retried within retry_timeout of that failure and succeeds once it answers.
    client = ConsulClient(fresh_agent.config(), timeout=0.5, retry_timeout=5.0)
    timer = threading.Timer(1.2, fresh_agent.thaw)
    try:
        fresh_agent.freeze()
        timer.start()
        assert client.status_leader(deadline=time.monotonic() + 10)
        assert client.request_counts["GET status"] >= 2
    finally:
        timer.join()
        fresh_agent.thaw()
        client.close()


def test_call_raises_unavailable_if_agent_is_frozen(fresh_agent):
    client = ConsulClient(fresh_agent.config(), timeout=0.3)
    try:
        fresh_agent.freeze()
        try:
            started = time.monotonic()
            with pytest.raises(ConsulUnavailableError) as info:
                client.status_leader(deadline=time.monotonic() + 0.5)
            took = time.monotonic() - started
        finally:
            fresh_agent.thaw()
        assert took < 5.0
        assert fresh_agent.address in str(info.value)
        assert "timed out" in str(info.value).lower()
        assert client.status_leader(deadline=time.monotonic() + 10)  # fine once thawed
    finally:
        client.close()


# ----------------------------------------------------------------------------- ACL


def test_call_raises_permission_denied_naming_rule_if_acl_token_is_missing(acl_agent, prefix):
    client = acl_agent.client(token=None)
    try:
        with pytest.raises(ConsulPermissionDenied) as info:
            client.kv_put(f"{prefix}/k", b"x")
    finally:
        client.close()
    message = str(info.value)
    assert info.value.status == 403
    assert f'key_prefix "{prefix}/" {{ policy = "write" }}' in message
    assert f"lacks permission 'key:write' on \"{prefix}/k\"" in message
    assert "No token was sent" in message and "docs/acl-policy.hcl" in message
    assert acl_agent.management_token not in message


def test_call_succeeds_if_acl_token_is_given(acl_agent, prefix):
    client = acl_agent.client()
    try:
        assert client.kv_put(f"{prefix}/k", b"x") is True
        assert client.kv_get(f"{prefix}/k").data.value == b"x"
    finally:
        client.close()


def test_call_succeeds_if_acl_token_carries_a_trailing_newline(acl_agent, prefix):
    client = acl_agent.client(token=acl_agent.management_token + "\n")  # e.g. read from a file
    try:
        assert client.config.token == acl_agent.management_token
        assert client.kv_put(f"{prefix}/nl", b"x", deadline=time.monotonic() + 5) is True
    finally:
        client.close()


# ----------------------------------------------------------------------------- TLS


def test_tls_client_succeeds_if_ca_is_given(tls_agent, prefix):
    client = tls_agent.client()
    try:
        assert client.config.url.startswith("https://")
        assert client.kv_put(f"{prefix}/k", b"tls") is True
        assert client.kv_get(f"{prefix}/k").data.value == b"tls"
    finally:
        client.close()


def test_tls_client_raises_config_error_naming_cacert_if_no_ca_is_given(tls_agent):
    client = tls_agent.client(ca_file=None)
    started = time.monotonic()
    try:
        with pytest.raises(ConsulConfigError, match="CONSUL_CACERT") as info:
            client.status_leader(deadline=time.monotonic() + 10)
    finally:
        client.close()
    assert "CERTIFICATE_VERIFY_FAILED" in str(info.value)
    assert time.monotonic() - started < 2.0  # not retried


def test_tls_client_raises_config_error_if_server_name_is_wrong(tls_agent):
    client = tls_agent.client(tls_server_name="wrong.example")
    try:
        with pytest.raises(ConsulConfigError, match="CONSUL_TLS_SERVER_NAME") as info:
            client.status_leader(deadline=time.monotonic() + 10)
    finally:
        client.close()
    assert "wrong.example" in str(info.value)


def test_tls_client_succeeds_if_server_name_matches_certificate(tls_agent):
    client = tls_agent.client(tls_server_name="server.dc1.consul")
    try:
        assert client.status_leader()
    finally:
        client.close()


def test_tls_client_succeeds_without_ca_if_verification_is_disabled(tls_agent, caplog):
    with caplog.at_level(logging.WARNING, logger="consul_rdzv.transport"):
        client = tls_agent.client(ca_file=None, verify=False)
    try:
        assert client.status_leader()
        warned = [r.getMessage() for r in caplog.records
                  if r.name == "consul_rdzv.transport" and r.levelno >= logging.WARNING]
        assert len(warned) == 1 and "verification is off" in warned[0], warned
    finally:
        client.close()


def test_plain_http_raises_config_error_naming_https_if_port_speaks_tls(tls_agent):
    client = tls_agent.client(address=f"http://{tls_agent.address}")
    started = time.monotonic()
    try:
        with pytest.raises(ConsulConfigError, match="HTTPS") as info:
            client.status_leader(deadline=time.monotonic() + 10)
    finally:
        client.close()
    assert "https://" in str(info.value)
    assert time.monotonic() - started < 2.0


def test_mtls_client_raises_config_error_if_client_cert_is_missing(mtls_agent):
    client = mtls_agent.client(client_cert=None, client_key=None)
    started = time.monotonic()
    try:
        with pytest.raises(ConsulConfigError, match="CONSUL_CLIENT_CERT"):
            client.status_leader(deadline=time.monotonic() + 10)
    finally:
        client.close()
    assert time.monotonic() - started < 2.0


def test_mtls_client_succeeds_if_client_cert_is_given(mtls_agent, prefix):
    client = mtls_agent.client()
    try:
        assert client.config.client_cert is not None
        assert client.kv_put(f"{prefix}/k", b"mtls") is True
        assert client.kv_get(f"{prefix}/k").data.value == b"mtls"
    finally:
        client.close()


# ----------------------------------------------------------------------------- token secrecy


SECRET = "d3adbeef-5ec2-4e7a-9c1d-0123456789ab"


def _assert_secret_absent(secret: str, caplog, *texts: str) -> None:
    assert caplog.records, "the failing call should have logged something at DEBUG"
    for record in caplog.records:
        assert secret not in record.getMessage()
        assert secret not in repr(record.args)
    assert secret not in caplog.text
    for text in texts:
        assert secret not in text


def test_token_is_absent_from_reprs_if_token_is_set():
    config = ConsulConfig.resolve("127.0.0.1:8500", token=SECRET, env={})
    client = ConsulClient(config)
    try:
        assert client.config.token == SECRET
        for text in (repr(config), str(config), repr(client), str(client)):
            assert SECRET not in text
    finally:
        client.close()


def test_token_is_absent_from_logs_and_errors_if_calls_are_denied(acl_agent, prefix, caplog):
    caplog.set_level(logging.DEBUG)
    client = acl_agent.client(token=SECRET)  # a token Consul does not know
    try:
        errors = []
        for call in (lambda: client.kv_put(f"{prefix}/k", b"x"),
                     lambda: client.session_create(name="x"),
                     lambda: client.kv_get(f"{prefix}/k")):
            with pytest.raises(ConsulPermissionDenied) as info:
                call()
            errors.append(info.value)
    finally:
        client.close()
    assert all("ACL not found" in str(e) for e in errors)
    assert all("token is unknown to this Consul" in str(e) for e in errors)
    _assert_secret_absent(SECRET, caplog, *(str(e) for e in errors), *(repr(e) for e in errors))


def test_management_token_is_absent_from_logs_and_errors_if_calls_fail(acl_agent, prefix, caplog):
    caplog.set_level(logging.DEBUG)
    token = acl_agent.management_token
    client = acl_agent.client()
    try:
        errors: list[ConsulError] = []
        for call in (lambda: client.agent_check_update(f"{prefix}-nope", "pass"),
                     lambda: client.kv_put(f"{prefix}/k", b"x", acquire=str(uuid.uuid4())),
                     lambda: client.session_create(name="x", behavior="bogus"),
                     lambda: client.txn([txn_kv("cas", f"{prefix}/k", value=b"", index=99)])):
            with pytest.raises(ConsulError) as info:
                call()
            errors.append(info.value)
    finally:
        client.close()
    assert [type(e) for e in errors] == [ConsulNotFound, ConsulSessionInvalid, ConsulBadRequest,
                                         ConsulTxnConflict]
    _assert_secret_absent(token, caplog, *(str(e) for e in errors))


def test_token_is_absent_from_logs_and_errors_if_consul_is_unreachable(caplog):
    caplog.set_level(logging.DEBUG)
    client = ConsulClient(ConsulConfig.resolve("127.0.0.1:9", token=SECRET, env={}))
    try:
        with pytest.raises(ConsulUnavailableError) as info:
            client.kv_put("k", b"x", deadline=time.monotonic() + 0.3)
    finally:
        client.close()
    assert any("Retrying PUT /v1/kv/k" in r.getMessage() for r in caplog.records)
    _assert_secret_absent(SECRET, caplog, str(info.value), repr(info.value),
                          str(info.value.__cause__))


@pytest.mark.parametrize("bad", [f"{SECRET}\r\nX-Evil: 1", f"ab\n{SECRET}", f"{SECRET}\x7f"])
def test_token_is_refused_without_echo_if_it_cannot_be_a_header(bad):
    with pytest.raises(ConsulConfigError) as info:
        ConsulConfig(url="http://127.0.0.1:8500", token=bad)
    assert SECRET not in str(info.value)
