"""compose/: the Docker Compose demo (one Consul server, three torchrun workers), checked without
Docker.

No Docker engine runs on the project's machines, so the file is validated here, never run:

* against the Compose specification's JSON schema, the copy that check-jsonschema ships
  (``check-jsonschema --builtin-schema vendor.compose-spec``, a ``test`` extra), with a broken
  copy of the file as the negative control;
* with ``docker compose config`` (or ``docker-compose config``) where that command exists;
* by what the demo relies on: an open-source Consul image (1.14-1.16, never the BUSL 1.17+) with
  a healthcheck and the UI published, three workers that wait for a healthy Consul and whose
  torchrun command lines torch's own parser and our settings accept, and a Dockerfile whose COPY
  sources exist in the repository and are not left out of the build context.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath

import pytest
import tomllib  # Python 3.11+: this file needs torch, which the tests have on 3.11 only
import yaml

from consul_rdzv.settings import settings_from_conf

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_DIR = ROOT / "compose"
COMPOSE_FILE = COMPOSE_DIR / "compose.yaml"
#: The variables compose.yaml reads; the tests check the file with their defaults.
COMPOSE_VARIABLES = ("RDZV_ID", "NNODES", "STEPS", "STEP_TIME")
#: Consul 1.17 and later are under the Business Source License: this project never uses them.
CONSUL_VERSIONS = ((1, 14), (1, 15), (1, 16))
CONSUL_HTTP_PORT = 8500
#: A duration as Compose reads it (Go's time.ParseDuration), e.g. ``2s`` or ``1m30s``.
GO_DURATION = re.compile(r"(?:\d+(?:\.\d+)?(?:ns|us|ms|s|m|h))+")


# ----------------------------------------------------------------------------- helpers

def load_compose() -> dict:
    with COMPOSE_FILE.open(encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def interpolate(value: str) -> str:
    """Compose's ``${VAR:-default}`` / ``${VAR-default}`` with every variable unset.

    A bare ``$VAR`` or ``${VAR}`` fails the test: every variable of the file needs a default.
    """
    def default(match: re.Match) -> str:
        assert match.group(1) in COMPOSE_VARIABLES, f"undocumented variable in {value!r}"
        return match.group(2)

    resolved = re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*):?-([^}]*)\}", default, value)
    assert "$" not in resolved, f"variable without a default in {value!r}"
    return resolved


def workers(compose: dict, *, all_profiles: bool = False) -> dict[str, dict]:
    """The services built from our Dockerfile (those started by default, unless all_profiles)."""
    return {name: svc for name, svc in compose["services"].items()
            if "build" in svc and (all_profiles or not svc.get("profiles"))}


def published_ports(service: dict) -> list[tuple[str, int, int]]:
    """(host_ip, published, target) of a service's ports, short or long syntax."""
    out = []
    for port in service.get("ports", []):
        if isinstance(port, dict):
            out.append((port.get("host_ip", ""), int(port["published"]), int(port["target"])))
            continue
        parts = str(port).split("/")[0].split(":")
        host_ip = parts[0] if len(parts) == 3 else ""
        published = parts[-2] if len(parts) >= 2 else ""
        out.append((host_ip, int(published) if published else 0, int(parts[-1])))
    return out


def torchrun_args(command: list[str]):
    """The worker's command line as torchrun's own argument parser reads it."""
    from torch.distributed.run import get_args_parser

    argv = [interpolate(str(arg)) for arg in command]
    assert argv[0] == "torchrun", argv
    return get_args_parser().parse_args(argv[1:])


def rdzv_conf(raw: str) -> dict[str, str]:
    """``--rdzv-conf k=v,k=v`` as torchrun splits it."""
    conf = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        key, sep, value = item.partition("=")
        assert sep, f"--rdzv-conf item {item!r} is not key=value"
        conf[key.strip()] = value.strip()
    return conf


def nnodes_range(nnodes: str) -> tuple[int, int]:
    low, _, high = nnodes.partition(":")
    return int(low), int(high or low)


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    instructions, pending = [], ""
    for line in path.read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        keyword, _, args = (pending + stripped).partition(" ")
        instructions.append((keyword.upper(), args.strip()))
        pending = ""
    return instructions


def copy_sources_and_dest(args: str) -> tuple[list[str], str]:
    words = [w for w in args.split() if not w.startswith("--")]  # --chown=..., --link
    assert len(words) >= 2 and not args.lstrip().startswith("["), f"COPY {args}"
    return words[:-1], words[-1]


def ignore_patterns(path: Path) -> list[str]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def ignored(rel_path: str, patterns: list[str]) -> bool:
    """Whether a .dockerignore excludes a context path: the last pattern matching the path or
    one of its parent directories decides; ``!`` re-includes."""
    parts = PurePosixPath(rel_path).parts
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    result = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern.lstrip("!").strip("/")
        if any(fnmatch.fnmatchcase(c, pat) for c in candidates):
            result = not negate
    return result


def compose_cli() -> list[str] | None:
    """``docker compose`` when the plugin is installed, else ``docker-compose``, else None."""
    docker = shutil.which("docker")
    if docker:
        probe = subprocess.run([docker, "compose", "version"], capture_output=True, timeout=60)
        if probe.returncode == 0:
            return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


def check_jsonschema(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
         str(path)],
        capture_output=True, text=True, timeout=120)


needs_check_jsonschema = pytest.mark.skipif(
    importlib.util.find_spec("check_jsonschema") is None,
    reason="check-jsonschema (which ships the Compose spec schema) is not installed: "
           "pip install -e '.[test]'")


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_compose()


# ----------------------------------------------------------------------------- the Compose spec

@needs_check_jsonschema
def test_compose_file_matches_the_compose_spec_schema():
    result = check_jsonschema(COMPOSE_FILE)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_check_jsonschema
def test_the_schema_check_rejects_a_broken_file(tmp_path):
    """Negative control: the same file with an invalid depends_on condition fails the check."""
    text = COMPOSE_FILE.read_text(encoding="utf-8")
    assert text.count("condition: service_healthy") == 1
    broken = tmp_path / "compose.yaml"
    broken.write_text(text.replace("condition: service_healthy", "condition: service_up"),
                      encoding="utf-8")
    result = check_jsonschema(broken)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "depends_on" in result.stdout, result.stdout


def test_docker_compose_config_accepts_the_file():
    cli = compose_cli()
    if cli is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed here; the file "
                    "is checked against the Compose spec schema instead")
    env = {k: v for k, v in os.environ.items() if k not in COMPOSE_VARIABLES}
    result = subprocess.run([*cli, "-f", str(COMPOSE_FILE), "config", "--quiet"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


# ----------------------------------------------------------------------------- Consul

def test_consul_image_is_an_open_source_release(compose):
    image = compose["services"]["consul"]["image"]
    match = re.fullmatch(r"hashicorp/consul:(\d+)\.(\d+)(?:\.\d+)?", image)
    assert match, f"{image!r} is not an official hashicorp/consul image with a version tag"
    assert (int(match.group(1)), int(match.group(2))) in CONSUL_VERSIONS, image


def test_consul_serves_its_api_to_the_workers_and_the_ui_on_the_host(compose):
    consul = compose["services"]["consul"]
    command = consul["command"]
    assert command[:2] == ["agent", "-dev"], command
    assert command[command.index("-client") + 1] == "0.0.0.0", command
    assert ("127.0.0.1", CONSUL_HTTP_PORT, CONSUL_HTTP_PORT) in published_ports(consul), \
        consul.get("ports")


def test_consul_has_a_healthcheck_that_needs_a_leader(compose):
    check = compose["services"]["consul"]["healthcheck"]
    assert check["test"][0] in ("CMD", "CMD-SHELL"), check
    assert check["test"][1:5] == ["consul", "kv", "get", "-recurse"], check
    assert not check.get("disable"), check
    for key in ("interval", "timeout", "start_period"):  # Go durations; the schema says string
        assert GO_DURATION.fullmatch(str(check[key])), (key, check[key])


# ----------------------------------------------------------------------------- the workers

def test_three_workers_wait_for_a_healthy_consul(compose):
    assert len(workers(compose)) == 3, sorted(workers(compose))
    for name, svc in workers(compose, all_profiles=True).items():
        assert svc["depends_on"]["consul"]["condition"] == "service_healthy", name


def test_worker_commands_rendezvous_through_the_consul_service(compose):
    services = compose["services"]
    run_ids, node_ids = set(), set()
    for name, svc in workers(compose, all_profiles=True).items():
        args = torchrun_args(svc["command"])
        assert args.rdzv_backend == "consul", name
        host, _, port = args.rdzv_endpoint.rpartition(":")
        assert host == "consul" and host in services, (name, args.rdzv_endpoint)
        assert int(port) == CONSUL_HTTP_PORT, (name, args.rdzv_endpoint)
        assert args.nproc_per_node == "1", name
        # the trainer store of rank 0 must be reachable from the other containers
        assert args.local_addr == name, (name, args.local_addr)
        low, high = nnodes_range(args.nnodes)
        if not svc.get("profiles"):
            assert (low, high) == (3, 3), (name, args.nnodes)
        conf = rdzv_conf(args.rdzv_conf)
        settings_from_conf(args.rdzv_id, low, high, conf)  # raises on an unknown key or value
        node_ids.add(conf.get("node_id", name))
        run_ids.add(args.rdzv_id)
        assert args.max_restarts >= 1, name  # a killed peer restarts the survivors' workers
    assert len(run_ids) == 1, run_ids
    assert len(node_ids) == len(workers(compose, all_profiles=True)), node_ids


#: The training script the workers run: the example that ships in the package, as a module.
TRAINING_MODULE = "consul_rdzv.examples.train"


def test_worker_training_arguments_exist_in_the_example(compose):
    for name, svc in workers(compose, all_profiles=True).items():
        args = torchrun_args(svc["command"])
        assert args.module and args.training_script == TRAINING_MODULE, name
        source = (ROOT / (TRAINING_MODULE.replace(".", "/") + ".py")).read_text(encoding="utf-8")
        script_args = args.training_script_args
        for flag in (a for a in script_args if a.startswith("--")):
            assert f'add_argument("{flag}"' in source, (name, flag)
        # --out names a directory that exists: a volume, named and declared in the file
        out = script_args[script_args.index("--out") + 1]
        mounts = dict(str(v).split(":")[1::-1] for v in svc.get("volumes", []))
        assert out in mounts, (name, out, mounts)
        assert mounts[out] in (compose.get("volumes") or {}), (name, mounts[out])


# ----------------------------------------------------------------------------- the image

def test_workers_build_from_the_repository_with_our_dockerfile(compose):
    for name, svc in workers(compose, all_profiles=True).items():
        context = (COMPOSE_FILE.parent / svc["build"]["context"]).resolve()
        assert context == ROOT, (name, context)
        assert (context / svc["build"]["dockerfile"]).resolve() == COMPOSE_DIR / "Dockerfile"


def test_dockerfile_copies_existing_sources_into_the_working_directory():
    """Every COPY source exists, is sent with the context, and lands where ``pip install .``
    expects it: the package (with its example script, which the workers run as a module of the
    installed package) and every file pyproject.toml names (readme, license files)."""
    instructions = dockerfile_instructions(COMPOSE_DIR / "Dockerfile")
    patterns = ignore_patterns(COMPOSE_DIR / "Dockerfile.dockerignore")
    workdir, landed = PurePosixPath("/"), {}
    for keyword, args in instructions:
        if keyword == "WORKDIR":
            workdir = workdir / args
        elif keyword in ("COPY", "ADD"):
            assert keyword == "COPY", "use COPY for local files"
            sources, dest = copy_sources_and_dest(args)
            target = workdir / dest
            for src in sources:
                path = ROOT / src
                assert path.exists(), f"COPY source {src} does not exist in the repository"
                files = [path] if path.is_file() else [
                    p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
                for file in files:
                    rel = file.relative_to(ROOT).as_posix()
                    assert not ignored(rel, patterns), f"{rel} is left out of the build context"
                    inside = file.name if path.is_file() else file.relative_to(path).as_posix()
                    landed[rel] = target / inside
    for keyword, args in instructions:
        if keyword == "RUN" and "pip install ." in args:
            break
    else:
        pytest.fail("the Dockerfile never installs the package (pip install .)")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    for needed in ("pyproject.toml", project["readme"], *project["license-files"],
                   "consul_rdzv/__init__.py", "consul_rdzv/torch.py",
                   "consul_rdzv/examples/__init__.py", TRAINING_MODULE.replace(".", "/") + ".py"):
        assert needed in landed, f"{needed} is not copied into the image"
        assert landed[needed] == workdir / needed, (needed, landed[needed])  # `pip install .`


def test_build_context_leaves_out_the_rest_of_the_tree():
    patterns = ignore_patterns(COMPOSE_DIR / "Dockerfile.dockerignore")
    for path in (".venv/bin/python", ".git/HEAD", "tests/test_compose.py", "bench",
                 "consul_rdzv/__pycache__/client.cpython-311.pyc"):
        assert ignored(path, patterns), path


def test_dockerfile_installs_cpu_torch_and_a_supported_python():
    instructions = dockerfile_instructions(COMPOSE_DIR / "Dockerfile")
    base = next(args for keyword, args in instructions if keyword == "FROM")
    match = re.fullmatch(r"python:3\.(\d+)(?:\.\d+)?-slim(?:-\w+)?", base)
    assert match, base
    required = re.search(r'requires-python\s*=\s*">=3\.(\d+)"',
                         (ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert required and int(match.group(1)) >= int(required.group(1)), base
    runs = " ".join(args for keyword, args in instructions if keyword == "RUN")
    assert "--index-url https://download.pytorch.org/whl/cpu" in runs, runs
