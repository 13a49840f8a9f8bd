"""The Kubernetes kit (deploy/kubernetes/) as the tests read it, without a cluster (no pytest in
here, so both test modules can use it).

* :func:`validate` checks an object against the Kubernetes API's own JSON schemas, the copies
  that the ``kubernetes-validate`` package ships (a ``test`` extra; nothing is fetched at test
  time and no schema is kept in this repository), in its strict variant (an unknown field is an
  error). It takes a kind (``Job``) or, for what sits inside a custom resource whose schema no
  package ships, a type of the core API (``PodTemplateSpec``).
* :class:`Pod` is what the kubelet would make of a workload's pod template for one pod: the
  container's environment (downward API ``fieldRef`` resolved from the pod's name, labels,
  annotations and IPs; ``$(VAR)`` expanded as the kubelet does) and its command line, and where
  each Secret key of a volume would appear as a file.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
KUBE_DIR = ROOT / "deploy" / "kubernetes"

#: The workloads of the kit and the kind of each.
WORKLOADS = {
    "indexed-job.yaml": "Job",
    "indexed-job-servers-only.yaml": "Job",
    "pytorchjob.yaml": "PyTorchJob",
}
#: Helm values for consul-k8s, and whether each runs a client agent on every node.
HELM_VALUES = {
    "consul-values-client-agents.yaml": True,
    "consul-values-servers-only.yaml": False,
}
#: The oldest Kubernetes the kit is for: the Job's ``batch.kubernetes.io/job-name`` label (1.27)
#: and ``podReplacementPolicy`` (beta, on by default, since 1.29).
MIN_KUBERNETES = "1.29"
#: The name of the training container (the PyTorchJob operator requires ``pytorch``).
CONTAINER = "pytorch"

#: Measured (docs/kubernetes.md, "Grace period"; python -m bench.shutdown): from the moment its
#: workers are gone until the agent's node is gone from Consul, at most 0.1 s, and until
#: torchrun has exited, 0.8-1.7 s. The grace period must cover the
#: workers' shutdown (--shutdown-timeout), the leave's own bound (consul_rdzv.torch.LEAVE_AT_EXIT)
#: and this.
TORCHRUN_EXIT_ALLOWANCE = 2.0


def load(name: str) -> dict:
    with (KUBE_DIR / name).open(encoding="utf-8") as fh:
        docs = [d for d in yaml.safe_load_all(fh) if d is not None]
    assert len(docs) == 1, f"{name}: expected one document, found {len(docs)}"
    return docs[0]


def pod_templates(obj: dict) -> dict[str, dict]:
    """The pod templates of a workload, by where they sit in it."""
    if obj["kind"] == "Job":
        return {"spec.template": obj["spec"]["template"]}
    if obj["kind"] == "PyTorchJob":
        return {f"spec.pytorchReplicaSpecs.{role}.template": spec["template"]
                for role, spec in obj["spec"]["pytorchReplicaSpecs"].items()}
    raise AssertionError(f"unexpected kind {obj['kind']}")


def container(template: dict, name: str = CONTAINER) -> dict:
    matches = [c for c in template["spec"]["containers"] if c["name"] == name]
    assert len(matches) == 1, [c["name"] for c in template["spec"]["containers"]]
    return matches[0]


# ----------------------------------------------------------------------------- schemas

def kubernetes_versions() -> list[str]:
    """The Kubernetes versions whose schemas the installed kubernetes-validate ships."""
    from kubernetes_validate.utils import all_versions

    return all_versions()


def schema_version(wanted: str) -> str:
    """The newest shipped schema version not newer than ``wanted`` (major.minor)."""
    def key(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in v.split("."))

    fits = [v for v in kubernetes_versions() if key(v)[:2] <= key(wanted)[:2]]
    assert fits, f"kubernetes-validate ships no schema for Kubernetes {wanted} or older"
    return fits[-1]


@cache
def _schema_text(version: str, filename: str) -> str:
    base = resources.files("kubernetes_validate") / "kubernetes-json-schema"
    path = base / f"v{version}-local-strict" / filename
    return path.read_text(encoding="utf-8")


def _schema_file(kind: str, api_version: str) -> str:
    """kubernetes-validate's file name: ``job-batch-v1.json``, ``podtemplatespec-v1.json``."""
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    return f"{kind.lower()}-{group_version}.json"


def validate(obj: dict, version: str, *, kind: str | None = None,
             api_version: str = "v1") -> list[str]:
    """Every error of ``obj`` against the strict schema of Kubernetes ``version``: of its own
    kind, or of the core type ``kind`` (e.g. ``PodTemplateSpec``). Empty when valid."""
    import jsonschema
    from referencing import Registry, Resource

    version = schema_version(version)
    filename = _schema_file(kind or obj["kind"], api_version if kind else obj["apiVersion"])
    schema = json.loads(_schema_text(version, filename))
    definitions = json.loads(_schema_text(version, "_definitions.json"))
    registry = Resource.from_contents(definitions) @ (Resource.from_contents(schema) @ Registry())
    validator = jsonschema.Draft202012Validator(schema, registry=registry)
    return [f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
            for e in validator.iter_errors(obj)]


# ----------------------------------------------------------------------------- one pod

_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
_FIELD = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")


def expand(text: str, env: dict[str, str]) -> str:
    """``$(VAR)`` as the kubelet expands it in env values, command and args: a defined variable
    is replaced, an undefined one is left as it is, ``$$`` is a literal ``$``."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _VAR.sub(sub, text)


@dataclass
class Pod:
    """One pod of a workload, as the kubelet would start its training container."""

    template: dict
    name: str
    ip: str
    host_ip: str
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)

    def field_ref(self, path: str) -> str:
        simple = {"metadata.name": self.name, "status.podIP": self.ip,
                  "status.hostIP": self.host_ip}
        if path in simple:
            return simple[path]
        m = _FIELD.match(path)
        assert m, f"fieldRef {path!r} is not one this simulation knows"
        where = self.labels if m.group(1) == "labels" else self.annotations
        assert m.group(2) in where, f"the pod has no {m.group(1)[:-1]} {m.group(2)!r}"
        return where[m.group(2)]

    def env(self) -> dict[str, str]:
        """The container's environment from its ``env`` list, in order (a value may refer to
        the variables defined before it)."""
        out: dict[str, str] = {}
        for entry in container(self.template).get("env", []):
            if "value" in entry:
                out[entry["name"]] = expand(entry["value"], out)
            else:
                ref = entry["valueFrom"]["fieldRef"]["fieldPath"]
                out[entry["name"]] = self.field_ref(ref)
        return out

    def argv(self) -> list[str]:
        c = container(self.template)
        env = self.env()
        return [expand(str(a), env) for a in [*c.get("command", []), *c.get("args", [])]]

    def secret_files(self) -> dict[str, tuple[str, str]]:
        """Path in the container -> (Secret name, key), from the mounts and their volumes."""
        volumes = {v["name"]: v for v in self.template["spec"].get("volumes", [])}
        files = {}
        for mount in container(self.template).get("volumeMounts", []):
            secret = volumes[mount["name"]].get("secret")
            if secret is None:
                continue
            for item in secret.get("items", []):
                path = f"{mount['mountPath'].rstrip('/')}/{item['path']}"
                files[path] = (secret["secretName"], item["key"])
        return files
