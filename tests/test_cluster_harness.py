"""The multi-member cluster harness against real agents: start-up, replication, leader failover,
client failure, freeze, network partitions, ACL and TLS variants.

Every wait has a deadline (no fixed sleeps); measured figures are printed with a ``[figure]`` tag
(``pytest -s`` shows them). Tests that inject failures use the shared ``cluster`` fixture, which
restores it (heal, thaw, restart, wait until healthy) after each test.
"""

from __future__ import annotations

import ipaddress
import os
import random
import shutil
import socket
import time
import uuid

import pytest
from rdzv_nodes import figure, wait_for

from consul_rdzv.errors import ConsulError, ConsulPermissionDenied
from consul_testing import (
    ClusterMember,
    ConsulCluster,
    PartitionUnsupported,
    pick_loopback_block,
)

#: Each test starts clusters of its own (or uses the shared one): scheduled first (conftest.py).
pytestmark = pytest.mark.cluster

needs_partitions = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="network partitions need root and iproute2's `ip rule`",
)


#: What a member that is down, restarting or cut off raises while a test waits on it.
DOWN = (OSError, ConsulError)


def stale_value(member: ClusterMember, key: str) -> str | None:
    """``key`` as ``member`` has it in its own state store (``?stale``: no forwarding)."""
    status, body = member.api("GET", f"/v1/kv/{key}?stale&raw")
    return body if status == 200 else None


def kv_write_works(member: ClusterMember, key: str, value: str) -> bool:
    status, body = member.api("PUT", f"/v1/kv/{key}", body=value, timeout=5.0)
    return status == 200 and body is True


# ------------------------------------------------------------------------------- no agents


def test_pick_loopback_block_skips_block_if_a_socket_listens_in_it():
    first = pick_loopback_block(random.Random(1234))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((f"{first}.77", 0))
        s.listen()  # /proc/net/tcp lists listening and connected sockets, as Consul's are
        second = pick_loopback_block(random.Random(1234))
    assert second != first
    for block in (first, second):
        assert ipaddress.ip_address(f"{block}.1") in ipaddress.ip_network("127.0.0.0/8")
        assert int(block.split(".")[1]) >= 16  # never 127.0.x.x, where 127.0.0.1 lives


@pytest.mark.consul
def test_cluster_partition_raises_unsupported_if_members_share_the_test_uid():
    c = ConsulCluster(servers=1, clients=0, separate_uids=False)
    try:
        assert c.uid_base is None
        with pytest.raises(PartitionUnsupported, match="uid"):
            c.partition(c.servers[0])
    finally:
        c.close()


@pytest.mark.parametrize("names", [["a"], ["a", "a"], ["a", "b c"], ["a", "server-9"],
                                   ["a", "-b"]])
def test_cluster_refuses_bad_client_names(names):
    with pytest.raises(ValueError, match="client_names"):
        ConsulCluster(servers=1, clients=2, client_names=names)


@pytest.mark.consul
def test_cluster_names_its_client_agents_as_told():
    c = ConsulCluster(servers=1, clients=2, client_names=["team-a-0", "team-b-0"])
    try:
        assert [m.name for m in c.clients] == ["team-a-0", "team-b-0"]
        assert [m.name for m in c.servers] == ["server-0"]
    finally:
        c.close()


# ------------------------------------------------------------------------------- one cluster


@pytest.mark.timeout(90)
def test_cluster_starts_with_leader_and_every_member_alive_if_started(consul_cluster):
    c = consul_cluster
    figure(f"cluster start ({len(c.servers)} servers + {len(c.clients)} clients, leader, all "
           f"alive): {c.start_seconds:.2f} s")
    assert len(c.servers) == 3 and len(c.clients) == 2
    assert all(m.is_server for m in c.servers) and not any(m.is_server for m in c.clients)
    ips = [m.ip for m in c.members]
    assert len(set(ips)) == len(ips)
    network = ipaddress.ip_network(f"{c.block}.0/24")
    assert all(ipaddress.ip_address(ip) in network for ip in ips)
    assert network.subnet_of(ipaddress.ip_network("127.0.0.0/8"))
    assert c.leader() in c.servers
    for server in c.servers:
        seen = c.members_seen_by(server)
        assert {name: e["status"] for name, e in seen.items()} == {
            m.name: "alive" for m in c.members}
    for m in c.members:
        assert m.url == f"http://{m.ip}:{m.port}"
        assert m.env() == {"CONSUL_HTTP_ADDR": m.url}
        status, me = m.api("GET", "/v1/agent/self")
        assert status == 200
        assert me["Member"]["Addr"] == m.ip
        assert me["Config"]["Server"] is m.is_server
        assert m.data_dir.is_dir()
        if c.uid_base is not None:
            assert os.stat(f"/proc/{m.proc.pid}").st_uid == m.uid
    assert len({m.uid for m in c.members}) == len(c.members)


@pytest.mark.timeout(60)
def test_forget_services_leaves_no_service_or_check_on_any_member(consul_cluster):
    """What a killed node leaves behind (a service with a TTL check, on a client agent and on a
    server) is deregistered, and the catalog holds none of it when ``forget_services`` returns."""
    c = consul_cluster
    tag = uuid.uuid4().hex[:8]
    left = {c.clients[0]: f"left-{tag}-a", c.servers[0]: f"left-{tag}-b"}
    for member, service_id in left.items():
        status, text = member.api("PUT", "/v1/agent/service/register", body={
            "ID": service_id, "Name": service_id, "Check": {"TTL": "30s"}})
        assert status == 200, text
    assert c.forget_services() >= len(left)
    for member, service_id in left.items():
        _, services = member.api("GET", "/v1/agent/services")
        assert service_id not in services
        _, node = c.servers[1].api("GET", f"/v1/catalog/node/{member.name}")
        assert service_id not in node["Services"]
        _, checks = c.servers[1].api("GET", f"/v1/health/node/{member.name}")
        assert [ch["CheckID"] for ch in checks if ch["ServiceID"]] == []
    assert c.forget_services() == 0


@pytest.mark.timeout(60)
def test_cluster_kv_write_through_client_is_readable_on_every_server_if_written(cluster):
    key, value = f"harness/{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    client = cluster.clients[0].client()
    try:
        client.kv_put(key, value.encode())
        assert client.kv_get(key, consistent=True).data.value == value.encode()
    finally:
        client.close()
    for server in cluster.servers:  # each from its own Raft copy, no forwarding to the leader
        wait_for(lambda s=server: stale_value(s, key) == value, 10, f"{key} on {server.name}",
                 0.05, ignore=DOWN)
    other = cluster.clients[1].client()
    try:
        assert other.kv_get(key).data.value == value.encode()
    finally:
        other.close()


@pytest.mark.timeout(120)
def test_cluster_elects_new_leader_and_old_one_rejoins_if_leader_killed_and_restarted(cluster):
    old = cluster.wait_for_leader()
    node_id = old.api("GET", "/v1/agent/self")[1]["Config"]["NodeID"]
    ip, ports = old.ip, (old.port, old.serf_port, old.server_port)
    killed = time.monotonic()
    old.kill()
    new = cluster.wait_for_leader(timeout=30, exclude=old)
    took = time.monotonic() - killed
    figure(f"leader SIGKILL -> new leader takes KV writes: {took:.2f} s")
    assert new is not old and new.is_server
    key = f"harness/{uuid.uuid4().hex[:8]}"
    assert kv_write_works(cluster.clients[0], key, "written-while-old-leader-down")
    detected = cluster.wait_member_status(old, "failed", timeout=30)
    figure(f"killed server seen failed by the others: {took + detected:.2f} s after SIGKILL")

    restarted = time.monotonic()
    old.start()
    cluster.wait_healthy(timeout=60)
    figure(f"killed server restarted and healthy again: {time.monotonic() - restarted:.2f} s")
    assert (old.ip, (old.port, old.serf_port, old.server_port)) == (ip, ports)
    assert old.api("GET", "/v1/agent/self")[1]["Config"]["NodeID"] == node_id  # same data dir
    status, peers = cluster.leader().api("GET", "/v1/status/peers")
    assert status == 200 and old.rpc_address in peers
    # It kept its Raft log and caught up with the entry written while it was down.
    wait_for(lambda: stale_value(old, key) == "written-while-old-leader-down", 15,
             "the restarted server's own copy of the key", 0.05, ignore=DOWN)


@pytest.mark.timeout(90)
def test_cluster_shows_client_failed_then_alive_if_client_killed_and_restarted(cluster):
    member = cluster.clients[0]
    killed = time.monotonic()
    member.kill()
    assert not member.running
    cluster.wait_member_status(member, "failed", timeout=30)
    figure(f"client agent SIGKILL -> failed on every server: {time.monotonic() - killed:.2f} s")
    restarted = time.monotonic()
    member.restart()
    cluster.wait_member_status(member, "alive", timeout=30)
    figure(f"client agent restart -> alive on every server: {time.monotonic() - restarted:.2f} s")
    assert kv_write_works(member, f"harness/{uuid.uuid4().hex[:8]}", "back")


@pytest.mark.timeout(90)
def test_cluster_shows_client_left_then_alive_if_client_stopped_gracefully(cluster):
    member = cluster.clients[1]
    member.stop()
    cluster.wait_member_status(member, "left", timeout=30)
    member.start()
    cluster.wait_member_status(member, "alive", timeout=30)
    cluster.wait_healthy(timeout=30)


@pytest.mark.timeout(120)
def test_cluster_elects_new_leader_and_old_one_follows_if_leader_frozen_and_thawed(cluster):
    old = cluster.wait_for_leader()
    frozen = time.monotonic()
    old.freeze()
    assert old.running and not old.reachable
    new = cluster.wait_for_leader(timeout=30, exclude=old)
    figure(f"leader SIGSTOP -> new leader takes KV writes: {time.monotonic() - frozen:.2f} s")
    cluster.wait_member_status(old, "failed", timeout=30)
    with pytest.raises(OSError):  # it is there at TCP level but answers nothing
        old.api("GET", "/v1/agent/self", timeout=0.5)

    thawed = time.monotonic()
    old.thaw()
    cluster.wait_healthy(timeout=60)
    figure(f"thawed ex-leader alive and following: {time.monotonic() - thawed:.2f} s")
    leader = cluster.leader()
    assert leader is not None
    assert old.api("GET", "/v1/status/leader")[1] == leader.rpc_address
    assert new.is_server


@needs_partitions
@pytest.mark.timeout(120)
def test_cluster_partition_cuts_leader_off_and_heal_brings_it_back_if_leader_partitioned(cluster):
    old = cluster.wait_for_leader()
    cut = time.monotonic()
    cluster.partition(old)
    assert old.partitioned and not old.in_contact
    new = cluster.wait_for_leader(timeout=30, exclude=old)
    figure(f"leader partitioned -> majority elects a new leader: {time.monotonic() - cut:.2f} s")
    cluster.wait_member_status(old, "failed", timeout=30)
    figure(f"partitioned leader seen failed by the others: {time.monotonic() - cut:.2f} s")

    # The test still reaches its HTTP API; the member itself is cut off from the cluster. (Its
    # answer can take seconds on a loaded machine while it steps down: a deadline, not a claim.)
    assert old.api("GET", "/v1/agent/self", timeout=30.0)[0] == 200
    wait_for(lambda: old.api("GET", "/v1/status/leader")[1] == "", 15,
             "the cut-off minority server giving up its leadership", 0.05, ignore=DOWN)
    # A write through it fails: Consul holds it for a leader (rpc_hold_timeout, 7 s), then 500.
    status, body = old.api("PUT", f"/v1/kv/harness/{uuid.uuid4().hex[:8]}", body="x",
                           timeout=15.0)
    assert status == 500, body  # "No cluster leader"
    assert kv_write_works(cluster.clients[0], f"harness/{uuid.uuid4().hex[:8]}", "majority")

    healed = time.monotonic()
    cluster.heal(old)
    assert not old.partitioned
    cluster.wait_healthy(timeout=60)
    figure(f"healed server alive and following again: {time.monotonic() - healed:.2f} s")
    leader = cluster.leader()  # the healed server's higher term may have forced an election
    assert leader is not None and old.api("GET", "/v1/status/leader")[1] == leader.rpc_address
    assert new.is_server
    assert kv_write_works(old, f"harness/{uuid.uuid4().hex[:8]}", "healed")


@needs_partitions
@pytest.mark.timeout(90)
def test_cluster_partition_cuts_client_off_servers_if_client_partitioned(cluster):
    member = cluster.clients[0]
    cluster.partition(member)
    cluster.wait_member_status(member, "failed", timeout=30)
    assert cluster.leader() is not None  # the servers are unaffected
    # its HTTP API answers the test (a deadline for a loaded machine, not a claim)...
    assert member.api("GET", "/v1/agent/self", timeout=30.0)[0] == 200
    # ...but it reaches no server: a new connection is refused at once (500 from the agent),
    # one it already had stalls (its packets are dropped), as in a real partition.
    try:
        status, body = member.api("GET", "/v1/kv/harness/anything", timeout=5.0)
    except TimeoutError:
        status, body = None, "timed out"
    assert status in (500, None), body
    cluster.heal(member)
    cluster.wait_member_status(member, "alive", timeout=30)
    wait_for(lambda: kv_write_works(member, f"harness/{uuid.uuid4().hex[:8]}", "healed"), 15,
             "a KV write through the healed client agent", 0.05, ignore=DOWN)


# ------------------------------------------------------------------------------- variants


@pytest.mark.consul
@pytest.mark.timeout(90)
def test_acl_cluster_denies_anonymous_and_accepts_management_token_if_acl_enabled():
    with ConsulCluster(servers=3, clients=1, acl=True) as c:
        figure(f"ACL cluster start (3 servers + 1 client): {c.start_seconds:.2f} s")
        member = c.clients[0]
        assert member.env()["CONSUL_HTTP_TOKEN"] == c.management_token
        assert all(m.management_token == c.management_token for m in c.members)
        anonymous = member.client(token=None)
        managed = member.client()
        try:
            with pytest.raises(ConsulPermissionDenied):
                anonymous.kv_put("acl/denied", b"x")
            managed.kv_put("acl/allowed", b"yes")
            assert managed.kv_get("acl/allowed").data.value == b"yes"
            assert member.api("GET", "/v1/agent/members", token=False)[1] == []
        finally:
            anonymous.close()
            managed.close()


@pytest.mark.consul
@pytest.mark.timeout(90)
def test_tls_cluster_serves_https_on_every_member_if_tls_enabled():
    with ConsulCluster(servers=3, clients=1, tls=True) as c:
        figure(f"TLS cluster start (3 servers + 1 client): {c.start_seconds:.2f} s")
        for m in c.members:
            env = m.env()
            assert env["CONSUL_HTTP_ADDR"] == f"https://{m.ip}:{m.port}"
            assert os.path.isfile(env["CONSUL_CACERT"])
        client = c.clients[0].client()
        try:  # verifies the certificate against the CA, for the member's own IP address
            client.kv_put("tls/key", b"over-https")
            assert client.kv_get("tls/key").data.value == b"over-https"
        finally:
            client.close()
