"""deploy/kubernetes/: the Kubernetes kit (an Indexed Job for each Consul shape, a Kubeflow
PyTorchJob, Helm values for consul-k8s), checked without a cluster.

No Kubernetes cluster runs on the project's machines, so nothing here is applied; the files are
checked, with no network at test time:

* **API schemas.** The Jobs, whole, against the strict JSON schemas of the Kubernetes API
  (``kubernetes-validate``'s copies, a ``test`` extra) of the oldest Kubernetes the kit is for
  and of the newest the package ships. The PyTorchJob is a custom resource whose schema no
  package ships: its pod template is validated against the core ``PodTemplateSpec`` schema, and
  the PyTorchJob fields around it are checked by hand below, against what training-operator
  v1.9 accepts and injects. Negative controls show that each check can fail.
* **What the product relies on**, in every workload: torch's own argument parser reads the
  container's command line (``$(VAR)`` expanded from the downward API as the kubelet would)
  with ``--rdzv-backend=consul``, ``--rdzv-endpoint`` = ``CONSUL_HTTP_ADDR``, ``--rdzv-id`` =
  the job's name, ``--local-addr`` = the pod IP, the node id = the pod's stable name,
  ``--max-restarts`` >= 1; the grace period covers the workers' shutdown, the leave and
  torchrun's exit; the token comes from a Secret file and never from the command line.
* **PET_* precedence.** torchrun reads ``PET_<ARG>`` as the default of ``--<arg>``; the
  PyTorchJob operator injects ``PET_RDZV_ENDPOINT`` (its c10d endpoint), which, left alone,
  becomes ``--rdzv-endpoint`` and beats ``CONSUL_HTTP_ADDR``.
* **Helm values** for consul-k8s: the keys the manifests depend on (the agents' HTTPS port, the
  CA Secret's name, ACLs, client agents or not).

tests/test_kubernetes_pods.py runs the same command lines as real torchrun processes against a
real Consul agent with TLS and ACLs.
"""

from __future__ import annotations

import os
import re
from urllib.parse import urlsplit

import pytest
import yaml
from kube_manifests import (
    CONTAINER,
    HELM_VALUES,
    KUBE_DIR,
    MIN_KUBERNETES,
    ROOT,
    TORCHRUN_EXIT_ALLOWANCE,
    WORKLOADS,
    Pod,
    container,
    kubernetes_versions,
    load,
    pod_templates,
    validate,
)

from consul_rdzv.config import ConsulConfig
from consul_rdzv.settings import settings_from_conf

pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (the Kubernetes API "
                    "schemas) is not installed: pip install -e '.[test]'")

NEWEST = kubernetes_versions()[-1]
VERSIONS = [MIN_KUBERNETES, NEWEST]
#: Consul 1.17 and later are under the Business Source License: this project never uses them.
CONSUL_VERSIONS = ((1, 14), (1, 15), (1, 16))
#: What a pod of each workload looks like to the downward API (PyTorchJob: training-operator
#: v1.9 names pods <job>-worker-<i> and labels them training.kubeflow.org/job-name; an Indexed
#: Job names them <job>-<index>-<random> and sets the job-name label and the index annotation).
POD_IP, HOST_IP = "10.1.2.3", "192.168.7.8"

#: training-operator v1.9: the PyTorchJob fields it defines (pytorch_types.go, the CRD).
PYTORCHJOB_SPEC = {"elasticPolicy", "nprocPerNode", "pytorchReplicaSpecs", "runPolicy"}
ELASTIC_POLICY = {"minReplicas", "maxReplicas", "rdzvBackend", "rdzvPort", "rdzvHost", "rdzvId",
                  "rdzvConf", "standalone", "nProcPerNode", "maxRestarts", "metrics"}
RUN_POLICY = {"cleanPodPolicy", "ttlSecondsAfterFinished", "activeDeadlineSeconds",
              "backoffLimit", "schedulingPolicy", "suspend", "managedBy"}
REPLICA_SPEC = {"replicas", "template", "restartPolicy"}
RESTART_POLICIES = {"Always", "OnFailure", "Never", "ExitCode"}
CLEAN_POD_POLICIES = {"All", "Running", "None"}
#: The port the operator gives the "pytorch" container when none is named pytorchjob-port.
PYTORCHJOB_DEFAULT_PORT = 23456
#: What a Consul ACL token's SecretID looks like.
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.I)


# ----------------------------------------------------------------------------- helpers

def sample_pod(obj: dict, template: dict, index: int = 1) -> Pod:
    name = obj["metadata"]["name"]
    if obj["kind"] == "Job":
        return Pod(template, name=f"{name}-{index}-x7k2q", ip=POD_IP, host_ip=HOST_IP,
                   labels={"batch.kubernetes.io/job-name": name, "job-name": name},
                   annotations={"batch.kubernetes.io/job-completion-index": str(index)})
    return Pod(template, name=f"{name}-worker-{index}", ip=POD_IP, host_ip=HOST_IP,
               labels={"training.kubeflow.org/job-name": name,
                       "training.kubeflow.org/replica-type": "worker",
                       "training.kubeflow.org/replica-index": str(index)})


def stable_name(obj: dict, index: int = 1) -> str:
    """The pod's name that survives its replacement: an Indexed Job pod's hostname
    (<job>-<index>; its pod name has a random suffix), a PyTorchJob pod's name."""
    name = obj["metadata"]["name"]
    return f"{name}-{index}" if obj["kind"] == "Job" else f"{name}-worker-{index}"


def operator_env(obj: dict) -> dict[str, str]:
    """The PET_* variables training-operator v1.9 appends to the container of an elastic
    PyTorchJob (pkg/controller.v1/pytorch/elastic.go and envvar.go)."""
    if obj["kind"] != "PyTorchJob":
        return {}
    spec = obj["spec"]
    policy = spec["elasticPolicy"]
    env = {"PET_RDZV_ENDPOINT": f"{obj['metadata']['name']}-worker-0:{PYTORCHJOB_DEFAULT_PORT}",
           "PET_RDZV_BACKEND": policy.get("rdzvBackend", "c10d"),
           "PET_NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}",
           "PET_NPROC_PER_NODE": str(spec.get("nprocPerNode", "auto"))}
    if "maxRestarts" in policy:
        env["PET_MAX_RESTARTS"] = str(policy["maxRestarts"])
    if "rdzvId" in policy:
        env["PET_RDZV_ID"] = policy["rdzvId"]
    if "rdzvConf" in policy:
        env["PET_RDZV_CONF"] = ",".join(f"{c['key']}={c['value']}" for c in policy["rdzvConf"])
    return env


def torchrun_args(argv: list[str], pet_env: dict[str, str], monkeypatch):
    """The command line as torch's own parser reads it in a container whose environment holds
    ``pet_env`` (the parser takes PET_<ARG> as the default of --<arg> when it is built)."""
    from torch.distributed.run import get_args_parser

    for name in [n for n in os.environ if n.startswith("PET_")]:
        monkeypatch.delenv(name)
    for name, value in pet_env.items():
        monkeypatch.setenv(name, value)
    assert argv[0] == "torchrun", argv
    return get_args_parser().parse_args(argv[1:])


def rdzv_conf(raw: str) -> dict[str, str]:
    conf = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        key, sep, value = item.partition("=")
        assert sep, f"--rdzv-conf item {item!r} is not key=value"
        conf[key.strip()] = value.strip()
    return conf


def nnodes_range(nnodes: str) -> tuple[int, int]:
    low, _, high = nnodes.partition(":")
    return int(low), int(high or low)


def env_entries(template: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container(template).get("env", [])}


def leave_at_exit() -> float:
    from consul_rdzv.torch import LEAVE_AT_EXIT

    return LEAVE_AT_EXIT


@pytest.fixture(params=sorted(WORKLOADS), scope="module")
def workload(request) -> tuple[str, dict]:
    return request.param, load(request.param)


def templates_of(workload) -> list[tuple[str, dict]]:
    return list(pod_templates(workload[1]).items())


# ----------------------------------------------------------------------------- the kit

def test_the_kit_holds_the_documented_files():
    present = sorted(p.name for p in KUBE_DIR.iterdir())
    assert present == sorted([*WORKLOADS, *HELM_VALUES, "README.md"]), present
    doc = (ROOT / "docs" / "kubernetes.md").read_text(encoding="utf-8")
    for name in [*WORKLOADS, *HELM_VALUES]:
        assert f"deploy/kubernetes/{name}" in doc, f"docs/kubernetes.md does not mention {name}"
    readme = (KUBE_DIR / "README.md").read_text(encoding="utf-8")
    for name in [*WORKLOADS, *HELM_VALUES]:
        assert name in readme, f"deploy/kubernetes/README.md does not list {name}"


# ----------------------------------------------------------------------------- API schemas

@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", sorted(n for n, kind in WORKLOADS.items() if kind == "Job"))
def test_jobs_match_the_kubernetes_api_schema(name, version):
    assert validate(load(name), version) == []


@pytest.mark.parametrize("version", VERSIONS)
def test_every_pod_template_matches_the_core_podtemplatespec_schema(workload, version):
    for where, template in templates_of(workload):
        assert validate(template, version, kind="PodTemplateSpec") == [], where


def test_the_schema_checks_reject_a_broken_manifest():
    """Negative controls: a misspelt field, a value of the wrong type, and a field newer than
    the Kubernetes version asked for each fail the same checks."""
    job = load("indexed-job.yaml")
    fixed = yaml.safe_dump(job)
    broken = yaml.safe_load(fixed.replace("fieldPath: status.podIP", "fieldpath: status.podIP"))
    assert any("fieldpath" in e for e in validate(broken, MIN_KUBERNETES))
    template = yaml.safe_load(fixed)["spec"]["template"]
    template["spec"]["terminationGracePeriodSeconds"] = "40s"
    errors = validate(template, MIN_KUBERNETES, kind="PodTemplateSpec")
    assert any("terminationGracePeriodSeconds" in e for e in errors), errors
    assert any("podReplacementPolicy" in e for e in validate(job, "1.27"))


# ----------------------------------------------------------------------------- PyTorchJob CRD

def test_pytorchjob_fields_are_those_training_operator_accepts():
    """What no shipped schema can check: the PyTorchJob around the pod template, by hand,
    against training-operator v1.9 (its CRD and its validating webhook)."""
    obj = load("pytorchjob.yaml")
    assert obj["apiVersion"] == "kubeflow.org/v1" and obj["kind"] == "PyTorchJob"
    assert re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", obj["metadata"]["name"])  # DNS-1035
    spec = obj["spec"]
    assert set(spec) <= PYTORCHJOB_SPEC, set(spec) - PYTORCHJOB_SPEC
    policy = spec["elasticPolicy"]
    assert set(policy) <= ELASTIC_POLICY, set(policy) - ELASTIC_POLICY
    assert all(isinstance(policy[k], int) for k in ("minReplicas", "maxReplicas", "maxRestarts"))
    assert set(spec["runPolicy"]) <= RUN_POLICY, set(spec["runPolicy"]) - RUN_POLICY
    assert spec["runPolicy"].get("cleanPodPolicy", "None") in CLEAN_POD_POLICIES
    replicas = spec["pytorchReplicaSpecs"]
    assert set(replicas) == {"Worker"}, set(replicas)  # elastic: Worker only, no Master
    worker = replicas["Worker"]
    assert set(worker) <= REPLICA_SPEC, set(worker) - REPLICA_SPEC
    assert worker["restartPolicy"] in RESTART_POLICIES
    assert policy["minReplicas"] <= worker["replicas"] <= policy["maxReplicas"]
    pytorch = container(worker["template"])  # the webhook requires a container "pytorch"
    assert pytorch["image"]


def test_pytorchjob_command_line_matches_its_elastic_policy(monkeypatch):
    obj = load("pytorchjob.yaml")
    policy = obj["spec"]["elasticPolicy"]
    template = obj["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    args = torchrun_args(sample_pod(obj, template).argv(), operator_env(obj), monkeypatch)
    assert args.nnodes == f"{policy['minReplicas']}:{policy['maxReplicas']}"
    assert args.max_restarts == policy["maxRestarts"]


# ----------------------------------------------------------------------------- what we rely on

def test_torchrun_command_rendezvouses_through_consul(workload, monkeypatch):
    _, obj = workload
    for where, template in templates_of(workload):
        pod = sample_pod(obj, template)
        env = pod.env()
        args = torchrun_args(pod.argv(), operator_env(obj), monkeypatch)
        assert args.rdzv_backend == "consul", where
        assert args.rdzv_endpoint == env["CONSUL_HTTP_ADDR"], where
        assert args.rdzv_id == obj["metadata"]["name"], where        # one run per job
        assert args.local_addr == POD_IP, where                      # rank 0's store: pod IP
        conf = rdzv_conf(args.rdzv_conf)
        assert conf["node_id"] == stable_name(obj), where
        low, high = nnodes_range(args.nnodes)
        settings_from_conf(args.rdzv_id, low, high, conf)  # raises on an unknown key or value
        assert args.max_restarts >= 1, where  # a node that goes restarts the survivors' workers
        assert args.shutdown_timeout is not None, where  # explicit: the grace period needs it


def test_pod_identity_comes_from_the_downward_api(workload):
    _, obj = workload
    for where, template in templates_of(workload):
        entries = env_entries(template)

        def field(var: str, entries=entries) -> str:
            return entries[var]["valueFrom"]["fieldRef"]["fieldPath"]

        assert field("POD_IP") == "status.podIP", where
        if obj["kind"] == "Job":
            assert field("JOB_NAME") == "metadata.labels['batch.kubernetes.io/job-name']"
            assert field("JOB_INDEX") == \
                "metadata.annotations['batch.kubernetes.io/job-completion-index']"
            assert obj["spec"]["completionMode"] == "Indexed"
            assert template["spec"]["restartPolicy"] == "OnFailure"  # same pod, same IP
            # A replacement for an index starts only once its predecessor is gone.
            assert obj["spec"]["podReplacementPolicy"] == "Failed"
            args = container(template)["args"]
            low, high = nnodes_range(next(a.split("=", 1)[1] for a in args
                                          if a.startswith("--nnodes=")))
            assert low == high == obj["spec"]["completions"] == obj["spec"]["parallelism"]
        else:
            assert field("POD_NAME") == "metadata.name", where
            assert field("JOB_NAME") == "metadata.labels['training.kubeflow.org/job-name']"


def test_the_two_pods_of_one_index_get_the_same_node_id_and_two_indexes_different_ones(workload):
    _, obj = workload
    for _, template in templates_of(workload):
        first = sample_pod(obj, template, 1)
        again = Pod(template, name=first.name.replace("x7k2q", "p9d4m"), ip="10.9.9.9",
                    host_ip=HOST_IP, labels=first.labels, annotations=first.annotations)
        other = sample_pod(obj, template, 2)
        ids = [rdzv_conf(next(a for a in p.argv() if a.startswith("--rdzv-conf="))
                         .split("=", 1)[1])["node_id"] for p in (first, again, other)]
        assert ids[0] == ids[1] != ids[2], ids


def test_the_grace_period_covers_worker_shutdown_leave_and_exit(workload):
    """kubelet: SIGTERM, then SIGKILL after terminationGracePeriodSeconds. torchrun: SIGTERM to
    its workers, SIGKILL after --shutdown-timeout; then the node leaves (at most LEAVE_AT_EXIT)
    and torchrun exits (measured, TORCHRUN_EXIT_ALLOWANCE)."""
    for where, template in templates_of(workload):
        args = container(template)["args"]
        shutdown = int(next(a.split("=", 1)[1] for a in args
                            if a.startswith("--shutdown-timeout=")))
        grace = template["spec"]["terminationGracePeriodSeconds"]
        need = shutdown + leave_at_exit() + TORCHRUN_EXIT_ALLOWANCE
        assert grace >= need, f"{where}: grace {grace}s < {need}s"
        # torchrun, not the pod's PID 1: SIGTERM reaches it before its handlers are installed
        assert template["spec"]["shareProcessNamespace"] is True, where


def test_token_and_ca_come_from_secret_files_never_from_the_command_line(workload):
    _, obj = workload
    for where, template in templates_of(workload):
        pod = sample_pod(obj, template)
        env, files = pod.env(), pod.secret_files()
        entries = env_entries(template)
        assert "CONSUL_HTTP_TOKEN" not in entries, where
        assert files[env["CONSUL_HTTP_TOKEN_FILE"]][0] == "consul-rdzv-token", where
        assert files[env["CONSUL_CACERT"]] == ("consul-ca-cert", "tls.crt"), where
        for arg in pod.argv():
            assert "token" not in arg.lower(), f"{where}: {arg!r} on the command line"
        mounts = container(template)["volumeMounts"]
        assert all(m.get("readOnly") for m in mounts), where
        for entry in entries.values():  # no token (a UUID) as a literal value
            assert not UUID.search(entry.get("value", "")), (where, entry)


def test_consul_address_is_one_agent_over_https(workload):
    name, obj = workload
    for where, template in templates_of(workload):
        env = sample_pod(obj, template).env()
        url = urlsplit(env["CONSUL_HTTP_ADDR"])
        assert url.scheme == "https" and url.port == 8501, (where, url)
        if "servers-only" in name:
            # one server by its own name; never the consul-server Service (several servers)
            assert re.fullmatch(r"consul-server-\d+\.consul-server\.consul\.svc", url.hostname)
        else:
            assert url.hostname == HOST_IP, (where, url)  # the node's client agent


def test_training_script_and_its_arguments_exist(workload):
    source = (ROOT / "consul_rdzv" / "examples" / "train.py").read_text(encoding="utf-8")
    for where, template in templates_of(workload):
        args = container(template)["args"]
        # the example ships in the installed package (compose/Dockerfile's image)
        script = args[args.index("--module") + 1]
        assert script == "consul_rdzv.examples.train", where
        for flag in args[args.index(script) + 1:]:
            assert f'add_argument("{flag.split("=")[0]}"' in source, (where, flag)
        assert template["metadata"]["annotations"][
            "consul.hashicorp.com/connect-inject"] == "false", where
        assert container(template)["name"] == CONTAINER


# ----------------------------------------------------------------------------- PET_* precedence

def test_an_injected_pet_rdzv_endpoint_beats_consul_http_addr_unless_given_explicitly(
        monkeypatch):
    """torch 2.13's torchrun takes PET_RDZV_ENDPOINT as the default of --rdzv-endpoint; the
    handler takes a non-empty --rdzv-endpoint over CONSUL_HTTP_ADDR. So the operator's c10d
    endpoint would be used as Consul's address, unless the command line names Consul's."""
    obj = load("pytorchjob.yaml")
    template = obj["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    pod = sample_pod(obj, template)
    consul = pod.env()["CONSUL_HTTP_ADDR"]
    pet = operator_env(obj)
    monkeypatch.setenv("CONSUL_HTTP_ADDR", consul)

    without = [a for a in pod.argv() if not a.startswith(("--rdzv-endpoint", "--rdzv-backend"))]
    args = torchrun_args(without, pet, monkeypatch)
    assert args.rdzv_endpoint == pet["PET_RDZV_ENDPOINT"]
    assert args.rdzv_backend == "c10d"
    config = ConsulConfig.resolve(address=args.rdzv_endpoint or None)
    assert config.url == f"http://{pet['PET_RDZV_ENDPOINT']}", config.url  # not Consul

    args = torchrun_args(pod.argv(), pet, monkeypatch)
    assert args.rdzv_endpoint == consul and args.rdzv_backend == "consul"
    assert ConsulConfig.resolve(address=args.rdzv_endpoint).url == consul


# ----------------------------------------------------------------------------- Helm values

@pytest.mark.parametrize("name", sorted(HELM_VALUES))
def test_helm_values_give_what_the_manifests_expect(name):
    values = yaml.safe_load((KUBE_DIR / name).read_text(encoding="utf-8"))
    g = values["global"]
    match = re.fullmatch(r"hashicorp/consul:(\d+)\.(\d+)\.\d+", g["image"])
    assert match and (int(match[1]), int(match[2])) in CONSUL_VERSIONS, g["image"]
    assert g["name"] == "consul"          # Secret consul-ca-cert, Service consul-server
    assert g["tls"]["enabled"] is True and g["tls"]["httpsOnly"] is True  # 8501 only
    assert g["acls"]["manageSystemACLs"] is True
    assert values["client"]["enabled"] is HELM_VALUES[name]
    if HELM_VALUES[name]:
        # the agent's certificate must name the node's IP the pods use (https://$(HOST_IP))
        assert g["tls"]["enableAutoEncrypt"] is True
    assert values["connectInject"]["enabled"] is False
    text = (KUBE_DIR / name).read_text(encoding="utf-8")
    assert "--namespace consul" in text  # consul-server-N.consul-server.consul.svc
    assert f"--values deploy/kubernetes/{name}" in text


def test_manifests_use_the_secret_and_server_names_the_helm_values_produce():
    for name in WORKLOADS:
        obj = load(name)
        for _, template in pod_templates(obj).items():
            secrets = {v["secret"]["secretName"] for v in template["spec"]["volumes"]
                       if "secret" in v}
            assert "consul-ca-cert" in secrets, name  # <global.name>-ca-cert, key tls.crt
