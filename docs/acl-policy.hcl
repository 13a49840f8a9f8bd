# Least-privilege Consul ACL policy for consul-rdzv (torchrun --rdzv-backend consul).
#
# For the defaults: key_prefix "torchelastic" and service_name "torchelastic-<run_id>".
# Each rule below was found necessary by experiment on Consul 1.14.5 with default-deny ACLs:
# starting from an empty policy, only the rules a real 2-node torchrun job needed were added,
# and removing any one of them makes a job fail at once with an error naming it
# (tests/test_acl_policy.py checks all of this against this very file).
#
# <node-prefix> below is the prefix that the Consul node names of the job's agents share: the
# client agents of the training hosts (their node names default to the host names, e.g. "gpu-"
# for gpu-001, gpu-002, ...), or, without client agents, the servers the nodes talk to (e.g.
# "consul-server-" with the Helm chart). Put it in when you create the policy (with a
# management token in CONSUL_HTTP_TOKEN):
#
#   sed 's/<node-prefix>/gpu-/' docs/acl-policy.hcl \
#     | consul acl policy create -name consul-rdzv -rules -
#   consul acl token create -description "torchrun jobs" -policy-name consul-rdzv
#
# and give the token's SecretID to every node of the job: CONSUL_HTTP_TOKEN, or better
# CONSUL_HTTP_TOKEN_FILE / --rdzv-conf token_file=PATH (--rdzv-conf is visible in `ps`).
#
# Another key_prefix or service_name: change the two names, keeping their form.
#   --rdzv-conf key_prefix=team-a/rdzv    ->  key_prefix "team-a/rdzv/"   (keep the trailing
#       slash: "torchelastic" without it would also match "torchelastic-other/...")
#   --rdzv-conf service_name=trainers     ->  service "trainers"          (one service name for
#       every run, so an exact rule; the default is one service per run, torchelastic-<run_id>,
#       hence the prefix rule)
# Several teams on one Consul, each unable to touch the others' runs: docs/acl-team-policy.hcl.
#
# Not needed, verified: node write (a session bound to the node's serfHealth check needs only
# session write on that node), agent_prefix (the job never calls /v1/agent/self), operator,
# keyring, acl. The Consul agents keep their own agent token as usual; the agent syncs the
# service a node registers to the catalog with the token it was registered with (Consul's
# agent/local/state.go), which this policy allows.
#
# Operators: `consul-rdzv list`, `status` and `watch` need key_prefix "torchelastic/" and
# service_prefix "torchelastic-" with { policy = "read" }, plus node_prefix "" { policy =
# "read" } for the nodes' health (Consul filters /v1/health and /v1/catalog/service by node
# read: without it they answer an empty list). Commands that change a run (`close`, `drain`,
# `gc`) need the rules below.

# The run's keys: <key_prefix>/<run_id>/members/<node_id> (locked with the node's session, in
# a transaction), <key_prefix>/<run_id>/round/leader (acquired by the coordinator),
# <key_prefix>/<run_id>/round/current (the sealed round, check-and-set; the closed marker),
# blocking reads of those prefixes, and their deletion when nodes leave; the round history
# (<key_prefix>/~history/<run_id>/...) and the hosts' quarantine (<key_prefix>/~quarantine/<host>:
# each node's blocking read of its host's key, and the check-and-set write of a failure).
key_prefix "torchelastic/" {
  policy = "write"
}

# Each node's service instance and its TTL check on the local Consul agent: register, pass the
# check (the heartbeat), read this agent's registration of it, deregister. The service is
# torchelastic-<run_id> by default, one per run, so the rule is a prefix.
service_prefix "torchelastic-" {
  policy = "write"
}

# Each node's session, bound to its TTL check: create, probe (renew), read, destroy. Consul
# knows no narrower session rule than a Consul node name (agent/consul/session_endpoint.go:
# session write on the node the session lives on, for create, renew and destroy alike; reads
# are filtered by session read on it): not the session's name, nor the token that created it.
# So this rule lets the token destroy ANY session on those nodes, other applications' locks
# included (and a destroyed session with behavior "delete" deletes the keys it holds). Keep the
# prefix to the training hosts' node names. A process that takes its node id over from a
# predecessor destroys the predecessor's session, which may live on another of these nodes.
#
# Fallback, with that risk for EVERY node of the datacenter: session_prefix "" (any node name),
# for fleets whose node names share no prefix. Without client agents every session lives on a
# server, so the prefix of the servers' names is as broad in effect: any token with it can
# destroy every session on the servers (see docs/configuration.md, "ACL").
session_prefix "<node-prefix>" {
  policy = "write"
}

# Each node's read of its own Consul node's health checks (/v1/health/node/<node>, a blocking
# query): a critical node-level check or maintenance mode holds the node out of rounds
# (docs/health.md). Consul filters those checks by node read: without this rule a node sees
# none and refuses to join, naming the rule. Not needed with --rdzv-conf health_checks=off.
node_prefix "<node-prefix>" {
  policy = "read"
}
