"""Example scripts shipped with the package, run by torchrun, never imported by consul-rdzv.

``train.py`` is the small gloo DDP job of ``consul-rdzv demo`` and of the end-to-end tests. It
imports torch (the package's own modules do not, except ``consul_rdzv.torch``). Run it as a
module (``torchrun ... -m consul_rdzv.examples.train``) or by path
(``importlib.resources.files("consul_rdzv") / "examples" / "train.py"``).
"""
