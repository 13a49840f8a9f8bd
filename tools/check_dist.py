#!/usr/bin/env python3
"""Check what ``make dist`` built: the wheel users install and the sdist packagers build from.

    python tools/check_dist.py [DIST_DIR]        # default: dist/

The wheel must hold the package and its metadata, nothing else: every file tracked in git under
``consul_rdzv/`` (no more, no fewer), no test-only path (``tests/``, ``bench/``, ``conftest.py``,
``test_*.py``, ...), no byte code; its metadata must carry the version of
``consul_rdzv.__version__``, the SPDX license with the LICENSE file, no runtime dependency, the
``consul-rdzv`` script and the ``torchrun.handlers`` entry point ``consul``.

The sdist must hold every file tracked in git (tests, docs, compose/, bench/, tools/consul, the
Makefile: what a downstream packager needs to build, test and check the package), and no byte
code or local debris.

Prints the wheel's contents; exits 1 with one line per problem. Standard library only.
"""

from __future__ import annotations

import configparser
import email.parser
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "consul_rdzv"
DIST_NAME = "consul_rdzv"  # the normalized distribution name in file names
LICENSE_EXPRESSION = "Apache-2.0"
#: Runtime dependencies (none: the client runs on the standard library, docs/consul.md).
RUNTIME_DEPENDENCIES: set[str] = set()
ENTRY_POINTS = {
    "console_scripts": {"consul-rdzv": "consul_rdzv.cli:main"},
    "torchrun.handlers": {"consul": "consul_rdzv.torch:handler_factory"},
}
#: Directories that hold test-only code (or code that changes the host for tests): never in a
#: wheel, at any depth.
TEST_ONLY_DIRS = {"tests", "test", "testsuite", "bench", "benchmarks"}
#: File names of test-only modules.
TEST_ONLY_FILES = re.compile(r"(?:conftest|test_.*|.*_test)\.py")
#: Never in either archive.
DEBRIS_DIRS = {"__pycache__", ".git", ".venv", ".pytest_cache", ".ruff_cache"}
DEBRIS_SUFFIXES = (".pyc", ".pyo")
#: Tracked files the sdist may leave out.
SDIST_OPTIONAL = {".gitignore"}


def project_version(root: Path = ROOT) -> str:
    """``consul_rdzv.__version__``, read from the source (the version's one source)."""
    text = (root / PACKAGE / "__init__.py").read_text(encoding="utf-8")
    match = re.search(r'^__version__\s*=\s*"([^"]+)"', text, re.M)
    if not match:
        raise SystemExit(f"no __version__ = \"...\" in {root / PACKAGE / '__init__.py'}")
    return match.group(1)


def tracked_files(root: Path = ROOT) -> set[str]:
    """The files git tracks under ``root`` (what the repository is made of)."""
    proc = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True,
                          check=False)
    if proc.returncode != 0:
        raise SystemExit(f"tools/check_dist.py needs a git checkout: git ls-files failed in "
                         f"{root}: {proc.stderr.decode(errors='replace').strip()}")
    return {name for name in proc.stdout.decode().split("\0") if name}


def _debris(parts: tuple[str, ...]) -> bool:
    return bool(DEBRIS_DIRS.intersection(parts)) or parts[-1].endswith(DEBRIS_SUFFIXES)


def _entry_points(text: str) -> dict[str, dict[str, str]]:
    parser = configparser.ConfigParser(delimiters=("=",))
    parser.optionxform = str  # keep names as written
    parser.read_string(text)
    return {section: {k.strip(): v.strip() for k, v in parser[section].items()}
            for section in parser.sections()}


def wheel_problems(wheel: Path, root: Path, version: str, tracked: set[str]) -> list[str]:
    """What is wrong with ``wheel`` (empty when nothing is)."""
    problems = []
    expected_name = f"{DIST_NAME}-{version}-py3-none-any.whl"
    if wheel.name != expected_name:
        problems.append(f"wheel is named {wheel.name}, expected {expected_name}")
    dist_info = f"{DIST_NAME}-{version}.dist-info"
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if not n.endswith("/")]
        for name in names:
            parts = PurePosixPath(name).parts
            if parts[0] not in (PACKAGE, dist_info):
                problems.append(f"wheel: {name} is not part of the package (only {PACKAGE}/ "
                                f"and {dist_info}/ belong in the wheel)")
            elif TEST_ONLY_DIRS.intersection(parts[:-1]) or TEST_ONLY_FILES.fullmatch(parts[-1]):
                problems.append(f"wheel: {name} is test-only code")
            elif _debris(parts):
                problems.append(f"wheel: {name} is build or test debris")
        shipped = {n for n in names if n.startswith(f"{PACKAGE}/")}
        source = {n for n in tracked if n.startswith(f"{PACKAGE}/")}
        for name in sorted(source - shipped):
            problems.append(f"wheel: {name} (tracked in git) is missing")
        for name in sorted(shipped - source):
            if not _debris(PurePosixPath(name).parts):
                problems.append(f"wheel: {name} is not a tracked file of {PACKAGE}/")

        def read(member: str) -> str | None:
            try:
                return zf.read(f"{dist_info}/{member}").decode("utf-8")
            except KeyError:
                problems.append(f"wheel: {dist_info}/{member} is missing")
                return None

        metadata = read("METADATA")
        if metadata is not None:
            meta = email.parser.Parser().parsestr(metadata)
            if meta["Version"] != version:
                problems.append(f"wheel: METADATA Version {meta['Version']} is not "
                                f"consul_rdzv.__version__ {version}")
            if meta["License-Expression"] != LICENSE_EXPRESSION:
                problems.append(f"wheel: METADATA License-Expression is "
                                f"{meta['License-Expression']!r}, expected {LICENSE_EXPRESSION}")
            if "LICENSE" not in (meta.get_all("License-File") or []):
                problems.append("wheel: METADATA names no License-File LICENSE")
            if not meta["Requires-Python"]:
                problems.append("wheel: METADATA has no Requires-Python")
            runtime = {re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0].lower()
                       for req in meta.get_all("Requires-Dist") or [] if "extra ==" not in req}
            if runtime != RUNTIME_DEPENDENCIES:
                problems.append(f"wheel: runtime dependencies are {sorted(runtime)}, expected "
                                f"{sorted(RUNTIME_DEPENDENCIES)} only")
        license_text = read("licenses/LICENSE")
        if license_text is not None and \
                license_text != (root / "LICENSE").read_text(encoding="utf-8"):
            problems.append("wheel: licenses/LICENSE differs from the repository's LICENSE")
        entry_points = read("entry_points.txt")
        if entry_points is not None:
            found = _entry_points(entry_points)
            for group, expected in ENTRY_POINTS.items():
                for name, target in expected.items():
                    if found.get(group, {}).get(name) != target:
                        problems.append(f"wheel: entry point [{group}] {name} = {target} is "
                                        f"missing (found {found.get(group)})")
    return problems


def sdist_problems(sdist: Path, root: Path, version: str, tracked: set[str]) -> list[str]:
    """What is wrong with ``sdist`` (empty when nothing is)."""
    problems = []
    base = f"{DIST_NAME}-{version}"
    if sdist.name != f"{base}.tar.gz":
        problems.append(f"sdist is named {sdist.name}, expected {base}.tar.gz")
    with tarfile.open(sdist) as tf:
        members = [m for m in tf.getmembers() if m.isfile()]
        inside = set()
        for member in members:
            parts = PurePosixPath(member.name).parts
            if parts[0] != base:
                problems.append(f"sdist: {member.name} is outside {base}/")
                continue
            rel = "/".join(parts[1:])
            inside.add(rel)
            if _debris(parts) or rel.startswith("bench/results/"):
                problems.append(f"sdist: {member.name} is build or test debris")
        for name in sorted(tracked - inside - SDIST_OPTIONAL):
            problems.append(f"sdist: {name} (tracked in git) is missing: add it to MANIFEST.in")
        try:
            pkg_info = tf.extractfile(f"{base}/PKG-INFO")
        except KeyError:
            problems.append("sdist: PKG-INFO is missing")
        else:
            assert pkg_info is not None
            meta = email.parser.Parser().parsestr(pkg_info.read().decode("utf-8"))
            if meta["Version"] != version:
                problems.append(f"sdist: PKG-INFO Version {meta['Version']} is not "
                                f"consul_rdzv.__version__ {version}")
    return problems


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    dist = Path(args[0]) if args else ROOT / "dist"
    version = project_version()
    wheels = sorted(dist.glob(f"{DIST_NAME}-*.whl"))
    sdists = sorted(dist.glob(f"{DIST_NAME}-*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        print(f"check_dist: expected one wheel and one sdist in {dist}, found "
              f"{[p.name for p in wheels + sdists]} (make dist cleans dist/ first)",
              file=sys.stderr)
        return 1
    tracked = tracked_files()
    with zipfile.ZipFile(wheels[0]) as zf:
        infos = [i for i in zf.infolist() if not i.filename.endswith("/")]
    print(f"{wheels[0].name}: {len(infos)} files, "
          f"{sum(i.file_size for i in infos)} bytes uncompressed")
    for info in infos:
        print(f"  {info.file_size:>8}  {info.filename}")
    with tarfile.open(sdists[0]) as tf:
        count = sum(1 for m in tf.getmembers() if m.isfile())
    print(f"{sdists[0].name}: {count} files")
    problems = (wheel_problems(wheels[0], ROOT, version, tracked)
                + sdist_problems(sdists[0], ROOT, version, tracked))
    for problem in problems:
        print(f"check_dist: {problem}", file=sys.stderr)
    if problems:
        return 1
    print(f"check_dist: wheel and sdist of consul-rdzv {version} are complete and clean")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
