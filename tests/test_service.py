"""The service conventions (consul_rdzv/service.py): what a node writes into Consul (its service
instance, tags, meta, check and heartbeat output) is what ``consul-rdzv`` reads back.

Pure logic, no Consul: the node's side is a real :class:`Registration` (which sends nothing
until it is asked to register), the CLI's side its parser of a ``/v1/health/service`` entry.
"""

from __future__ import annotations

import calendar

import pytest

from consul_rdzv import service
from consul_rdzv.cli.read import Instance
from consul_rdzv.client import ConsulClient
from consul_rdzv.config import ConsulConfig
from consul_rdzv.registration import Incarnation, Registration
from consul_rdzv.rendezvous import ConsulRendezvous
from consul_rdzv.settings import RendezvousSettings

STARTED = 1_767_225_600.25  # exact in the meta's six decimals


@pytest.fixture
def client():
    c = ConsulClient(ConsulConfig.resolve(address="127.0.0.1:1", env={}))
    yield c
    c.close()


def registration(client, **settings) -> Registration:
    s = RendezvousSettings(run_id="job-7", min_nodes=1, max_nodes=8, **settings)
    return Registration(client, s, node_id="node-a", host="host-a", address="10.0.0.5",
                        incarnation=Incarnation(STARTED, "0123456789abcdef" * 2))


def health_entry(definition: dict, output: str, status: str = "passing") -> dict:
    """The ``/v1/health/service`` entry Consul makes of a registration whose check passed
    with ``output``."""
    check = definition["Check"]
    svc = {k: definition.get(k) for k in ("ID", "Address", "Tags", "Meta", "Port")}
    svc["Service"] = definition["Name"]
    return {"Node": {"Node": "consul-node-1"}, "Service": svc, "Checks": [
        {"CheckID": "serfHealth", "ServiceID": "", "Status": "passing", "Output": "Agent alive"},
        {"CheckID": check["CheckID"], "ServiceID": definition["ID"], "Type": "ttl",
         "Status": status, "Output": output}]}


# ----------------------------------------------------------------------------- names


def test_defaults_are_the_settings_defaults():
    s = RendezvousSettings(run_id="job-7")
    assert s.key_prefix == service.DEFAULT_KEY_PREFIX == "torchelastic"
    assert s.service == service.service_name("job-7") == "torchelastic-job-7"
    assert service.service_name("job-7").startswith(service.SERVICE_PREFIX)
    assert RendezvousSettings(run_id="job-7", service_name="svc").service == "svc"


@pytest.mark.parametrize("node_id", ["n", "node-0", "a.b_c-D9", "x" * 160, "..a", "a..b"])
def test_good_node_ids(node_id):
    assert service.valid_node_id(node_id)


@pytest.mark.parametrize("node_id", [".", "..", "x" * 161, "a/b", "a b", "é", "a:b"])
def test_bad_node_ids_are_refused_by_the_node_with_the_rule(client, node_id):
    assert not service.valid_node_id(node_id)
    with pytest.raises(ValueError, match="invalid") as exc:
        ConsulRendezvous(RendezvousSettings(run_id="job-7"), client, node_id=node_id)
    assert service.NODE_ID_RULE in str(exc.value)
    assert not service.valid_node_id("")  # (the node takes "" for "choose one")


def test_service_and_check_ids_round_trip():
    inc = Incarnation(STARTED, "cafe0123" + "0" * 24)
    sid = service.service_id("job-7", "node-a")
    assert sid == "job-7-node-a"
    assert service.check_id(sid, inc) == "job-7-node-a:ttl:cafe0123"
    assert service.node_id_of({"ID": sid, "Meta": {}}, "job-7") == "node-a"
    # the meta wins (a node id that is not what follows the run id in another run's scheme)
    assert service.node_id_of({"ID": sid, "Meta": {"node_id": "other"}}, "job-7") == "other"
    assert service.node_id_of({"ID": "unrelated"}, "job-7") == "unrelated"
    check = {"CheckID": service.check_id(sid, inc), "ServiceID": sid}
    assert service.is_heartbeat_check(check, sid)
    assert service.is_heartbeat_check({"CheckID": "x", "ServiceID": sid, "Type": "ttl"}, sid)
    assert not service.is_heartbeat_check(check, "job-7-node-b")
    assert not service.is_heartbeat_check({"CheckID": "serfHealth", "ServiceID": ""}, sid)


def test_tags_round_trip():
    tags = service.tags("job-7", "training", "3")
    assert tags == ["consul-rdzv", "run-job-7", "state-training", "rank-3"]
    assert service.tags("job-7", "joining") == ["consul-rdzv", "run-job-7", "state-joining"]
    assert service.run_of(tags) == "job-7"
    assert service.run_of(["web", "v2"]) is None and service.run_of(None) is None
    assert service.tagged(tags, "job-7")
    assert not service.tagged(tags, "job-8")
    assert not service.tagged(["run-job-7"], "job-7"), "not a consul-rdzv instance"


def test_incarnation_order_and_parse():
    old, new = Incarnation(100.0, "b"), Incarnation(200.0, "a")
    assert new > old and max(old, new) is new
    assert Incarnation.of({"started": "200.000000", "incarnation": "a"}) == new
    assert Incarnation.of(None) == Incarnation(0.0, "") < old
    assert Incarnation.of({"started": "soon", "incarnation": 7}) == Incarnation(0.0, "7")
    fresh = Incarnation.new()
    assert len(fresh.id) == 32 and fresh > new


# ----------------------------------------------------------------------------- the registration


def test_definition_of_a_joining_node(client):
    reg = registration(client, heartbeat_timeout=12.0, node_meta={"zone": "a"})
    d = reg.definition()
    assert (d["ID"], d["Name"], d["Address"]) == ("job-7-node-a", "torchelastic-job-7",
                                                  "10.0.0.5")
    assert d["ID"] == reg.service_id and d["Check"]["CheckID"] == reg.check_id
    assert d["Tags"] == ["consul-rdzv", "run-job-7", "state-joining"]
    assert "Port" not in d
    meta = d["Meta"]
    assert meta["state"] == "joining" and meta["zone"] == "a" and meta["ttl"] == "12s"
    assert Incarnation.of(meta) == reg.incarnation
    assert service.holder(meta) == f"pid {meta['pid']} on host host-a"
    check = d["Check"]
    assert check["Notes"] == "joining" and check["TTL"] == "12s"
    assert check["Status"] == "passing"
    assert check["DeregisterCriticalServiceAfter"] == service.DEREGISTER_CRITICAL_AFTER


def test_definition_of_a_training_node_uses_every_reserved_meta_key(client):
    reg = registration(client, node_meta={"zone": "a", "rack": "r1"})
    store = {"host": "10.0.0.9", "port": 29500}
    reg.publish(service.training_meta(5, 3, 8, store), note=service.training_note(5, 3, 8),
                port=29500)
    d = reg.definition()
    assert d["Tags"] == ["consul-rdzv", "run-job-7", "state-training", "rank-3"]
    assert d["Port"] == 29500
    assert d["Check"]["Notes"] == "round 5 · rank 3/8 · training"
    meta = d["Meta"]
    assert (meta["round"], meta["rank"], meta["world_size"], meta["store"]) == \
        ("5", "3", "8", "10.0.0.9:29500")
    # every key consul-rdzv writes is reserved (node_meta cannot replace it), and only those
    # ("quarantined" only while the host is quarantined: docs/health.md)
    assert set(meta) == service.RESERVED_META - {"quarantined"} | {"zone", "rack"}
    for key in service.RESERVED_META:
        with pytest.raises(ValueError, match="reserved"):
            RendezvousSettings(run_id="job-7", node_meta={key: "x"})


def test_long_names_are_cut_to_consul_limits():
    s = RendezvousSettings(run_id="job-7")
    inc = Incarnation(STARTED, "f" * 32)
    meta = service.meta(s, node_id="n" * 160, host="h" * 600, incarnation=inc,
                        shown={"state": "joining"})
    assert len(meta["host"]) == service.MAX_META_VALUE
    assert len(service.session_name("r" * 128, "n" * 160)) == 128


# ----------------------------------------------------------------------------- the heartbeat


def test_heartbeat_note_round_trip():
    t = calendar.timegm((2026, 12, 3, 16, 40, 1, 0, 0, 0)) + 0.125
    note = service.heartbeat_note(service.training_note(5, 3, 8), now=t)
    assert note == "round 5 · rank 3/8 · training · heartbeat 2026-12-03T16:40:01.125Z"
    assert service.heartbeat_time(note) == pytest.approx(t, abs=1e-6)
    for now in (0.5, 1_767_225_600.0, 1_767_225_600.999, 1_800_000_000.4567):
        beat = service.heartbeat_time(service.heartbeat_note("joining", now=now))
        assert now - 0.001 < beat <= now + 1e-6  # kept to the millisecond
    assert service.heartbeat_time("joining") is None
    assert service.heartbeat_time("") is None
    assert service.heartbeat_time("heartbeat 2026-13-45T99:00:00Z") is None


def test_the_cli_reads_what_the_node_writes(client):
    reg = registration(client)
    reg.publish(service.training_meta(2, 1, 4, {"host": "h", "port": 1}),
                note=service.training_note(2, 1, 4))
    d = reg.definition()
    now = 1_767_225_700.5
    entry = health_entry(d, service.heartbeat_note(d["Check"]["Notes"], now=now))
    inst = Instance.from_health(entry, "job-7", {})
    assert inst is not None
    assert (inst.node_id, inst.service_id, inst.service) == ("node-a", reg.service_id,
                                                             "torchelastic-job-7")
    assert inst.incarnation == reg.incarnation.id
    assert inst.heartbeat_at == pytest.approx(now, abs=1e-6)
    assert (inst.status, inst.source, inst.meta["ttl"]) == ("passing", "catalog", "30s")
    # the agent's own copy of the check wins over the catalog's (its output is current)
    later = service.heartbeat_note(d["Check"]["Notes"], now=now + 7)
    local = {reg.check_id: {"Node": "consul-node-1", "Status": "critical", "Output": later}}
    inst = Instance.from_health(entry, "job-7", local)
    assert (inst.status, inst.source) == ("critical", "agent")
    assert inst.heartbeat_at == pytest.approx(now + 7, abs=1e-6)
    # another run sharing the service name is not this run's
    assert Instance.from_health(entry, "job-8", {}) is None
