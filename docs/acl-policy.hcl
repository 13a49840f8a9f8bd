# Least-privilege Consul ACL policy for consul-rdzv (torchrun --rdzv-backend consul).
#
# For the defaults: key_prefix "torchelastic" and service_name "torchelastic-<run_id>".
# Each rule below was found necessary by experiment on Consul 1.14.5 with default-deny ACLs:
# starting from an empty policy, only the rules a real 2-node torchrun job needed were added,
# and removing any one of them makes a job fail at once with an error naming it
# (tests/test_acl_policy.py checks all of this against this very file).
#
# Create the policy and a token holding only it (with a management token in CONSUL_HTTP_TOKEN):
#
#   consul acl policy create -name consul-rdzv -rules @docs/acl-policy.hcl
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
# The session rule does not depend on either.
#
# Not needed, verified: node_prefix (a session bound to the node's serfHealth check needs only
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
# blocking reads of those prefixes, and their deletion when nodes leave.
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
# checks session write on the name of the Consul node whose agent the job talks to, which can
# be any host of the cluster, hence "". A process that takes its node id over from a
# predecessor destroys the predecessor's session, which may live on another node. If every
# node name of your cluster shares a prefix (e.g. "gpu-"), that prefix may replace "".
session_prefix "" {
  policy = "write"
}
