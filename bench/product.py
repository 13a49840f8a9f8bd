"""Which consul_rdzv the benchmark measures: this checkout, or another version of the package.

``python -m bench.run --product e2ac5ef`` measures the package as it was at a commit (or
``--product DIR``: a directory holding a ``consul_rdzv`` package) with the SAME bench code, so
that before/after figures differ only by the product. :func:`prepare` extracts the commit's
package (``git archive <commit> consul_rdzv``) into ``bench/results/products/<commit>/`` and
writes a ``sitecustomize.py`` beside it.

Why more than ``PYTHONPATH``: the package is installed editable from this checkout, and
setuptools' editable finder (a ``sys.meta_path`` entry from ``__editable__.*.pth``) still maps
``consul_rdzv.<module>`` to this checkout for any module the old package lacks
(``consul_rdzv.planning``, ``.registration``); and ``python -m`` / ``python -c`` (the
forkserver) put the working directory, this checkout, *before* ``PYTHONPATH`` on ``sys.path``.
So the worker processes call :func:`activate` before anything imports torch (whose rendezvous
registry imports ``consul_rdzv.torch`` through the ``torchrun.handlers`` entry point): it drops
the editable finder and puts the product directory first. The ``sitecustomize.py`` does the
first half for any other Python process started with ``PYTHONPATH=<dir>``. Every worker reports
``consul_rdzv.__file__`` (and the file of the handler torch's registry created), and the runner
refuses a run in which any of them is not under the product directory.

The runner itself keeps this checkout's ``consul_rdzv.testing`` (the Consul harness), so both
sides run against identically configured agents.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

ENV = "BENCH_PRODUCT_DIR"
ROOT = Path(__file__).resolve().parent.parent

SITECUSTOMIZE = '''\
# Written by bench/product.py: drop the editable finder of the consul_rdzv checkout, so that
# modules missing from this package are NOT silently loaded from the checkout. Inherited by
# every Python process started with PYTHONPATH pointing here.
import sys

def _editable(obj):
    names = (getattr(obj, "__module__", None) or "", type(obj).__module__ or "",
             getattr(obj, "__qualname__", None) or "")
    return any("__editable__" in name for name in names)

sys.meta_path[:] = [f for f in sys.meta_path if not _editable(f)]
sys.path_hooks[:] = [h for h in sys.path_hooks if not _editable(h)]
sys.path_importer_cache.clear()
'''


def _editable(obj) -> bool:
    names = (getattr(obj, "__module__", None) or "", type(obj).__module__ or "",
             getattr(obj, "__qualname__", None) or "")
    return any("__editable__" in name for name in names)


def activate() -> str | None:
    """In a worker process: make ``import consul_rdzv`` load the package of ``$BENCH_PRODUCT_DIR``
    (no-op when unset). Must run before consul_rdzv or torch's rendezvous registry is imported."""
    product = os.environ.get(ENV)
    if not product:
        return None
    loaded = sorted(m for m in sys.modules if m == "consul_rdzv" or m.startswith("consul_rdzv."))
    if loaded:
        raise RuntimeError(f"{ENV} is set but {loaded} were imported before bench.product")
    sys.meta_path[:] = [f for f in sys.meta_path if not _editable(f)]
    sys.path_hooks[:] = [h for h in sys.path_hooks if not _editable(h)]
    sys.path_importer_cache.clear()
    sys.path[:] = [product] + [p for p in sys.path if p != product]
    return product


def prepare(spec: str, results: Path) -> tuple[Path, dict]:
    """A directory holding the ``consul_rdzv`` package to measure, and what it is.

    ``spec``: a directory (used as is) or a git commit of this repository (extracted once into
    ``results/products/<commit>``).
    """
    path = Path(spec)
    if path.is_dir() and (path / "consul_rdzv" / "__init__.py").exists():
        target = path.resolve()
        commit = None
    else:
        commit = subprocess.run(["git", "rev-parse", "--short", f"{spec}^{{commit}}"], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout.strip()
        target = (results / "products" / commit).resolve()
        if not (target / "consul_rdzv" / "__init__.py").exists():
            target.mkdir(parents=True, exist_ok=True)
            archive = subprocess.run(["git", "archive", commit, "consul_rdzv"], cwd=ROOT,
                                     capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    (target / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return target, {"product_dir": str(target), "git_head": commit,
                    "consul_rdzv_dirty": False if commit else None,
                    "consul_rdzv_sha256": digest(target / "consul_rdzv")}


def digest(package: Path) -> str:
    """A digest of a package's ``*.py`` files (which code a run measured)."""
    h = hashlib.sha256()
    for path in sorted(package.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def loaded_files() -> dict[str, str | None]:
    """Where this process's consul_rdzv and torch's registered ``consul`` handler come from."""
    import consul_rdzv
    import consul_rdzv.torch

    creator = None
    try:
        from torch.distributed.elastic.rendezvous.registry import handler_registry

        fn = handler_registry._registry.get("consul")
        creator = getattr(getattr(fn, "__code__", None), "co_filename", None)
    except Exception:
        creator = None
    return {"consul_rdzv": consul_rdzv.__file__, "consul_rdzv.torch": consul_rdzv.torch.__file__,
            "registry handler": creator}
