"""Rendezvous benchmark: consul vs torch's c10d and etcd-v2 (see docs/benchmarks.md)."""
