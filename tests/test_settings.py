"""RendezvousSettings validation and settings_from_conf (torchrun's --rdzv-conf strings).

Pure logic, no Consul. Every bad value must fail early with a ValueError that names the key.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import pytest

from consul_rdzv.config import parse_bool
from consul_rdzv.settings import (
    ADAPTER_KEYS,
    BOOLEAN_KEYS,
    C10D_KEEP_ALIVE_INTERVAL,
    C10D_KEEP_ALIVE_MAX_ATTEMPT,
    CONNECTION_KEYS,
    HEARTBEAT_TIMEOUT_DEFAULT,
    IGNORED_KEYS,
    VALID_KEYS,
    RendezvousSettings,
    settings_field_names,
    settings_from_conf,
)


def make(**kwargs) -> RendezvousSettings:
    kwargs.setdefault("run_id", "job-1")
    return RendezvousSettings(**kwargs)


# ----------------------------------------------------------------------------- defaults


def test_defaults_and_derived_values():
    s = make(min_nodes=2, max_nodes=4)
    assert (s.key_prefix, s.prefix, s.service) == ("torchelastic", "torchelastic/job-1",
                                                   "torchelastic-job-1")
    assert s.rank_policy == "stable" and s.topology_keys == () and s.node_rank is None
    assert s.heartbeat_interval == pytest.approx(s.heartbeat_timeout / 3)
    assert make(heartbeat_timeout=6, keep_alive_interval=1.5).heartbeat_interval == 1.5
    assert make(service_name="svc").service == "svc"
    assert make(key_prefix="a/b.c/d-e_f", run_id="r.1").prefix == "a/b.c/d-e_f/r.1"


def test_settings_are_frozen_and_with_revalidates():
    s = make(min_nodes=2, max_nodes=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.min_nodes = 1
    t = s.with_(max_nodes=5)
    assert (t.max_nodes, s.max_nodes) == (5, 3)
    with pytest.raises(ValueError, match="max_nodes"):
        s.with_(max_nodes=1)


def test_field_names():
    names = settings_field_names()
    assert names[0] == "run_id"
    assert {"min_nodes", "max_nodes", "join_timeout", "heartbeat_timeout"} <= set(names)


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("run_id", ["", "a/b", "a b", "x" * 129, "é", ".", "..", None, 7])
def test_bad_run_id(run_id):
    with pytest.raises(ValueError, match="run_id"):
        make(run_id=run_id)


@pytest.mark.parametrize("run_id", ["a", "A.b_c-1", "...", "x" * 128, ".hidden"])
def test_good_run_id(run_id):
    assert make(run_id=run_id).run_id == run_id


@pytest.mark.parametrize("prefix", ["", "/a", "a/", "a//b", "a b", "a/../b", "..", "./a", "a/."])
def test_bad_key_prefix(prefix):
    with pytest.raises(ValueError, match="key_prefix"):
        make(key_prefix=prefix)


@pytest.mark.parametrize(("changes", "key"), [
    ({"min_nodes": 0}, "min_nodes"),
    ({"min_nodes": 1.5}, "min_nodes"),
    ({"min_nodes": 3, "max_nodes": 2}, "max_nodes"),
    ({"max_nodes": "4"}, "max_nodes"),
    ({"join_timeout": 0}, "join_timeout"),
    ({"last_call_timeout": -1}, "last_call_timeout"),
    ({"close_timeout": math.inf}, "close_timeout"),
    ({"consul_timeout": math.nan}, "consul_timeout"),
    ({"join_timeout": "600"}, "join_timeout"),
    ({"heartbeat_timeout": 0.5}, "heartbeat_timeout"),
    ({"heartbeat_timeout": 5, "keep_alive_interval": 5}, "keep_alive_interval"),
    ({"heartbeat_timeout": 5, "keep_alive_interval": 2.6}, "at most half of heartbeat_timeout"),
    ({"read_timeout": 0}, "read_timeout"),
    ({"keep_alive_interval": 0}, "keep_alive_interval"),
    ({"rank_policy": "random"}, "rank_policy"),
    ({"rank_policy": "topology"}, "topology_keys"),
    ({"rank_policy": "topology", "topology_keys": ("zone", "bad key")}, "topology key"),
    ({"rank_policy": "explicit"}, "node_rank"),
    ({"rank_policy": "explicit", "max_nodes": 2, "node_rank": 2}, "node_rank"),
    ({"rank_policy": "explicit", "max_nodes": 2, "node_rank": -1}, "node_rank"),
    ({"node_meta": {"bad key": "x"}}, "node meta"),
    ({"node_meta": {"zone": "x" * 513}}, "node meta"),
    ({"node_meta": {"incarnation": "x"}}, "node meta key 'incarnation' is reserved"),
    ({"node_meta": {f"k{i}": "v" for i in range(60)}}, "node_meta has 60 items; at most 51"),
])
def test_bad_values_name_their_key(changes, key):
    with pytest.raises(ValueError, match=key):
        make(**changes)


def test_good_policies():
    assert make(rank_policy="natural").rank_policy == "natural"
    s = make(rank_policy="topology", topology_keys=("zone", "rack"))
    assert s.topology_keys == ("zone", "rack")
    s = make(rank_policy="explicit", max_nodes=4, node_rank=3, node_meta={"zone": "a"})
    assert (s.node_rank, s.node_meta) == (3, {"zone": "a"})


# ----------------------------------------------------------------------------- settings_from_conf


def test_conf_strings_are_parsed():
    conf = {"join_timeout": "120", "last_call_timeout": "2.5", "close_timeout": "7",
            "heartbeat_timeout": "3", "keep_alive_interval": "0.5", "consul_timeout": "4",
            "read_timeout": "45", "key_prefix": "jobs/team-a", "service_name": "trainers",
            "rank_policy": "topology",
            "topology_keys": "zone:rack", "node_meta": "zone=a;rack=r1 gpu=h100"}
    s = settings_from_conf("job", 2, 8, conf)
    assert (s.min_nodes, s.max_nodes) == (2, 8)
    assert (s.join_timeout, s.last_call_timeout, s.close_timeout) == (120.0, 2.5, 7.0)
    assert (s.heartbeat_timeout, s.keep_alive_interval, s.consul_timeout) == (3.0, 0.5, 4.0)
    assert s.read_timeout == 45.0
    assert make().read_timeout == 60.0  # c10d's default
    assert make(heartbeat_timeout=5, keep_alive_interval=2.5).heartbeat_interval == 2.5
    assert (s.key_prefix, s.service_name, s.rank_policy) == ("jobs/team-a", "trainers",
                                                             "topology")
    assert s.topology_keys == ("zone", "rack")
    assert dict(s.node_meta) == {"zone": "a", "rack": "r1", "gpu": "h100"}


def test_conf_typed_values_are_accepted():
    s = settings_from_conf("job", 1, 2, {"topology_keys": ["zone", "rack"],
                                         "rank_policy": "topology", "node_meta": {"zone": "b"},
                                         "join_timeout": 5, "node_rank": 1})
    assert s.topology_keys == ("zone", "rack") and dict(s.node_meta) == {"zone": "b"}
    assert s.join_timeout == 5.0 and s.node_rank == 1


def test_conf_join_timeout_wins_over_timeout():
    assert settings_from_conf("j", 1, 1, {"timeout": "900"}).join_timeout == 900.0
    assert settings_from_conf("j", 1, 1, {"timeout": "900", "join_timeout": "30"}) \
        .join_timeout == 30.0
    assert settings_from_conf("j", 1, 1, {}).join_timeout == make().join_timeout


def test_conf_empty_values_mean_default():
    s = settings_from_conf("j", 1, 1, {"join_timeout": "", "key_prefix": "", "node_meta": "",
                                       "topology_keys": "", "node_rank": ""})
    assert s == make(run_id="j")


def test_conf_connection_adapter_and_ignored_keys_are_accepted_without_effect():
    conf = ({k: "x" for k in CONNECTION_KEYS} | {k: "x" for k in ADAPTER_KEYS}
            | {k: "true" for k in BOOLEAN_KEYS} | {"store_type": "tcp"})
    assert set(conf) >= set(IGNORED_KEYS)
    assert settings_from_conf("j", 1, 1, conf) == make(run_id="j")
    assert "node_id" in VALID_KEYS and list(VALID_KEYS) == sorted(VALID_KEYS)


def test_conf_unknown_key_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"Unknown rdzv conf key\(s\) bogus, other") as info:
        settings_from_conf("j", 1, 1, {"other": "1", "bogus": "2"})
    assert "join_timeout" in str(info.value) and "heartbeat_timeout" in str(info.value)


@pytest.mark.parametrize(("conf", "key"), [
    ({"join_timeout": "ten"}, "join_timeout"),
    ({"timeout": "soon"}, "timeout"),
    ({"heartbeat_timeout": "0.2"}, "heartbeat_timeout"),
    ({"node_rank": "first"}, "node_rank"),
    ({"node_meta": "zone"}, "node_meta"),
    ({"rank_policy": "explicit"}, "node_rank"),
    ({"key_prefix": "/abs"}, "key_prefix"),
])
def test_conf_bad_values_name_their_key(conf, key):
    with pytest.raises(ValueError, match=key):
        settings_from_conf("j", 1, 2, conf)


# ----------------------------------------------------------------------------- booleans


@pytest.mark.parametrize("key", BOOLEAN_KEYS)
@pytest.mark.parametrize("value", ["treu", "2", "yess", "on off", "-1"])
def test_conf_booleans_are_parsed_strictly(key, value):
    with pytest.raises(ValueError, match=f"rdzv conf {key}={value!r} is not a boolean"):
        settings_from_conf("j", 1, 1, {key: value})


@pytest.mark.parametrize("key", BOOLEAN_KEYS)
@pytest.mark.parametrize("value", ["true", "False", "1", "0", "yes", "NO", "on", "off", True, 0])
def test_conf_booleans_accept_the_usual_spellings(key, value):
    expected = make(run_id="j")
    if key == "health_evict":  # a setting of its own; the others are the adapter's
        expected = expected.with_(health_evict=parse_bool(key, value))
    assert settings_from_conf("j", 1, 1, {key: value}) == expected


# ----------------------------------------------------------------------------- c10d's keys


def test_c10d_keep_alive_keys_map_onto_heartbeat_timeout(caplog):
    """c10d: a node is dead after keep_alive_interval x keep_alive_max_attempt silent seconds,
    which is what heartbeat_timeout says here: mapped, with one INFO line saying how."""
    caplog.set_level(logging.INFO, logger="consul_rdzv.settings")
    s = settings_from_conf("j", 1, 1, {"keep_alive_interval": "5",
                                       "keep_alive_max_attempt": "3"})
    assert (s.heartbeat_timeout, s.keep_alive_interval) == (15.0, 5.0)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert "keep_alive_interval=5, keep_alive_max_attempt=3" in lines[0]
    assert "heartbeat_timeout=15s" in lines[0] and "passed every 5s" in lines[0]


@pytest.mark.parametrize(("conf", "ttl", "interval"), [
    ({"keep_alive_interval": "10", "keep_alive_max_attempt": "4"}, 40.0, 10.0),
    ({"keep_alive_interval": "2", "keep_alive_max_attempt": "2"}, 4.0, 2.0),
    # one attempt: dead after one interval, so the check is passed every third of it
    ({"keep_alive_interval": "9", "keep_alive_max_attempt": "1"}, 9.0, None),
    # attempts alone: c10d's default interval
    ({"keep_alive_max_attempt": "6"}, C10D_KEEP_ALIVE_INTERVAL * 6, C10D_KEEP_ALIVE_INTERVAL),
    # interval alone, too long to be ours: c10d's default attempts
    ({"keep_alive_interval": str(HEARTBEAT_TIMEOUT_DEFAULT)},
     HEARTBEAT_TIMEOUT_DEFAULT * C10D_KEEP_ALIVE_MAX_ATTEMPT, HEARTBEAT_TIMEOUT_DEFAULT),
])
def test_c10d_keep_alive_mappings(conf, ttl, interval, caplog):
    caplog.set_level(logging.INFO, logger="consul_rdzv.settings")
    s = settings_from_conf("j", 1, 1, conf)
    assert (s.heartbeat_timeout, s.keep_alive_interval) == (ttl, interval)
    assert s.heartbeat_interval <= s.heartbeat_timeout / 2
    assert [f"heartbeat_timeout={ttl:g}s" in r.getMessage() for r in caplog.records] == [True]


def test_keep_alive_interval_alone_that_fits_is_ours_and_logs_nothing(caplog):
    caplog.set_level(logging.INFO, logger="consul_rdzv.settings")
    s = settings_from_conf("j", 1, 1, {"keep_alive_interval": "2"})
    assert (s.heartbeat_timeout, s.keep_alive_interval) == (HEARTBEAT_TIMEOUT_DEFAULT, 2.0)
    assert caplog.records == []


@pytest.mark.parametrize(("conf", "match"), [
    ({"keep_alive_max_attempt": "3", "heartbeat_timeout": "10"},
     "keep_alive_max_attempt .c10d's. and heartbeat_timeout both set"),
    ({"keep_alive_max_attempt": "0"}, "keep_alive_max_attempt='0' is not a whole number"),
    ({"keep_alive_max_attempt": "three"}, "keep_alive_max_attempt='three'"),
    ({"keep_alive_interval": "0.1", "keep_alive_max_attempt": "3"},
     r"0.1s x 3 = 0.3s .*must be at least 1 second"),
    # ours, explicit: the interval must fit, and the message names c10d's way out
    ({"keep_alive_interval": "6", "heartbeat_timeout": "10"},
     r"keep_alive_interval \(6\) must be at most half of heartbeat_timeout \(10s\).*"
     "keep_alive_max_attempt"),
])
def test_c10d_keep_alive_conflicts_are_refused_naming_the_keys(conf, match):
    with pytest.raises(ValueError, match=match):
        settings_from_conf("j", 1, 1, conf)


@pytest.mark.parametrize("key", sorted(IGNORED_KEYS))
def test_c10d_keys_without_equivalent_are_ignored_with_one_info_line(key, caplog):
    caplog.set_level(logging.INFO, logger="consul_rdzv.settings")
    value = {"is_host": "true", "store_type": "file"}[key]
    assert settings_from_conf("j", 1, 1, {key: value}) == make(run_id="j")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and f"{key}={value} (c10d's) is ignored: " in lines[0], lines
    assert IGNORED_KEYS[key] in lines[0]


def test_c10d_store_type_is_validated_as_c10d_would():
    with pytest.raises(ValueError, match="store_type='etcd' is invalid: c10d knows tcp and file"):
        settings_from_conf("j", 1, 1, {"store_type": "etcd"})


def test_a_whole_c10d_conf_carries_over():
    """What a c10d user passes (torch's documented keys), plus torchrun's injected timeout."""
    conf = {"join_timeout": "600", "last_call_timeout": "10", "close_timeout": "20",
            "read_timeout": "45", "keep_alive_interval": "5", "keep_alive_max_attempt": "3",
            "is_host": "false", "store_type": "tcp", "use_libuv": "true", "timeout": 900}
    s = settings_from_conf("j", 2, 4, conf)
    assert (s.join_timeout, s.last_call_timeout, s.close_timeout, s.read_timeout) == \
        (600.0, 10.0, 20.0, 45.0)
    assert (s.heartbeat_timeout, s.keep_alive_interval) == (15.0, 5.0)


def test_token_in_conf_is_refused_naming_token_file():
    with pytest.raises(ValueError, match=r"rdzv conf key token is not accepted: .*ps.*"
                                         "token_file=PATH"):
        settings_from_conf("j", 1, 1, {"token": "secret-value"})


# ----------------------------------------------------------------------------- store_port


@pytest.mark.parametrize(("value", "ports"), [
    ("29400", (29400, 29400)), ("29400-29499", (29400, 29499)), (" 1 - 65535 ", (1, 65535)),
    (29401, (29401, 29401)), ("", None),
])
def test_store_port_forms(value, ports):
    assert settings_from_conf("j", 1, 1, {"store_port": value}).store_port == ports


@pytest.mark.parametrize("value", ["0", "65536", "29499-29400", "abc", "29400-", "1,2",
                                   "29400:29499", "-5"])
def test_bad_store_port_is_refused_with_the_forms_to_use(value):
    with pytest.raises(ValueError, match=r"store_port.*(29400-29499|between 1 and 65535)"):
        settings_from_conf("j", 1, 1, {"store_port": value})


@pytest.mark.parametrize("value", [(0, 1), (5, 4), (1, 70000), [1, 2], (True, 2), 29400])
def test_bad_store_port_in_the_api_is_refused(value):
    with pytest.raises(ValueError, match="store_port"):
        make(store_port=value)
