"""Compare two versions of consul_rdzv in one run: ``python -m bench.run --compare REV_A REV_B``.

Each side is a revision of this repository (anything ``git rev-parse`` takes: a commit, a tag,
``HEAD~3``), or ``.`` for this checkout as it is (uncommitted changes included). A revision's
``consul_rdzv`` package is extracted with ``git archive`` into a temporary directory; the same
bench code (this checkout's ``bench/`` and harness) then runs the same series against A, then B,
``--passes`` times, each side in a runner process of its own (``bench.run --product-dir DIR``),
and :func:`bench.report.render_comparison` prints A against B. The temporary directory goes at
the end; the JSON lines stay in ``bench/results/`` (``<stamp>-A.jsonl``, ``<stamp>-B.jsonl``).

How a worker process loads the product, not this checkout (:func:`activate`): the package is
installed editable from this checkout, and setuptools' editable finder (a ``sys.meta_path``
entry) maps ``consul_rdzv.<module>`` to this checkout for any module the product lacks, while
``python -m`` and the forkserver put the working directory (this checkout) first on
``sys.path``. So the worker drops the editable finder and puts the product directory first,
before anything imports torch (whose rendezvous registry imports ``consul_rdzv.torch`` through
the ``torchrun.handlers`` entry point). Every worker reports the files it loaded
(:func:`loaded_files`) and the runner refuses a run in which one is not the product's.

Only the standard library is imported at the top: a worker imports this module first.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: The environment variable that names the product directory of a worker process.
ENV = "BENCH_PRODUCT_DIR"
ROOT = Path(__file__).resolve().parent.parent
#: What :func:`prepare` writes beside the extracted package: the revision it came from.
INFO = "PRODUCT.json"


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
        raise RuntimeError(f"{ENV} is set but {loaded} were imported before bench.compare")
    sys.meta_path[:] = [f for f in sys.meta_path if not _editable(f)]
    sys.path_hooks[:] = [h for h in sys.path_hooks if not _editable(h)]
    sys.path_importer_cache.clear()
    sys.path[:] = [product] + [p for p in sys.path if p != product]
    return product


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


def digest(package: Path) -> str:
    """A digest of a package's ``*.py`` files (which code a run measured)."""
    h = hashlib.sha256()
    for path in sorted(package.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def _git(*args: str, binary: bool = False):
    proc = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=not binary,
                          timeout=120)
    if proc.returncode != 0:
        err = proc.stderr if not binary else proc.stderr.decode(errors="replace")
        raise ValueError(f"git {' '.join(args)} failed: {err.strip()}")
    return proc.stdout


def prepare(rev: str, workdir: Path) -> Path | None:
    """The directory holding ``rev``'s ``consul_rdzv`` package, extracted into ``workdir``; None
    for ``.`` (this checkout, measured as it is). Raises ``ValueError`` naming a bad revision
    or a revision without the package."""
    if rev == ".":
        return None
    commit = _git("rev-parse", "--verify", "--short", f"{rev}^{{commit}}").strip()
    target = workdir / commit
    if not (target / "consul_rdzv" / "__init__.py").exists():
        target.mkdir(parents=True, exist_ok=True)
        try:
            archive = _git("archive", commit, "consul_rdzv", binary=True)
        except ValueError as exc:
            raise ValueError(f"revision {rev} ({commit}) has no consul_rdzv package: {exc}"
                             ) from None
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True, timeout=120)
    (target / INFO).write_text(json.dumps({"rev": rev, "commit": commit}))
    # Inherited by any Python process started with PYTHONPATH=target: no editable fallback.
    (target / "sitecustomize.py").write_text(
        "import sys\n\n"
        "def _editable(obj):\n"
        "    names = (getattr(obj, '__module__', None) or '', type(obj).__module__ or '',\n"
        "             getattr(obj, '__qualname__', None) or '')\n"
        "    return any('__editable__' in name for name in names)\n\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if not _editable(f)]\n"
        "sys.path_hooks[:] = [h for h in sys.path_hooks if not _editable(h)]\n"
        "sys.path_importer_cache.clear()\n")
    return target


def describe(product_dir: Path) -> dict:
    """The ``product`` entry of a run's meta line for a prepared directory."""
    info = json.loads((product_dir / INFO).read_text()) if (product_dir / INFO).exists() else {}
    return {"product_dir": str(product_dir), "rev": info.get("rev"),
            "git_head": info.get("commit"), "consul_rdzv_dirty": False,
            "consul_rdzv_sha256": digest(product_dir / "consul_rdzv")}


def use_product(product_dir: Path) -> None:
    """In the runner, before its forkserver starts: every worker inherits these."""
    os.environ[ENV] = str(product_dir)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(product_dir), *filter(None, [os.environ.get("PYTHONPATH")])])


def _without(argv: list[str], option: str, values: int) -> list[str]:
    """``argv`` without ``option`` and the ``values`` arguments that follow it."""
    out, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
        elif arg == option:
            skip = values
        elif not arg.startswith(option + "="):
            out.append(arg)
    return out


def run(argv: list[str], revs: list[str], passes: int, results: Path) -> int:
    """``bench.run --compare A B``: both sides, ``passes`` times in turn, then the comparison."""
    from bench import report

    child_argv = _without(_without(_without(argv, "--compare", 2), "--passes", 1), "--out", 1)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    workdir = Path(tempfile.mkdtemp(prefix="bench-compare-"))
    outputs: dict[str, list[Path]] = {"A": [], "B": []}
    try:
        dirs = {}
        for side, rev in zip("AB", revs, strict=True):
            try:
                dirs[side] = prepare(rev, workdir)
            except ValueError as exc:
                print(f"[bench] --compare: {exc}", file=sys.stderr)
                return 2
        for n in range(passes):
            for side, rev in zip("AB", revs, strict=True):
                out = results / f"{stamp}-{side}{n + 1 if passes > 1 else ''}.jsonl"
                cmd = [sys.executable, "-m", "bench.run", *child_argv, "--out", str(out)]
                if dirs[side] is not None:
                    cmd += ["--product-dir", str(dirs[side])]
                print(f"[bench] side {side} ({rev}), pass {n + 1} of {passes}: "
                      f"{' '.join(cmd[1:])}", flush=True)
                code = subprocess.run(cmd, cwd=ROOT).returncode
                if code != 0:
                    print(f"[bench] side {side} exited with {code}", file=sys.stderr)
                    return code
                outputs[side].append(out)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    text = report.render_comparison(outputs["A"], outputs["B"])
    md = results / f"{stamp}-compare.md"
    md.write_text(text + "\n")
    print(text)
    print(f"[bench] comparison: {md}", flush=True)
    return 0
