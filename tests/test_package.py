"""The package surface: exactly the public names, no torch on import, one version everywhere,
and a main test run that cannot lose its torch tests to a missing torch."""

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import consul_rdzv
from consul_rdzv import cli

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "consul_rdzv"


def test_all_lists_exactly_the_public_names():
    public = {n for n in vars(consul_rdzv) if not n.startswith("_")} | {"__version__"}
    modules = {"agents", "client", "cli", "config", "errors", "examples", "health", "heartbeat",
               "history", "join", "keeper", "layout", "liveness", "metrics", "planning",
               "quarantine", "ranks", "registration", "rendezvous", "runs", "service",
               "settings", "shared_query", "standing", "testing", "torch", "transport", "watch",
               "worker"}
    assert set(consul_rdzv.__all__) == public - modules
    assert sorted(consul_rdzv.__all__) == consul_rdzv.__all__


def test_import_does_not_import_torch():
    code = ("import sys, consul_rdzv, consul_rdzv.cli, consul_rdzv.testing, "
            "consul_rdzv.examples; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def imported_modules(path: Path, source: str | None = None) -> set[str]:
    """Every module a file imports, at any level (relative imports resolved in consul_rdzv)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    tree = ast.parse(source if source is not None else path.read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(filter(None, [base, node.module or ""]))
            names.add(module)
            names.update(f"{module}.{a.name}" for a in node.names)
    return names


def test_only_the_adapter_and_the_example_script_import_torch():
    """torch is imported by consul_rdzv/torch.py, and by the example training script that
    torchrun runs; no other module of the package imports it, at any level."""
    importers = {path.relative_to(ROOT).as_posix() for path in PACKAGE.rglob("*.py")
                 if any(n == "torch" or n.startswith("torch.") for n in imported_modules(path))}
    assert importers == {"consul_rdzv/torch.py", "consul_rdzv/examples/train.py"}


def test_the_example_script_is_not_imported_by_the_package():
    train = "consul_rdzv.examples.train"
    # the check sees every way a module of the package could import it
    for control in ("from .examples import train", "from .examples.train import main",
                    "import consul_rdzv.examples.train",
                    "def f():\n    from .examples import train\n"):
        assert train in imported_modules(PACKAGE / "runs.py", control), control
    for path in PACKAGE.rglob("*.py"):
        assert train not in imported_modules(path), path


def test_version_has_one_source_and_the_cli_prints_the_installed_metadata():
    """pyproject.toml writes no version: setuptools reads consul_rdzv.__version__, and
    ``consul-rdzv --version`` prints it; the installed metadata agrees (reinstall after a
    version change: the Makefile does, its venv depends on consul_rdzv/__init__.py)."""
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    project = pyproject.split("\n[project]\n", 1)[1].split("\n[", 1)[0]
    assert not re.search(r"(?m)^version\s*=", project), "a hand-written version"
    assert re.search(r'(?m)^dynamic = \["version"\]$', project)
    assert re.search(r'(?m)^version = \{ attr = "consul_rdzv.__version__" \}$', pyproject)
    installed = importlib.metadata.version("consul-rdzv")
    assert installed == consul_rdzv.__version__
    proc = subprocess.run([sys.executable, "-m", "consul_rdzv.cli", "--version"],
                          capture_output=True, text=True, timeout=60, check=True)
    assert proc.stdout.strip() == f"{cli.PROG} {installed}"


def test_demo_script_is_found_as_package_data():
    with cli.demo_script() as script:
        assert script.is_file() and script.parent.name == "examples"
        assert "def main()" in script.read_text(encoding="utf-8")


def test_a_missing_torch_is_an_error_when_torch_is_required(tmp_path):
    """With CONSUL_RDZV_REQUIRE_TORCH=1 (``make test`` sets it) a torch that cannot be imported
    stops the run with one error, before any test runs; without it, torch-free tests run."""
    blocked = tmp_path / "torch"
    blocked.mkdir()
    (blocked / "__init__.py").write_text("raise ImportError('torch blocked by the test')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           f"{__file__}::test_all_lists_exactly_the_public_names"]
    required = subprocess.run(cmd, env={**env, "CONSUL_RDZV_REQUIRE_TORCH": "1"}, cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
    assert required.returncode != 0, required.stdout + required.stderr
    assert "torch blocked by the test" in required.stdout + required.stderr
    assert "passed" not in required.stdout
    optional = subprocess.run(cmd, env={**env, "CONSUL_RDZV_REQUIRE_TORCH": "0"}, cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
    assert optional.returncode == 0, optional.stdout + optional.stderr
    assert "1 passed" in optional.stdout


# ----------------------------------------------------------------------------- compatibility.md

COMPATIBILITY = ROOT / "docs" / "compatibility.md"


def doc_table_row(first_cell: str) -> list[str]:
    """The cells of the docs/compatibility.md table row whose first cell starts so."""
    for line in COMPATIBILITY.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0].startswith(first_cell):
            return cells
    raise AssertionError(f"docs/compatibility.md has no table row {first_cell!r}")


def backticked(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


def test_compatibility_python_versions_match_the_classifiers_and_the_makefile():
    supported = re.findall(r"3\.\d+", doc_table_row("Python (CPython)")[1])
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    classifiers = re.findall(r'"Programming Language :: Python :: (3\.\d+)"', pyproject)
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    others = re.search(r"(?m)^OTHER_PYTHONS \?= (.+)$", makefile).group(1).split()
    main = "3.11"  # the whole suite, torch included (PYTHON, the torch wheel's Python)
    assert supported == classifiers == sorted({main, *others}, key=lambda v: int(v[2:]))
    assert f'requires-python = ">={supported[0]}"' in pyproject


def test_compatibility_torch_floor_is_the_one_pyproject_and_the_image_require():
    floor = re.search(r">= (\d+\.\d+)", doc_table_row("torch (the `torch` extra)")[1]).group(1)
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert set(re.findall(r'"torch(>=[\d.]+)"', pyproject)) == {f">={floor}"}  # torch and test
    dockerfile = (ROOT / "compose" / "Dockerfile").read_text(encoding="utf-8")
    assert f'ARG TORCH_SPEC="torch>={floor}"' in dockerfile


def test_compatibility_lists_every_rdzv_conf_key_as_stable():
    from consul_rdzv.settings import VALID_KEYS

    rows = ("c10d's keys, same meaning", "consul-rdzv's keys", "reaching Consul",
            "c10d's other keys (mapped, or accepted and ignored: docs/configuration.md)")
    listed = [key for row in rows for key in backticked(doc_table_row(row)[1])]
    assert sorted(listed) == sorted(set(listed)) == list(VALID_KEYS)


def test_compatibility_names_every_cli_command_and_global_option():
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    stable = backticked(doc_table_row(
        "`list`, `status`, `watch`, `history`, `close`, `drain`, `gc`, `quarantine`, "
        "`exporter`")[0])
    unstable = backticked(doc_table_row("`agent`, `demo`")[0])
    assert sorted(stable + unstable) == sorted(commands)
    options = [o for o in backticked(doc_table_row("the global options")[0])
               if o.startswith("--")]
    expected = ["--" + name.replace("_", "-") for name in cli.GLOBAL_DEFAULTS]
    assert sorted(options) == sorted([*expected, "--version"])
