"""The package surface: exactly the public names, and no torch on import."""

import subprocess
import sys

import consul_rdzv


def test_all_lists_exactly_the_public_names():
    public = {n for n in vars(consul_rdzv) if not n.startswith("_")} | {"__version__"}
    modules = {"client", "cli", "config", "errors", "layout", "planning", "ranks", "registration",
               "rendezvous", "settings", "testing", "torch"}
    assert set(consul_rdzv.__all__) == public - modules
    assert sorted(consul_rdzv.__all__) == consul_rdzv.__all__


def test_import_does_not_import_torch():
    code = ("import sys, consul_rdzv, consul_rdzv.cli, consul_rdzv.testing; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
