"""The commands of README.md, docs/multi-host.md and docs/kubernetes.md, as a reader pastes them.

* Every fenced code block names its language, and no line of one ends in a doubled backslash
  (a Markdown escape that, pasted into a shell, is a literal backslash and no continuation).
* Every shell block (``bash``, ``sh``, ``shell``) parses (``bash -n``), holds no ``<placeholder>``
  (bash reads it as a redirection), continues no line into a blank one, and gives every
  torchrun command ``--max-restarts``.
* Where a block runs on this machine, it is run, as pasted, in ``bash``, against a real Consul
  dev agent: the quick start's command on two "nodes" at once, each of the two-host example's
  blocks in its own process, and ``make demo``. What is replaced, and only that: the Consul
  agent's address ``127.0.0.1:8500`` by the test agent's, the hosts' addresses by 127.0.0.1
  (loopback only here), ``--nproc-per-node=8`` by 1 (CPU), the job id by a fresh one, and
  ``train.py`` by ``consul_rdzv/examples/train.py`` with a few steps. The quick start names no
  ``--local-addr`` and a range of nodes: its two processes get ``PET_LOCAL_ADDR=127.0.0.1`` and
  ``PET_RDZV_CONF=last_call_timeout=1`` (torchrun's own environment defaults, see
  docs/kubernetes.md), so that they stay on loopback and do not wait 30 s for a third node.
  docs/kubernetes.md's blocks need a cluster (kubectl, helm, docker): they are parsed only.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["README.md", "docs/multi-host.md", "docs/kubernetes.md"]
SHELL = {"bash", "sh", "shell"}
FENCE = re.compile(r"^```([\w+-]*)[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
#: ``<this repository>``, ``<servers>``: a placeholder bash would read as a redirection.
PLACEHOLDER = re.compile(r"<[A-Za-z][^<>\n]*>")
TRAIN = ROOT / "consul_rdzv" / "examples" / "train.py"
RUN_TIMEOUT = 240


def blocks(doc: str) -> list[tuple[str, str, int]]:
    """(language, text, line number) of every fenced code block of ``doc``."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    return [(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1)
            for m in FENCE.finditer(text)]


def shell_blocks(doc: str) -> list[tuple[str, int]]:
    return [(body, line) for lang, body, line in blocks(doc) if lang in SHELL]


def commands(body: str) -> list[str]:
    """The block's commands, continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n", " ", body)
    return [line.strip() for line in joined.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def the_block(doc: str, needle: str) -> str:
    found = [body for body, _ in shell_blocks(doc) if needle in body]
    assert len(found) == 1, f"{doc}: {len(found)} shell blocks contain {needle!r}"
    return found[0]


# ----------------------------------------------------------------------------- every block

@pytest.mark.parametrize("doc", DOCS)
def test_every_code_block_names_its_language(doc):
    assert blocks(doc), f"{doc} has no code block"
    for lang, _, line in blocks(doc):
        assert lang, f"{doc}:{line}: a code block without a language"


def problems(body: str, tmp_path: Path) -> list[str]:
    """What is wrong with a shell block pasted into a terminal; empty when nothing is."""
    found = []
    script = tmp_path / f"block-{uuid.uuid4().hex[:6]}.sh"
    script.write_text(body, encoding="utf-8")
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True,
                            timeout=30)
    if result.returncode != 0:
        found.append(f"bash -n: {result.stderr.strip()}")
    lines = body.splitlines()
    for i, text in enumerate(lines):
        if text.rstrip().endswith("\\\\"):
            found.append(f"line {i + 1} ends in a doubled backslash: {text!r}")
        elif text.endswith("\\"):
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            if not nxt.strip() or nxt.strip().startswith("#"):
                found.append(f"line {i + 1} continues into {nxt!r}")
        code = text.split("#", 1)[0]
        if PLACEHOLDER.search(code):
            found.append(f"line {i + 1} has a <placeholder>: {text!r}")
    return found


@pytest.mark.parametrize("doc", DOCS)
def test_no_code_line_ends_with_a_doubled_backslash(doc):
    for _, body, line in blocks(doc):
        for offset, text in enumerate(body.splitlines(), start=1):
            assert not text.rstrip().endswith("\\\\"), f"{doc}:{line + offset}: {text!r}"


@pytest.mark.parametrize("doc", DOCS)
def test_every_shell_block_parses(doc, tmp_path):
    assert shell_blocks(doc), f"{doc} has no shell block"
    for body, line in shell_blocks(doc):
        assert problems(body, tmp_path) == [], f"{doc}:{line}:\n{body}"


def test_the_block_check_rejects_what_a_terminal_would(tmp_path):
    """Negative controls: two hosts side by side with Markdown-escaped continuations (bash -n
    accepts it: only the backslash check sees it), a placeholder, an unclosed quote."""
    side_by_side = (
        "# on gpu-a                              # on gpu-b\n"
        "torchrun --nnodes=2 \\\\                  torchrun --nnodes=2 \\\\\n"
        "  train.py                                train.py\n")
    assert any("doubled backslash" in p for p in problems(side_by_side, tmp_path))
    assert any("placeholder" in p
               for p in problems("git clone <this repository> consul-rdzv\n", tmp_path))
    assert any("bash -n" in p for p in problems('torchrun --rdzv-id="$JOB_ID \\\n', tmp_path))
    assert any("continues" in p for p in problems("torchrun \\\n\ntrain.py\n", tmp_path))
    assert problems("torchrun --nnodes=2 \\\n  train.py\n", tmp_path) == []


@pytest.mark.parametrize("doc", DOCS)
def test_every_torchrun_command_sets_max_restarts(doc):
    runs = [c for body, _ in shell_blocks(doc) for c in commands(body)
            if re.match(r"(\S+=\S+\s+)*torchrun\b", c)]
    if doc != "docs/kubernetes.md":
        assert runs, f"{doc} shows no torchrun command"
    for command in runs:
        assert re.search(r"--max[-_]restarts[= ]+[1-9]", command), f"{doc}: {command}"


# ----------------------------------------------------------------------------- run them

def pasted(body: str, agent, run_id: str) -> str:
    """The block, with only what this machine cannot have replaced (see the module doc)."""
    body = body.replace("127.0.0.1:8500", agent.address)
    body = re.sub(r"\b10\.0\.0\.\d+\b", "127.0.0.1", body)
    body = body.replace("--nproc-per-node=8", "--nproc-per-node=1")
    body = body.replace("job-42", run_id)
    body, n = re.subn(r"(?m)^(\s*)train\.py\s*$",
                      rf"\g<1>{TRAIN} --steps 5", body)
    assert n == 1, body
    return body


def shell_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CONSUL_", "PET_", "TORCHELASTIC_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def run_together(scripts: list[str], env: dict[str, str], tmp_path: Path) -> list[str]:
    procs = []
    for i, script in enumerate(scripts):
        log = open(tmp_path / f"node-{i}.log", "wb")  # noqa: SIM115 (closed below)
        procs.append((subprocess.Popen(["bash", "-c", script], env=env, stdout=log,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       cwd=tmp_path, start_new_session=True), log))
    outputs = []
    try:
        for proc, _ in procs:
            proc.wait(RUN_TIMEOUT)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait(10)
            log.close()
    for i, (proc, _) in enumerate(procs):
        text = (tmp_path / f"node-{i}.log").read_text(errors="replace")
        outputs.append(text)
        assert proc.returncode == 0, f"node {i} exited {proc.returncode}:\n{text[-6000:]}"
    return outputs


def results(outputs: list[str]) -> list[dict]:
    rows = []
    for text in outputs:
        for line in text.splitlines():
            if line.startswith('{"rank"'):
                rows.append(json.loads(line))
    return sorted(rows, key=lambda r: r["rank"])


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_readme_quick_start_runs_as_pasted_on_two_nodes(agent, tmp_path):
    body = the_block("README.md", "torchrun --nnodes")
    script = pasted(body, agent, f"doc-{uuid.uuid4().hex[:8]}")
    env = shell_env(PET_LOCAL_ADDR="127.0.0.1", PET_RDZV_CONF="last_call_timeout=1")
    rows = results(run_together([script, script], env, tmp_path))
    assert [r["rank"] for r in rows] == [0, 1], rows
    assert len({r["checksum"] for r in rows}) == 1 and rows[0]["world_size"] == 2, rows


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_multi_host_blocks_run_as_pasted_one_per_host(agent, run_id, tmp_path):
    scripts = [pasted(the_block("docs/multi-host.md", f"node_id={host}"), agent, run_id)
               for host in ("gpu-a", "gpu-b")]
    rows = results(run_together(scripts, shell_env(), tmp_path))
    assert [r["rank"] for r in rows] == [0, 1], rows
    assert len({r["checksum"] for r in rows}) == 1 and rows[0]["world_size"] == 2, rows


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_readme_make_demo_runs(tmp_path):
    """``make demo`` from the README's set-up block (``make test`` there is the suite itself)."""
    body = the_block("README.md", "make demo")
    demo = [c for c in commands(body) if c.split("#")[0].strip() == "make demo"]
    assert demo, body
    env = shell_env()
    stale = subprocess.run(["make", "-q", ".venv/bin/.installed"], cwd=ROOT, env=env,
                           capture_output=True)
    if stale.returncode != 0 or not (ROOT / ".venv" / "bin" / "python").exists():
        pytest.skip("the checkout's .venv is missing or older than pyproject.toml: run `make "
                    "demo` first (the test will not install packages)")
    result = subprocess.run(["bash", "-c", demo[0]], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=500)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "parameters identical on all ranks: yes" in result.stdout, result.stdout[-4000:]
