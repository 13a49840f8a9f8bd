"""RendezvousSettings validation and settings_from_conf (torchrun's --rdzv-conf strings).

Pure logic, no Consul. Every bad value must fail early with a ValueError that names the key.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from consul_rdzv.settings import (
    CONNECTION_KEYS,
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
    ({"node_meta": {f"k{i}": "v" for i in range(60)}}, "node_meta has 60 items; at most 52"),
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


def test_conf_connection_and_ignored_keys_are_accepted_without_effect():
    conf = {k: "x" for k in CONNECTION_KEYS} | {k: "1" for k in IGNORED_KEYS}
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
