"""Verification tools that run the product against real Consul clusters (not installed).

``python -m verify.run``: a seeded, randomized fault campaign that checks every round's
invariants (docs/campaign.md); its node process is ``verify/campaign_node.py``.
"""
