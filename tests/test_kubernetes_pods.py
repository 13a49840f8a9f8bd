"""The pods of deploy/kubernetes/, run here as real torchrun processes: no cluster, but the
containers' own command lines against a real Consul agent with TLS and default-deny ACLs (the
shape of consul-values-*.yaml).

Each "pod" is what the kubelet would start from the manifest (tests/kube_manifests.py,
:class:`Pod`): its environment from the container's ``env`` list (the downward API answered
with this pod's name, labels, annotations and IPs, all 127.0.0.1 here), its command line with
``$(VAR)`` expanded, and its Secret volumes as files (Consul's CA certificate, and a token that
holds only docs/acl-policy.hcl). What is replaced, and only that:

* the mount paths of the Secret volumes, by a directory of the test (same file names);
* the node's Consul agent at ``https://$(HOST_IP):8501`` by the test agent's HTTPS port;
* ``torchrun`` by ``python -m torch.distributed.run`` (the same entry point), and the training
  script's own arguments (``--steps`` ...) by shorter ones, plus ``--out`` / ``--progress-file``.

Stopping a pod is what the kubelet does on deletion, eviction or preemption: SIGTERM to the
container's main process (torchrun is not PID 1: ``shareProcessNamespace``), SIGKILL after
``terminationGracePeriodSeconds``. The tests measure what happens in between (``pytest -s``
prints every figure with a ``[figure]`` tag) and check that it fits in the grace period.
"""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
from kube_manifests import ROOT, Pod, container, load, pod_templates
from torchrun_jobs import Agent, TorchrunJob

from consul_testing import ConsulAgent

pytestmark = pytest.mark.slow

JOB_TIMEOUT = 180
POLICY_FILE = ROOT / "docs" / "acl-policy.hcl"
#: The training script's arguments for these runs (the manifests' own run for minutes).
TRAIN_ARGS = ["--steps", "300", "--step-time", "0.05"]


# ----------------------------------------------------------------------------- Consul, as on k8s

@pytest.fixture(scope="module")
def consul_k8s(request) -> ConsulAgent:
    """A Consul agent with TLS (HTTPS only) and default-deny ACLs."""
    agent = ConsulAgent(acl=True, tls=True).start()
    request.addfinalizer(agent.close)
    return agent


def _api(agent: ConsulAgent, method: str, path: str, body: dict) -> dict:
    context = ssl.create_default_context(cafile=str(agent.ca_file))
    request = urllib.request.Request(
        f"{agent.url}{path}", method=method, data=json.dumps(body).encode(),
        headers={"X-Consul-Token": agent.management_token})
    with urllib.request.urlopen(request, context=context, timeout=10) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="module")
def job_token(consul_k8s) -> str:
    """The SecretID of a token that holds only the shipped policy (the Secret consul-rdzv-token
    of docs/kubernetes.md)."""
    name = f"consul-rdzv-{uuid.uuid4().hex[:8]}"
    # the shipped policy with its node-name prefix put in (docs/acl-policy.hcl says how): the
    # prefix of this agent's Consul node name, as the session rule asks for
    rules = POLICY_FILE.read_text().replace("<node-prefix>",
                                            consul_k8s.node_name.split("-")[0] + "-")
    _api(consul_k8s, "PUT", "/v1/acl/policy", {"Name": name, "Rules": rules})
    token = _api(consul_k8s, "PUT", "/v1/acl/token", {"Description": "k8s pods",
                                                       "Policies": [{"Name": name}]})
    return token["SecretID"]


# ----------------------------------------------------------------------------- pods

class PodJob(TorchrunJob):
    """Pods of one workload started as the kubelet would start their training container."""

    def __init__(self, workdir: Path, agent: ConsulAgent, token: str, manifest: str,
                 job_name: str, *, extra_env: dict[str, str] | None = None) -> None:
        super().__init__(workdir, agent.url, job_name, nnodes="unused")
        self.consul = agent
        self.obj = load(manifest)
        self.template = next(iter(pod_templates(self.obj).values()))
        self.job_name = job_name
        self.secrets = {("consul-ca-cert", "tls.crt"): Path(agent.ca_file).read_text(),
                        ("consul-rdzv-token", "token"): token}
        self.extra_env = dict(extra_env or {})

    @property
    def grace(self) -> int:
        return self.template["spec"]["terminationGracePeriodSeconds"]

    def pod(self, index: int, suffix: str = "a1b2c") -> Pod:
        if self.obj["kind"] == "Job":
            return Pod(self.template, name=f"{self.job_name}-{index}-{suffix}", ip="127.0.0.1",
                       host_ip="127.0.0.1",
                       labels={"batch.kubernetes.io/job-name": self.job_name},
                       annotations={"batch.kubernetes.io/job-completion-index": str(index)})
        return Pod(self.template, name=f"{self.job_name}-worker-{index}", ip="127.0.0.1",
                   host_ip="127.0.0.1", labels={"training.kubeflow.org/job-name": self.job_name})

    def _local(self, pod: Pod, value: str) -> str:
        """A container path under a Secret mount -> the file this test wrote for it."""
        for path in pod.secret_files():
            if value == path:
                return str(self.workdir / "mounts" / pod.name / path.lstrip("/"))
        return value

    def container_env(self, pod: Pod) -> dict[str, str]:
        env = {name: self._local(pod, value) for name, value in pod.env().items()}
        url = urlsplit(env["CONSUL_HTTP_ADDR"])
        if url.hostname == pod.host_ip:  # the node's client agent -> the test agent
            assert url.port == 8501, url
            env["CONSUL_HTTP_ADDR"] = urlunsplit(
                (url.scheme, f"{url.hostname}:{self.consul.port}", url.path, "", ""))
        return env

    def start_pod(self, pod: Pod, train_args: list[str] = TRAIN_ARGS) -> Agent:
        for path, (secret, key) in pod.secret_files().items():
            local = Path(self._local(pod, path))
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_text(self.secrets[(secret, key)])
        env = self.container_env(pod)
        agent_url = (pod.env()["CONSUL_HTTP_ADDR"], env["CONSUL_HTTP_ADDR"])
        argv = [arg.replace(*agent_url) for arg in pod.argv()]
        assert argv[0] == "torchrun", argv
        script = argv.index("consul_rdzv.examples.train")
        argv = [sys.executable, "-m", "torch.distributed.run", *argv[1:script + 1],
                *train_args, "--out", str(self.out), "--progress-file", str(self.progress_path)]
        base = {k: v for k, v in self.env.items() if not k.startswith(("CONSUL_", "PET_"))}
        log_path = self.workdir / f"agent-{pod.name}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv, env={**base, **self.extra_env, **env}, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    cwd=ROOT, start_new_session=True)
        agent = Agent(pod.name, proc, log_path)
        self.agents.append(agent)
        return agent

    def node_present(self, node_id: str) -> bool:
        client = self.consul.client()
        try:
            keys = client.kv_keys(f"torchelastic/{self.job_name}/members/")
            services = client.agent_services()
        finally:
            client.close()
        return (any(k.endswith(f"/members/{node_id}") for k in keys)
                or f"{self.job_name}-{node_id}" in services)

    def stop_pod(self, agent: Agent, node_id: str) -> dict[str, float]:
        """SIGTERM to the container's main process, as the kubelet sends it; seconds until the
        node is gone from Consul and until torchrun exited (or the grace period ran out)."""
        assert self.node_present(node_id), self.report()
        signalled = time.monotonic()
        agent.signal(signal.SIGTERM)
        took: dict[str, float] = {}
        while len(took) < 2 and time.monotonic() - signalled < self.grace + 5:
            now = time.monotonic() - signalled
            if "gone" not in took and not self.node_present(node_id):
                took["gone"] = now
            if "exit" not in took and not agent.alive():
                took["exit"] = now
            time.sleep(0.02)
        return took


def trained_together(job: PodJob, names: list[str], world_size: int) -> list[dict]:
    codes = job.wait(JOB_TIMEOUT, [a for a in job.agents if a.name in names])
    report = job.report()
    assert all(code == 0 for code in codes.values()), f"{codes}\n{report}"
    results = [r for r in job.results() if r["world_size"] == world_size]
    assert sorted(r["rank"] for r in results) == list(range(world_size)), report
    assert len({r["checksum"] for r in results}) == 1, report
    return results


def training(job: PodJob, world_size: int) -> bool:
    return (len(job.starts(world_size=world_size)) == world_size
            and any(e["event"] == "step" and e["world_size"] == world_size and e["step"] >= 5
                    for e in job.progress()))


# ----------------------------------------------------------------------------- the tests

@pytest.mark.long
@pytest.mark.timeout(600)
def test_indexed_job_pods_train_and_a_deleted_pod_is_replaced(consul_k8s, job_token, tmp_path):
    """Three pods of indexed-job.yaml train together; one is deleted mid-training (SIGTERM):
    its node leaves Consul at once and torchrun exits well within the grace period, the others
    restart their workers (--max-restarts) instead of failing, and the replacement pod of the
    same index (a new pod name, the same node id) brings the job back to three."""
    job_name = f"k8s-{uuid.uuid4().hex[:6]}"
    with PodJob(tmp_path, consul_k8s, job_token, "indexed-job.yaml", job_name) as job:
        for i in range(3):
            job.start_pod(job.pod(i))
        job.wait_for(lambda: training(job, 3), JOB_TIMEOUT, "three pods training in world 3")

        took = job.stop_pod(job.agents[1], f"{job_name}-1")
        report = job.report()
        assert set(took) == {"gone", "exit"}, f"{took}\n{report}"
        assert took["gone"] < job.grace and took["exit"] < job.grace, f"{took}\n{report}"
        assert job.agents[1].proc.returncode != 0, report

        survivors = [job.agents[0], job.agents[2]]
        assert all(a.alive() for a in survivors), job.report()  # --max-restarts: no failure
        replaced_at = time.time()
        replacement = job.start_pod(job.pod(1, suffix="z9y8x"))
        trained_together(job, [a.name for a in [*survivors, replacement]], 3)
        assert any(e["time"] > replaced_at for e in job.starts(world_size=3)), job.report()
        print(f"[figure] k8s pod deleted mid-training (SIGTERM, workers exit at once): node gone "
              f"from Consul {took['gone']:.2f}s, torchrun exited {took['exit']:.2f}s after the "
              f"signal (grace {job.grace}s); the replacement pod rejoined and the job finished")


@pytest.mark.long
@pytest.mark.timeout(600)
def test_workers_that_outlast_the_shutdown_timeout_still_leave_within_the_grace_period(
        consul_k8s, job_token, tmp_path):
    """Workers that do not exit on SIGTERM (a long checkpoint): torchrun SIGKILLs them after the
    manifest's --shutdown-timeout, then the node leaves and torchrun exits, all before the
    kubelet's SIGKILL at terminationGracePeriodSeconds."""
    job_name = f"k8s-{uuid.uuid4().hex[:6]}"
    stubborn = ["--steps", "100000", "--step-time", "0.05", "--sigterm-delay", "3600"]
    with PodJob(tmp_path, consul_k8s, job_token, "indexed-job.yaml", job_name) as job:
        shutdown = int(next(a.split("=", 1)[1] for a in container(job.template)["args"]
                            if a.startswith("--shutdown-timeout=")))
        for i in range(3):
            job.start_pod(job.pod(i), stubborn)
        job.wait_for(lambda: training(job, 3), JOB_TIMEOUT, "three pods training in world 3")

        took = job.stop_pod(job.agents[1], f"{job_name}-1")
        report = job.report()
        assert set(took) == {"gone", "exit"}, f"{took}\n{report}"
        assert took["gone"] >= shutdown, f"left before its workers were killed: {took}\n{report}"
        assert took["gone"] < job.grace and took["exit"] < job.grace, f"{took}\n{report}"
        print(f"[figure] k8s pod deleted, workers ignore SIGTERM: node gone from Consul "
              f"{took['gone']:.2f}s, torchrun exited {took['exit']:.2f}s after the signal "
              f"(--shutdown-timeout {shutdown}s, grace {job.grace}s)")


@pytest.mark.timeout(600)
def test_pytorchjob_pods_with_the_operators_pet_variables_rendezvous_through_consul(
        consul_k8s, job_token, tmp_path):
    """The four pods of pytorchjob.yaml, with the PET_* variables training-operator v1.9 injects
    (PET_RDZV_ENDPOINT=<job>-worker-0:23456, PET_RDZV_BACKEND=c10d, ...): their explicit
    arguments win, they rendezvous through Consul and train in a world of 4."""
    job_name = f"k8s-{uuid.uuid4().hex[:6]}"
    obj = load("pytorchjob.yaml")
    policy = obj["spec"]["elasticPolicy"]
    pet = {"PET_RDZV_ENDPOINT": f"{job_name}-worker-0:23456", "PET_RDZV_BACKEND": "c10d",
           "PET_NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}",
           "PET_MAX_RESTARTS": str(policy["maxRestarts"]), "PET_NPROC_PER_NODE": "auto"}
    replicas = obj["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"]
    with PodJob(tmp_path, consul_k8s, job_token, "pytorchjob.yaml", job_name,
                extra_env=pet) as job:
        for i in range(replicas):
            job.start_pod(job.pod(i), ["--steps", "20"])
        trained_together(job, [a.name for a in job.agents], replicas)


@pytest.mark.timeout(300)
def test_without_an_explicit_endpoint_the_operators_pet_rdzv_endpoint_wins(
        consul_k8s, job_token, tmp_path):
    """The counter-case, for real: the PyTorchJob pod's command without --rdzv-endpoint, with
    CONSUL_HTTP_ADDR right and PET_RDZV_ENDPOINT injected: torchrun hands the operator's c10d
    address to consul-rdzv as Consul's, and the pod fails naming that address."""
    job_name = f"k8s-{uuid.uuid4().hex[:6]}"
    pet_endpoint = "127.0.0.1:9"  # nothing listens: stands for <job>-worker-0:23456
    with PodJob(tmp_path, consul_k8s, job_token, "pytorchjob.yaml", job_name,
                extra_env={"PET_RDZV_ENDPOINT": pet_endpoint}) as job:
        args = container(job.template)["args"]
        container(job.template)["args"] = [a for a in args if not a.startswith("--rdzv-endpoint")]
        container(job.template)["args"] = [
            a.replace("--rdzv-conf=", "--rdzv-conf=consul_timeout=2,") for a in
            container(job.template)["args"]]
        agent = job.start_pod(job.pod(0))
        assert job.container_env(job.pod(0))["CONSUL_HTTP_ADDR"] == consul_k8s.url
        code = job.wait(120, [agent])[agent.name]
        log = agent.log()
        assert code not in (0, None), job.report()
        assert f"Consul at http://{pet_endpoint}" in log, job.report()


def test_the_pods_environment_is_the_manifests(consul_k8s, job_token, tmp_path):
    """What the simulation hands torchrun, spelled out: a TLS address of the node's agent, the
    CA and the token as files (never the token in the environment or on the command line)."""
    job = PodJob(tmp_path, consul_k8s, job_token, "indexed-job.yaml", "k8s-env")
    pod = job.pod(2)
    env = job.container_env(pod)
    assert env["CONSUL_HTTP_ADDR"] == consul_k8s.url
    assert Path(env["CONSUL_CACERT"]).name == "tls.crt"
    assert Path(env["CONSUL_HTTP_TOKEN_FILE"]).name == "token"
    assert "CONSUL_HTTP_TOKEN" not in env
    assert job_token not in " ".join(pod.argv()) and job_token not in json.dumps(env)
    assert os.path.basename(pod.argv()[0]) == "torchrun"
