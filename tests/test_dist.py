"""tools/check_dist.py, the check of ``make dist``: it passes a complete, clean wheel and sdist and
fails each kind of defect (test-only code or debris in the wheel, a package file or a test
missing, the wrong version, license or dependencies). Pure logic on archives built here; the
real artifacts are checked by ``make dist`` itself."""

from __future__ import annotations

import io
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))  # tools/ is no package

import check_dist

VERSION = "1.2.3"
DIST_INFO = f"consul_rdzv-{VERSION}.dist-info"
LICENSE = "Apache License\nVersion 2.0, January 2004\n"
PACKAGE_FILES = ["consul_rdzv/__init__.py", "consul_rdzv/py.typed", "consul_rdzv/torch.py",
                 "consul_rdzv/examples/__init__.py", "consul_rdzv/examples/train.py"]
TRACKED = {*PACKAGE_FILES, "LICENSE", "README.md", "pyproject.toml", "MANIFEST.in",
           ".gitignore", "tests/conftest.py", "tests/test_cli.py", "docs/cli.md",
           "bench/run.py", "tools/consul/go.mod"}
METADATA = f"""Metadata-Version: 2.4
Name: consul-rdzv
Version: {VERSION}
License-Expression: Apache-2.0
Requires-Python: >=3.10
License-File: LICENSE
Provides-Extra: torch
Requires-Dist: torch>=2.8; extra == "torch"

A description.
"""
ENTRY_POINTS = """[console_scripts]
consul-rdzv = consul_rdzv.cli:main

[torchrun.handlers]
consul = consul_rdzv.torch:handler_factory
"""


@pytest.fixture
def root(tmp_path):
    (tmp_path / "LICENSE").write_text(LICENSE)
    return tmp_path


def wheel_members(**changes) -> dict[str, str]:
    """A good wheel's members; ``changes`` maps a member to new text (None: remove it)."""
    members = {name: "" for name in PACKAGE_FILES}
    members.update({f"{DIST_INFO}/METADATA": METADATA, f"{DIST_INFO}/WHEEL": "",
                    f"{DIST_INFO}/entry_points.txt": ENTRY_POINTS,
                    f"{DIST_INFO}/licenses/LICENSE": LICENSE, f"{DIST_INFO}/RECORD": ""})
    for name, text in changes.items():
        if text is None:
            members.pop(name)
        else:
            members[name] = text
    return members


def make_wheel(directory: Path, members: dict[str, str], version: str = VERSION) -> Path:
    path = directory / f"consul_rdzv-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in members.items():
            zf.writestr(name, text)
    return path


def make_sdist(directory: Path, files: set[str], version: str = VERSION) -> Path:
    path = directory / f"consul_rdzv-{version}.tar.gz"
    base = f"consul_rdzv-{version}"
    with tarfile.open(path, "w:gz") as tf:
        for name, text in {**{f: "" for f in files},
                           "PKG-INFO": f"Metadata-Version: 2.4\nVersion: {version}\n"}.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{base}/{name}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def wheel_problems(root, **changes) -> list[str]:
    return check_dist.wheel_problems(make_wheel(root, wheel_members(**changes)), root, VERSION,
                                     TRACKED)


def test_a_complete_clean_wheel_and_sdist_pass(root):
    assert wheel_problems(root) == []
    sdist = make_sdist(root, TRACKED - {".gitignore"})
    assert check_dist.sdist_problems(sdist, root, VERSION, TRACKED) == []


@pytest.mark.parametrize("member", ["tests/test_cli.py", "bench/run.py", "consul_rdzv/tests/x.py",
                                    "consul_rdzv/conftest.py", "consul_rdzv/test_helpers.py",
                                    "examples/train.py", "tools/check_dist.py"])
def test_test_only_code_in_the_wheel_fails(root, member):
    problems = wheel_problems(root, **{member: "x = 1\n"})
    assert any(member in p for p in problems), problems


def test_byte_code_in_the_wheel_fails(root):
    problems = wheel_problems(root, **{"consul_rdzv/__pycache__/cli.cpython-311.pyc": "\0"})
    assert any("debris" in p for p in problems), problems


def test_a_tracked_package_file_missing_from_the_wheel_fails(root):
    problems = wheel_problems(root, **{"consul_rdzv/examples/train.py": None})
    assert problems == ["wheel: consul_rdzv/examples/train.py (tracked in git) is missing"]


def test_an_untracked_file_in_the_package_fails(root):
    problems = wheel_problems(root, **{"consul_rdzv/scratch.py": ""})
    assert problems == ["wheel: consul_rdzv/scratch.py is not a tracked file of consul_rdzv/"]


def test_wrong_metadata_fails(root):
    bad = (METADATA.replace(f"Version: {VERSION}", "Version: 9.9.9")
           .replace("License-Expression: Apache-2.0", "License-Expression: MIT")
           .replace("Provides-Extra: torch", "Requires-Dist: requests\nProvides-Extra: torch"))
    problems = wheel_problems(root, **{f"{DIST_INFO}/METADATA": bad})
    assert len(problems) == 3, problems
    assert "9.9.9" in problems[0] and "MIT" in problems[1] and "requests" in problems[2]


def test_a_missing_entry_point_or_license_fails(root):
    problems = wheel_problems(root, **{
        f"{DIST_INFO}/entry_points.txt": ENTRY_POINTS.split("[torchrun.handlers]")[0],
        f"{DIST_INFO}/licenses/LICENSE": "MIT License\n"})
    assert len(problems) == 2, problems
    assert "licenses/LICENSE differs" in problems[0]
    assert "[torchrun.handlers] consul" in problems[1]


def test_a_wheel_of_another_version_fails(root):
    wheel = make_wheel(root, wheel_members(), version="0.0.1")
    problems = check_dist.wheel_problems(wheel, root, VERSION, TRACKED)
    assert any("expected consul_rdzv-1.2.3-py3-none-any.whl" in p for p in problems), problems


def test_an_sdist_without_a_test_or_doc_fails(root):
    sdist = make_sdist(root, TRACKED - {".gitignore", "tests/conftest.py", "docs/cli.md"})
    assert check_dist.sdist_problems(sdist, root, VERSION, TRACKED) == [
        "sdist: docs/cli.md (tracked in git) is missing: add it to MANIFEST.in",
        "sdist: tests/conftest.py (tracked in git) is missing: add it to MANIFEST.in"]


def test_debris_in_the_sdist_fails(root):
    sdist = make_sdist(root, TRACKED | {"tests/__pycache__/conftest.cpython-311.pyc",
                                        "bench/results/run.json"})
    problems = check_dist.sdist_problems(sdist, root, VERSION, TRACKED)
    assert len(problems) == 2 and all("debris" in p for p in problems), problems


def test_the_version_has_one_source(root):
    """check_dist reads the version where setuptools does: consul_rdzv.__version__."""
    (root / "consul_rdzv").mkdir()
    (root / "consul_rdzv" / "__init__.py").write_text('"""Doc."""\n\n__version__ = "4.5.6"\n')
    assert check_dist.project_version(root) == "4.5.6"
