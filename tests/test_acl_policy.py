"""The shipped least-privilege ACL policy (docs/acl-policy.hcl) against a real ACL agent.

Everything here is derived from the shipped file and nothing else: the policy is created from it
through Consul's HTTP API (``PUT /v1/acl/policy``, ``PUT /v1/acl/token``, with the agent's
management token), and the reduced policies are that file with one rule block removed.

* a full torchrun job (2 nodes, a few steps, default key prefix and service name) succeeds with a
  token that holds only the shipped policy, is visible in the catalog while it runs, cleans up
  after itself, and is never denied anything;
* without any one rule, a node fails within seconds, not at join_timeout, with an error that
  names the rule as the file ships it (``key_prefix "torchelastic/"``: the form that covers every
  run), the exact resource denied, and the file;
* a token whose key rule only reads fails the same way (Consul answers a denied transaction
  operation with a 409 rollback, which must not be mistaken for a conflict and retried);
* a token Consul does not know is reported as unknown, not as a missing permission.
"""

from __future__ import annotations

import http.client
import json
import re
import time
import uuid
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
from torchrun_jobs import TorchrunJob

from consul_rdzv.torch import ConsulRendezvousHandler

POLICY_FILE = Path(__file__).resolve().parent.parent / "docs" / "acl-policy.hcl"

#: One rule block of an HCL policy: ``kind "name" { ... }`` (no nested blocks in a rule).
_BLOCK = re.compile(r'^(?P<kind>[a-z_]+)\s+"(?P<name>[^"]*)"\s*\{[^{}]*\}[ \t]*\n?', re.MULTILINE)

#: Short timeouts, as strings (what torchrun's --rdzv-conf parser produces).
FAST = {"heartbeat_timeout": "2", "last_call_timeout": "1", "join_timeout": "30",
        "close_timeout": "5", "consul_timeout": "5"}
#: A node refused by Consul must fail within this (join_timeout is 30 s).
FAIL_FAST = 10.0


def _strip_comments(text: str) -> str:
    return "\n".join(line.split("#", 1)[0] for line in text.splitlines()) + "\n"


def shipped_policy() -> str:
    return POLICY_FILE.read_text()


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
def run_id() -> str:
    return f"acl-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def make_handler(acl_agent, monkeypatch):
    """A node of ``run_id`` with the default key prefix and service name, whose token is
    ``token`` (through CONSUL_HTTP_TOKEN, as torchrun's nodes get it); left at teardown."""
    made: list[ConsulRendezvousHandler] = []

    def make(run_id: str, token: str) -> ConsulRendezvousHandler:
        monkeypatch.setenv("CONSUL_HTTP_TOKEN", token)
        params = RendezvousParameters(backend="consul", endpoint=acl_agent.address,
                                      run_id=run_id, min_nodes=1, max_nodes=1,
                                      local_addr="127.0.0.1", node_id="node-a", **FAST)
        handler = get_rendezvous_handler(params)
        assert type(handler) is ConsulRendezvousHandler, type(handler)
        made.append(handler)
        return handler

    yield make
    for handler in made:
        rdzv = handler.rendezvous
        rdzv.settings = rdzv.settings.with_(close_timeout=3)
        rdzv.leave()


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


def test_shipped_policy_has_the_three_prefix_rules_for_the_defaults():
    blocks = rule_blocks(shipped_policy())
    assert sorted(rule_header(b) for b in blocks) == [
        'key_prefix "torchelastic/"', 'service_prefix "torchelastic-"', 'session_prefix ""'], \
        [b.group(0) for b in blocks]
    for block in blocks:
        assert re.search(r'policy\s*=\s*"write"', block.group(0)), block.group(0)
    text = shipped_policy()
    assert "consul acl policy create -name consul-rdzv -rules @docs/acl-policy.hcl" in text
    assert "consul acl token create" in text and "-policy-name consul-rdzv" in text


# ----------------------------------------------------------------------------- a real job


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_torchrun_job_succeeds_with_a_token_holding_only_the_shipped_policy(acl_agent, acl, run_id,
                                                                            tmp_path):
    token = acl.token(shipped_policy())
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
        # The job cleaned up after itself with that token: no key, no service left.
        assert management.kv_keys(f"torchelastic/{run_id}/") == []
        deadline = time.monotonic() + 10
        while management.catalog_service(service) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert management.catalog_service(service) == []
        # Consul logs every denied request with the token's AccessorID: none for this one.
        assert token["AccessorID"] not in acl_agent.log_text(10**7)
        print(f"2-node torchrun job with only the shipped ACL policy finished in {took:.1f}s")
    finally:
        management.close()


# ----------------------------------------------------------------------------- each rule


@pytest.mark.parametrize("index", range(3), ids=["rule-1", "rule-2", "rule-3"])
def test_policy_without_one_rule_fails_fast_naming_it_as_shipped(acl_agent, acl, run_id,
                                                                 make_handler, index):
    policy = shipped_policy()
    blocks = rule_blocks(policy)
    assert len(blocks) == 3
    block = blocks[index]
    token = acl.token(without_block(policy, block))
    text = refused(make_handler(run_id, token["SecretID"]))
    # The rule as the file ships it (the form that covers every run), with its access ...
    assert f'{rule_header(block)} {{ policy = "write" }}' in text, text
    assert "docs/acl-policy.hcl" in text, text
    # ... and the exact resource Consul denied.
    denied = {"key_prefix": f'"{block["name"]}{run_id}/',
              "service_prefix": f'"{block["name"]}{run_id}"',
              "session_prefix": f'"{acl_agent.node_name}"'}[block["kind"]]
    assert re.search(r"lacks permission '[a-z]+:[a-z]+' on " + re.escape(denied), text), text
    assert "unknown" not in text, text
    print(f"without {rule_header(block)}: {text}")


def test_policy_whose_key_rule_only_reads_fails_fast_naming_the_write_rule(acl, run_id,
                                                                           make_handler):
    policy = shipped_policy()
    key = next(b for b in rule_blocks(policy) if b["kind"] == "key_prefix")
    text = _strip_comments(policy)
    reduced = (text[:key.start()] + key.group(0).replace('"write"', '"read"')
               + text[key.end():])
    assert reduced.count('"read"') == 1
    token = acl.token(reduced)
    message = refused(make_handler(run_id, token["SecretID"]))
    assert f"lacks permission 'key:write' on \"{key['name']}{run_id}/members/node-a\"" in message
    assert f'{rule_header(key)} {{ policy = "write" }}' in message, message


def test_unknown_token_is_reported_as_unknown_not_as_a_missing_permission(run_id, make_handler):
    text = refused(make_handler(run_id, str(uuid.uuid4())))
    assert "ACL not found" in text, text
    assert "token is unknown to this Consul" in text, text
    assert "expired, deleted, or created in another Consul cluster" in text, text
    assert "lacks permission" not in text and "Add the rule" not in text, text
