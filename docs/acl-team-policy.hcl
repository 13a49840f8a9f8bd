# Per-team consul-rdzv ACL policy: several teams share one Consul, and no team's token can read,
# join, close or break another team's runs. One policy (and token) per team, from this file with
# <team> replaced by the team's name (with a management token in CONSUL_HTTP_TOKEN):
#
#   sed 's/<team>/vision/g' docs/acl-team-policy.hcl \
#     | consul acl policy create -name consul-rdzv-vision -rules -
#   consul acl token create -description "vision torchrun jobs" -policy-name consul-rdzv-vision
#
# The layout it needs (tests/test_acl_policy.py runs two teams this way on a real cluster):
#
#   * each team's jobs run with --rdzv-conf key_prefix=teams/<team>,service_name=<team>-torchelastic
#     (consul-rdzv list/status/watch: --key-prefix teams/<team> --service-name <team>-torchelastic);
#   * each team's training hosts run their own Consul client agents whose node names start with
#     "<team>-" (vision-gpu-001, ...), and its jobs talk to those agents only.
#
# The second point is what Consul needs for sessions: a session rule names Consul nodes, nothing
# narrower (docs/acl-policy.hcl). A token that may write sessions on a node may destroy every
# session there, and a destroyed consul-rdzv session deletes the member key it holds: teams that
# share a Consul node (a shared host's agent, or the servers when there are no client agents)
# cannot be kept apart, whatever their key and service rules say. Pick team names so that no
# "<team>-" starts another team's node names ("ml" and "ml-ops" would overlap), or replace the
# session_prefix rule by one exact rule per host: session "vision-gpu-001" { policy = "write" }.

# The team's runs: teams/<team>/<run_id>/... (the trailing slash keeps "teams/ml/" from also
# matching "teams/ml-ops/"), their round histories (teams/<team>/~history/...) and the team's
# hosts' quarantine (teams/<team>/~quarantine/<host>: each team quarantines hosts for its own
# runs only).
key_prefix "teams/<team>/" {
  policy = "write"
}

# The team's service: one name for all its runs (service instances are <run_id>-<node_id>).
service "<team>-torchelastic" {
  policy = "write"
}

# Sessions on the team's own Consul nodes only.
session_prefix "<team>-" {
  policy = "write"
}

# Each node reads the health checks of its own Consul node (docs/health.md), on the team's own
# Consul nodes only. Not needed with --rdzv-conf health_checks=off.
node_prefix "<team>-" {
  policy = "read"
}
