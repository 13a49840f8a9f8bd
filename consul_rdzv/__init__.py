"""consul-rdzv: a HashiCorp Consul rendezvous backend for torch.distributed.elastic."""
