"""The shipped least-privilege ACL policies (docs/acl-policy.hcl, docs/acl-team-policy.hcl)
against real ACL agents.

Everything here is derived from the shipped files and nothing else: a policy is created from a
file, with its placeholder (``<node-prefix>``, ``<team>``) put in as the file says, through
Consul's HTTP API (``PUT /v1/acl/policy``, ``PUT /v1/acl/token``, with the agent's management
token) or through the very ``consul acl policy create`` command the file gives; the reduced
policies are that file with one rule block removed.

* a full torchrun job (2 nodes, a few steps, default key prefix and service name) succeeds with a
  token that holds only the shipped policy, is visible in the catalog while it runs, cleans up
  after itself, and is never denied anything;
* without any one rule, a node fails within seconds, not at join_timeout, with an error that
  names the rule as the file ships it (``key_prefix "torchelastic/"``: the form that covers every
  run), the exact resource denied, and the file;
* a token whose key rule only reads fails the same way (Consul answers a denied transaction
  operation with a 409 rollback, which must not be mistaken for a conflict and retried);
* a token Consul does not know is reported as unknown, not as a missing permission;
* the session rule is narrowed to the node-name prefix of the job's agents: the file used as is
  (placeholder not put in) is refused naming the rule for the node, and the token cannot destroy
  a session on any other Consul node;
* two teams, each with the per-team policy, their own key prefix, service name and client
  agents (a real cluster), run side by side and neither token can read, join, close, break or
  deregister anything of the other team's run.
"""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from rdzv_nodes import wait_for
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
from torchrun_jobs import TorchrunJob

from consul_rdzv.torch import ConsulRendezvousHandler

POLICY_FILE = Path(__file__).resolve().parent.parent / "docs" / "acl-policy.hcl"
TEAM_POLICY_FILE = POLICY_FILE.with_name("acl-team-policy.hcl")
#: The placeholders the files ask to replace.
NODE_PREFIX = "<node-prefix>"
TEAM = "<team>"

#: One rule block of an HCL policy: ``kind "name" { ... }`` (no nested blocks in a rule).
_BLOCK = re.compile(r'^(?P<kind>[a-z_]+)\s+"(?P<name>[^"]*)"\s*\{[^{}]*\}[ \t]*\n?', re.MULTILINE)

#: A node refused by Consul must fail within this (join_timeout is 30 s in torch_handlers.FAST).
FAIL_FAST = 10.0


def _strip_comments(text: str) -> str:
    return "\n".join(line.split("#", 1)[0] for line in text.splitlines()) + "\n"


def shipped_file() -> str:
    return POLICY_FILE.read_text()


def shipped_policy(node_prefix: str) -> str:
    """The shipped policy with the node-name prefix of the job's agents put in."""
    text = shipped_file()
    assert text.count(f'"{NODE_PREFIX}"') == 2  # the session rule and the node (health) rule
    return text.replace(NODE_PREFIX, node_prefix)


def team_policy(team: str) -> str:
    return TEAM_POLICY_FILE.read_text().replace(TEAM, team)


def rule_blocks(policy: str) -> list[re.Match]:
    return list(_BLOCK.finditer(_strip_comments(policy)))


def without_block(policy: str, block: re.Match) -> str:
    """The policy (comments dropped) with one rule block removed."""
    text = _strip_comments(policy)
    return text[:block.start()] + text[block.end():]


def rule_header(block: re.Match) -> str:
    """How the rule reads in the file, e.g. ``key_prefix "torchelastic/"``."""
    return f'{block["kind"]} "{block["name"]}"'


class Acl:
    """Policies and tokens on an ACL agent, through the HTTP API with its management token."""

    def __init__(self, agent) -> None:
        self.agent = agent
        self._made: list[tuple[str, str]] = []

    def api(self, method: str, path: str, body: dict | None = None) -> dict:
        conn = http.client.HTTPConnection(self.agent.host, self.agent.port, timeout=10)
        try:
            conn.request(method, path, body=json.dumps(body) if body is not None else None,
                         headers={"X-Consul-Token": self.agent.management_token})
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        assert resp.status == 200, f"{method} {path}: {resp.status} {raw[:300]!r}"
        return json.loads(raw) if raw else {}

    def token(self, rules: str) -> dict:
        """A new token holding only a new policy with ``rules``: ``{SecretID, AccessorID}``."""
        name = f"consul-rdzv-{uuid.uuid4().hex[:8]}"
        policy = self.api("PUT", "/v1/acl/policy", {"Name": name, "Rules": rules})
        self._made.append(("policy", policy["ID"]))
        token = self.api("PUT", "/v1/acl/token", {"Description": f"test {name}",
                                                  "Policies": [{"Name": name}]})
        self._made.append(("token", token["AccessorID"]))
        return token

    def close(self) -> None:
        for kind, ident in reversed(self._made):
            self.api("DELETE", f"/v1/acl/{kind}/{ident}")


@pytest.fixture
def acl(acl_agent):
    made = Acl(acl_agent)
    yield made
    made.close()


@pytest.fixture
def acl_node(acl_agent, make_handler, monkeypatch):
    """``acl_node(run_id, token)``: a node of ``run_id`` with the default key prefix and
    service name, whose token is ``token`` (through CONSUL_HTTP_TOKEN, as torchrun's nodes get
    it); left at teardown."""

    def make(run_id: str, token: str) -> ConsulRendezvousHandler:
        monkeypatch.setenv("CONSUL_HTTP_TOKEN", token)
        return make_handler(acl_agent.address, run_id, None, node_id="node-a")

    return make


def refused(handler: ConsulRendezvousHandler) -> str:
    """The message of the error ``next_rendezvous()`` fails with, which must come fast."""
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError) as info:
        handler.next_rendezvous()
    took = time.monotonic() - started
    text = str(info.value)
    assert took < FAIL_FAST, f"refused only after {took:.1f}s: {text}"
    return text


# ----------------------------------------------------------------------------- the file


def test_shipped_policy_has_the_four_prefix_rules_for_the_defaults():
    blocks = rule_blocks(shipped_file())
    assert sorted(rule_header(b) for b in blocks) == [
        'key_prefix "torchelastic/"', f'node_prefix "{NODE_PREFIX}"',
        'service_prefix "torchelastic-"', f'session_prefix "{NODE_PREFIX}"'], \
        [b.group(0) for b in blocks]
    for block in blocks:
        access = "read" if block["kind"] == "node_prefix" else "write"
        assert re.search(rf'policy\s*=\s*"{access}"', block.group(0)), block.group(0)
    text = shipped_file()
    assert f"sed 's/{NODE_PREFIX}/gpu-/' docs/acl-policy.hcl" in text
    assert "consul acl policy create -name consul-rdzv -rules -" in text
    assert "consul acl token create" in text and "-policy-name consul-rdzv" in text
    # The broad rule is only a documented fallback, with its risk.
    assert 'Fallback, with that risk for EVERY node of the datacenter: session_prefix ""' in text


def _commands(text: str, first: str) -> list[str]:
    """The shell command of a file's comment that starts with ``first`` (with its ``\\``
    continuation lines joined)."""
    lines = [line.lstrip("# ").rstrip() for line in text.splitlines()]
    start = next(i for i, line in enumerate(lines) if line.startswith(first))
    command = lines[start]
    while command.endswith("\\"):
        start += 1
        command = command[:-1] + " " + lines[start]
    return command


@pytest.mark.parametrize(("path", "placeholder", "value"), [
    (POLICY_FILE, NODE_PREFIX, "gpu-"), (TEAM_POLICY_FILE, TEAM, "vision")])
def test_the_files_own_create_command_makes_the_policy(acl_agent, acl, tmp_path, path,
                                                       placeholder, value):
    """The command each file gives, run as written (sed, then consul acl policy create reading
    the rules from stdin), creates a policy whose rules are the file's with the value put in."""
    from consul_rdzv.testing import consul_binary

    command = _commands(path.read_text(), "sed ")
    name = f"consul-rdzv-{uuid.uuid4().hex[:8]}"
    command = re.sub(r"-name \S+", f"-name {name}", command)
    assert f"s/{placeholder}/{value}/" in command and command.endswith("-rules -"), command
    (tmp_path / "consul").symlink_to(consul_binary())
    env = {"CONSUL_HTTP_ADDR": acl_agent.address, "CONSUL_HTTP_TOKEN": acl_agent.management_token,
           "PATH": f"{tmp_path}:/usr/bin:/bin"}
    proc = subprocess.run(["bash", "-c", command], cwd=path.parent.parent, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    policy = acl.api("GET", f"/v1/acl/policy/name/{name}")
    acl._made.append(("policy", policy["ID"]))
    expected = path.read_text().replace(placeholder, value)
    assert [rule_header(b) for b in rule_blocks(policy["Rules"])] == \
        [rule_header(b) for b in rule_blocks(expected)]
    assert placeholder not in "".join(b.group(0) for b in rule_blocks(policy["Rules"]))


# ----------------------------------------------------------------------------- a real job


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_torchrun_job_succeeds_with_a_token_holding_only_the_shipped_policy(acl_agent, acl, run_id,
                                                                            tmp_path):
    token = acl.token(shipped_policy(acl_agent.node_name))
    management = acl_agent.client()
    service = f"torchelastic-{run_id}"
    conf = {"heartbeat_timeout": 2, "last_call_timeout": 1, "join_timeout": 60,
            "consul_timeout": 10}
    try:
        with TorchrunJob(tmp_path, acl_agent.address, run_id, nnodes="2", rdzv_conf=conf,
                         train_args=["--steps", "5"],
                         env={"CONSUL_HTTP_TOKEN": token["SecretID"]}) as job:
            started = time.monotonic()
            for i in range(2):
                job.start(f"node-{i}")
            # Both nodes' services reach the catalog (the agent syncs them with the job's token).
            job.wait_for(lambda: len(management.catalog_service(service)) == 2
                         or all(not a.alive() for a in job.agents),
                         150, "both nodes' service instances in the catalog")
            in_catalog = len(management.catalog_service(service))
            codes = job.wait(150)
            took = time.monotonic() - started
            report = job.report()
            assert codes == {"node-0": 0, "node-1": 0}, report
            assert in_catalog == 2, report
            results = job.results()
            assert [r["rank"] for r in results] == [0, 1], report
            assert {r["world_size"] for r in results} == {2}, report
            assert len({r["checksum"] for r in results}) == 1, report
            for agent in job.agents:
                assert "lacks permission" not in agent.log(), report
        # The job cleaned up after itself with that token: no service left, no key but the
        # finished run's closed marker, kept under a session the job's token created (Consul
        # deletes it after closed_retention).
        assert management.kv_keys(f"torchelastic/{run_id}/") == [
            f"torchelastic/{run_id}/round/current"]
        kept = management.kv_get(f"torchelastic/{run_id}/round/current").data
        assert kept.session and management.session_info(kept.session)["TTL"] == "600s"
        wait_for(lambda: management.catalog_service(service) == [], 10,
                 "the job's service gone from the catalog", 0.1)
        # Consul logs every denied request with the token's AccessorID: none for this one.
        assert token["AccessorID"] not in acl_agent.log_text(10**7)
        print(f"2-node torchrun job with only the shipped ACL policy finished in {took:.1f}s")
    finally:
        management.close()


# ----------------------------------------------------------------------------- each rule


@pytest.mark.parametrize("index", range(4), ids=["rule-1", "rule-2", "rule-3", "rule-4"])
def test_policy_without_one_rule_fails_fast_naming_it_as_shipped(acl_agent, acl, run_id,
                                                                 acl_node, index):
    policy = shipped_policy(acl_agent.node_name)
    blocks = rule_blocks(policy)
    assert len(blocks) == 4
    block = blocks[index]
    token = acl.token(without_block(policy, block))
    text = refused(acl_node(run_id, token["SecretID"]))
    # The rule as the file ships it (the form that covers every run), with its access; for a
    # session, the exact rule for the denied node and the file's prefix rule ...
    if block["kind"] == "session_prefix":
        assert f'Add the rule session "{acl_agent.node_name}" {{ policy = "write" }}' in text
        assert f'session_prefix "{NODE_PREFIX}" {{ policy = "write" }}' in text, text
    elif block["kind"] == "node_prefix":
        assert f'Add the rule node "{acl_agent.node_name}" {{ policy = "read" }}' in text, text
        assert f'node_prefix "{NODE_PREFIX}" {{ policy = "read" }}' in text, text
    else:
        assert f'{rule_header(block)} {{ policy = "write" }}' in text, text
    assert "docs/acl-policy.hcl" in text, text
    # ... and the exact resource Consul denied.
    denied = {"key_prefix": f'"{block["name"]}{run_id}/',
              "service_prefix": f'"{block["name"]}{run_id}"',
              "session_prefix": f'"{acl_agent.node_name}"',
              "node_prefix": f'"{acl_agent.node_name}"'}[block["kind"]]
    assert re.search(r"lacks permission '[a-z]+:[a-z]+' on " + re.escape(denied), text), text
    assert "unknown" not in text, text
    print(f"without {rule_header(block)}: {text}")


def test_the_shipped_policy_covers_the_hosts_quarantine_and_a_read_only_key_rule_refuses_it(
        acl_agent, acl, run_id):
    """The quarantine keys (<key_prefix>/~quarantine/<host>) are under the shipped key rule: a
    job token may record a failure (check-and-set) and its node reads an operator's quarantine
    with its blocking query; a token that may only read keys may not write one."""
    from consul_rdzv import quarantine
    from consul_rdzv.client import ConsulClient
    from consul_rdzv.config import ConsulConfig
    from consul_rdzv.errors import ConsulPermissionDenied
    from consul_rdzv.layout import Keys
    from consul_rdzv.rendezvous import ConsulRendezvous
    from consul_rdzv.settings import RendezvousSettings

    def client_with(rules: str) -> ConsulClient:
        return ConsulClient(ConsulConfig.resolve(address=acl_agent.address,
                                                 token=acl.token(rules)["SecretID"], env={}),
                            retry_timeout=3.0)

    host = f"host-{run_id}"
    key = Keys(f"torchelastic/{run_id}").quarantined(host)
    policy = _strip_comments(shipped_policy(acl_agent.node_name))
    rule = next(b for b in rule_blocks(policy) if b["kind"] == "key_prefix")
    assert rule["name"] == "torchelastic/"
    reading = policy[:rule.start()] + rule.group(0).replace('"write"', '"read"') \
        + policy[rule.end():]
    job, reader = client_with(policy), client_with(reading)
    node = None
    try:
        quarantine.update(job, key, lambda v: quarantine.add(
            v, host=host, now=time.time(), seconds=600, why="acl test", by="test"))
        node = ConsulRendezvous(RendezvousSettings(run_id=run_id, min_nodes=1, max_nodes=1,
                                                   consul_timeout=3.0), job,
                                node_id="node-q", host=host)
        node.register(timeout=10)
        wait_for(lambda: node.health_reason().endswith(": acl test"), 10,
                 "the node reads its host's quarantine with the job token")
        assert quarantine.read(reader, key)[0] is not None
        with pytest.raises(ConsulPermissionDenied):
            reader.kv_put(key, b"{}")
    finally:
        if node is not None:
            node.leave()
        job.kv_delete(key)
        job.close()
        reader.close()


def test_policy_whose_key_rule_only_reads_fails_fast_naming_the_write_rule(acl_agent, acl, run_id,
                                                                           acl_node):
    policy = shipped_policy(acl_agent.node_name)
    key = next(b for b in rule_blocks(policy) if b["kind"] == "key_prefix")
    text = _strip_comments(policy)
    reduced = (text[:key.start()] + key.group(0).replace('"write"', '"read"')
               + text[key.end():])
    assert reduced.count('"read"') == text.count('"read"') + 1
    token = acl.token(reduced)
    message = refused(acl_node(run_id, token["SecretID"]))
    assert f"lacks permission 'key:write' on \"{key['name']}{run_id}/members/node-a\"" in message
    assert f'{rule_header(key)} {{ policy = "write" }}' in message, message


def test_unknown_token_is_reported_as_unknown_not_as_a_missing_permission(run_id, acl_node):
    text = refused(acl_node(run_id, str(uuid.uuid4())))
    assert "ACL not found" in text, text
    assert "token is unknown to this Consul" in text, text
    assert "expired, deleted, or created in another Consul cluster" in text, text
    assert "lacks permission" not in text and "Add the rule" not in text, text


# ----------------------------------------------------------------------------- session narrowing


def test_policy_used_without_its_node_prefix_is_refused_naming_the_node_rule(acl_agent, acl,
                                                                             run_id, acl_node):
    """The file as is, its placeholder not put in: no session anywhere. The node fails at once
    with the exact rule for its agent's node and the file's prefix rule."""
    token = acl.token(shipped_file())
    text = refused(acl_node(run_id, token["SecretID"]))
    assert f"lacks permission 'session:write' on \"{acl_agent.node_name}\"" in text, text
    assert f'Add the rule session "{acl_agent.node_name}" {{ policy = "write" }}' in text, text
    assert f'session_prefix "{NODE_PREFIX}"' in text and "docs/acl-policy.hcl" in text, text


def test_job_token_cannot_touch_sessions_on_other_consul_nodes(acl_agent, acl, run_id,
                                                               acl_node):
    """Another application's lock on another Consul node: the job's token neither reads nor
    destroys its session (with session_prefix "" it could, which the fallback warns about)."""
    from consul_rdzv.client import ConsulClient
    from consul_rdzv.config import ConsulConfig
    from consul_rdzv.errors import ConsulPermissionDenied

    other = f"other-app-{uuid.uuid4().hex[:6]}"
    acl.api("PUT", "/v1/catalog/register", {"Node": other, "Address": "127.0.0.9"})
    try:
        session = acl.api("PUT", "/v1/session/create",
                          {"Node": other, "Name": "someone's lock", "NodeChecks": []})["ID"]
        narrow = acl.token(shipped_policy(acl_agent.node_name))
        broad = acl.token(shipped_policy(""))
        # the job itself works with the narrow token
        info = acl_node(run_id, narrow["SecretID"]).next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)

        def client(token: dict) -> ConsulClient:
            return ConsulClient(ConsulConfig.resolve(address=acl_agent.address,
                                                     token=token["SecretID"], env={}))

        job = client(narrow)
        try:
            assert job.session_info(session) is None  # filtered: no session read there
            with pytest.raises(ConsulPermissionDenied, match=f"session:write' on \"{other}\""):
                job.session_destroy(session)
        finally:
            job.close()
        assert acl.api("GET", f"/v1/session/info/{session}"), "the other lock is gone"
        wide = client(broad)
        try:  # the fallback's risk, shown
            wide.session_destroy(session)
        finally:
            wide.close()
        assert acl.api("GET", f"/v1/session/info/{session}") in (None, [], {})
    finally:
        acl.api("PUT", "/v1/catalog/deregister", {"Node": other})


# ----------------------------------------------------------------------------- two teams


@pytest.fixture(scope="module")
def team_cluster():
    """A real ACL cluster: one server, and one client agent per team named after the team
    (the layout docs/acl-team-policy.hcl asks for)."""
    from consul_testing import ConsulCluster

    cluster = ConsulCluster(servers=1, clients=2, acl=True,
                            client_names=["team-a-host0", "team-b-host0"]).start()
    yield cluster
    cluster.close()


@pytest.mark.consul
@pytest.mark.timeout(180)
@pytest.mark.cluster  # it starts a cluster of its own: scheduled first (conftest.py)
def test_two_teams_cannot_touch_each_others_runs(team_cluster, tmp_path):
    from consul_rdzv.client import ConsulClient
    from consul_rdzv.config import ConsulConfig
    from consul_rdzv.errors import ConsulPermissionDenied, RendezvousConnectionError
    from consul_rdzv.rendezvous import ConsulRendezvous
    from consul_rdzv.settings import RendezvousSettings

    admin = Acl(team_cluster.servers[0])
    hosts = dict(zip(("team-a", "team-b"), team_cluster.clients, strict=True))
    tokens = {team: admin.token(team_policy(team))["SecretID"] for team in hosts}
    made: list[ConsulRendezvous] = []

    def client(team: str, member) -> ConsulClient:
        return ConsulClient(ConsulConfig.resolve(address=member.address, token=tokens[team],
                                                 env={}), retry_timeout=3.0)

    def node(team: str, node_id: str, *, of: str | None = None, member=None) -> ConsulRendezvous:
        """A node with ``team``'s token, in the run of team ``of`` (its own by default), on
        ``member`` (its own team's agent by default)."""
        owner = of or team
        settings = RendezvousSettings(
            run_id="job-1", key_prefix=f"teams/{owner}", service_name=f"{owner}-torchelastic",
            min_nodes=2, max_nodes=2, heartbeat_timeout=5, last_call_timeout=0.5,
            join_timeout=30, consul_timeout=3, close_timeout=5)
        n = ConsulRendezvous(settings, client(team, member or hosts[team]), node_id=node_id,
                             endpoint_provider=lambda: {"host": "127.0.0.1", "port": 1})
        made.append(n)
        return n

    try:
        # Each team's run, same run id, side by side: both form their round.
        runs = {team: [node(team, f"{team}-n{i}") for i in range(2)] for team in hosts}
        with ThreadPoolExecutor(4) as pool:
            futures = {n.node_id: pool.submit(n.next_round) for ns in runs.values() for n in ns}
            results = {k: f.result(60) for k, f in futures.items()}
        for team, ns in runs.items():
            assert {results[n.node_id].world_size for n in ns} == {2}
            for n in ns:
                info = admin.api("GET", f"/v1/session/info/{n.session_id}")
                assert info[0]["Node"] == hosts[team].name
        victims = runs["team-a"]
        sessions = [n.session_id for n in victims]

        # Team B's token against team A's run, through either team's agent.
        for member in hosts.values():
            b = client("team-b", member)
            try:
                assert b.kv_list("teams/team-a/").data == []  # nothing visible
                with pytest.raises(ConsulPermissionDenied):
                    b.kv_put("teams/team-a/job-1/round/current", b"{}")
                with pytest.raises(ConsulPermissionDenied):
                    b.kv_delete("teams/team-a/", recurse=True)
                with pytest.raises(ConsulPermissionDenied):
                    b.session_destroy(sessions[0])
                assert b.session_info(sessions[0]) is None
            finally:
                b.close()
        b_on_a = client("team-b", hosts["team-a"])
        try:
            with pytest.raises(ConsulPermissionDenied, match="service:write"):
                b_on_a.agent_service_deregister(victims[0].registration.service_id)
        finally:
            b_on_a.close()
        # Joining team A's run, closing it, or running on team A's agent: refused at once.
        for intruder in (node("team-b", "intruder-1", of="team-a"),
                         node("team-b", "intruder-2", member=hosts["team-a"])):
            started = time.monotonic()
            with pytest.raises(RendezvousConnectionError, match="lacks permission"):
                intruder.next_round()
            assert time.monotonic() - started < FAIL_FAST
        with pytest.raises(RendezvousConnectionError):
            node("team-b", "closer", of="team-a").close("not yours")

        # Team A's run never noticed: sessions kept, nobody waiting, next round with both.
        assert [n.session_id for n in victims] == sessions
        assert all(n.num_nodes_waiting() == 0 for n in victims)
        with ThreadPoolExecutor(2) as pool:
            again = [f.result(60) for f in [pool.submit(n.next_round) for n in victims]]
        assert {r.world_size for r in again} == {2}
        assert again[0].round == results[victims[0].node_id].round + 1
    finally:
        for n in made:
            n.settings = n.settings.with_(close_timeout=3)
            n.leave()
            n.client.close()
        admin.close()
