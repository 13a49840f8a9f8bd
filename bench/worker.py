# ruff: noqa: E402  (bench.compare.activate must run before torch is imported)
"""A benchmark worker process: hosts some of the simulated nodes, one thread per node.

Every node builds its handler through torch's registry, exactly as torchrun does
(``get_rendezvous_handler(RendezvousParameters(...))``), then waits for the cross-process start
signal and calls ``next_rendezvous()``. The parent (bench.run) drives the later phases with
commands over a pipe; results go back over one shared queue.

What is patched here, and why (counting and loopback only; no rendezvous logic is changed):

* ``C10dRendezvousBackend._call_store`` counts every store round trip of the c10d rendezvous
  state (``get`` / ``compare_set``) per backend instance.
* ``urllib3.PoolManager.urlopen`` counts every HTTP request of a python-etcd client (one
  ``PoolManager`` per client, so per node); requests made inside ``EtcdStore`` methods (the
  MASTER_ADDR/PORT bootstrap) are tagged ``store``, everything else ``rdzv``.
* ``urllib3.HTTPConnectionPool.urlopen`` and, for a consul_rdzv whose client does not run on
  urllib3 (its own HTTP transport), ``ConsulClient._request`` count the HTTP requests of the
  whole process (every backend, every version ``--compare`` loads; never both for one
  request): a cross-check of the per-node figures.
* ``RendezvousStoreInfo.build`` counts the c10d bootstrap store operations per node.
* ``ConsulClient._request`` and ``consul_rdzv.torch.TCPStore`` are timed (Consul latency per
  endpoint; the trainer-store connect inside the consul handler's ``next_rendezvous()``).
* ``DynamicRendezvousHandler._create_tcp_store_server`` (rank 0's shared TCPStore server of the
  c10d and etcd-v2 handlers) binds 127.0.0.1 instead of every interface; it still starts the same
  ``TCPStore(is_master=True, multi_tenant=True)``.

Which consul_rdzv: this checkout's, or the package of ``$BENCH_PRODUCT_DIR`` (``bench.run
--compare``): :func:`bench.compare.activate` decides it before torch's registry imports the
package, and the ``ready`` message names the files that were loaded.

The SIGTERM victim (scenario ``failover-term``): its main thread gets a SIGTERM handler raising
torch's ``SignalException``, as torch's agent has while its workers run, so the process unwinds
instead of dying. A torchrun agent then leaves the interpreter normally and Python runs the
``atexit`` hooks (consul_rdzv.torch leaves from one). A multiprocessing child ends with
``os._exit()``, which skips them, so the victim runs them itself (``atexit._run_exitfuncs()``,
what the interpreter does at exit) and reports over its pipe how long that took.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import logging
import os
import queue
import resource
import signal
import socket
import sys
import threading
import time
import traceback
from collections import Counter
from pathlib import Path

# isort: off
from bench import compare  # before torch: decides which consul_rdzv its registry imports

compare.activate()
# isort: on

# Imported here so that the forkserver preloads them (a fork then costs milliseconds, not the
# seconds of importing torch in every worker of every run).
import torch.distributed as dist
import urllib3
from torch.distributed.elastic.rendezvous import RendezvousParameters, dynamic_rendezvous
from torch.distributed.elastic.rendezvous import api as rdzv_api
from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as c10d_backend
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

import consul_rdzv.torch  # noqa: F401  (loaded by torch's entry point anyway)

try:  # python-etcd is optional (the "bench" extra)
    import etcd  # noqa: F401
    from torch.distributed.elastic.rendezvous import etcd_rendezvous_backend  # noqa: F401
    from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore
except Exception:  # pragma: no cover - recorded by the runner when etcd-v2 is asked for
    EtcdStore = None

_lock = threading.Lock()
_tls = threading.local()
WIRE = Counter()  # HTTP requests of this process, by method
HTTP_TIMES: dict[str, list[float]] = {}  # consul: seconds per request, by endpoint category
#: consul: [requests, bytes sent, bytes received] (HTTP bodies) by endpoint category
HTTP_BYTES: dict[str, list[int]] = {}


def _consul_category(method: str, path: str, params: dict | None) -> str:
    parts = path.split("/")
    if len(parts) > 3 and parts[2] in ("agent", "session"):
        cat = "/".join(parts[2:4])
    else:
        cat = parts[2] if len(parts) > 2 else path
    if params and params.get("index") is not None:
        cat += " (blocking)"
    return f"{method} {cat}"


def _bump(obj, key: str, n: int = 1) -> None:
    with _lock:
        counter = obj.__dict__.get("_bench_ops")
        if counter is None:
            counter = obj.__dict__["_bench_ops"] = Counter()
        counter[key] += n


def install_hooks() -> None:
    if getattr(install_hooks, "done", False):
        return
    install_hooks.done = True

    original_call_store = c10d_backend.C10dRendezvousBackend._call_store

    def _call_store(self, store_op, *args, **kwargs):
        _bump(self, store_op)
        return original_call_store(self, store_op, *args, **kwargs)

    c10d_backend.C10dRendezvousBackend._call_store = _call_store

    original_pm_urlopen = urllib3.PoolManager.urlopen

    def pm_urlopen(self, method, url, redirect=True, **kw):
        tag = "store" if getattr(_tls, "in_store", 0) else "rdzv"
        _bump(self, f"{tag} {method}")
        return original_pm_urlopen(self, method, url, redirect=redirect, **kw)

    urllib3.PoolManager.urlopen = pm_urlopen

    original_cp_urlopen = urllib3.connectionpool.HTTPConnectionPool.urlopen

    def cp_urlopen(self, method, url, *args, **kw):
        with _lock:
            WIRE[method] += 1
        return original_cp_urlopen(self, method, url, *args, **kw)

    urllib3.connectionpool.HTTPConnectionPool.urlopen = cp_urlopen

    if EtcdStore is not None:
        for name in ("set", "get", "add", "wait", "check", "compare_set", "multi_get",
                     "multi_set", "delete_key", "num_keys"):
            fn = getattr(EtcdStore, name, None)
            if fn is None:
                continue

            def tagged(self, *args, __fn=fn, **kwargs):
                _tls.in_store = getattr(_tls, "in_store", 0) + 1
                try:
                    return __fn(self, *args, **kwargs)
                finally:
                    _tls.in_store -= 1

            setattr(EtcdStore, name, tagged)

    original_build = rdzv_api.RendezvousStoreInfo.build

    class _CountingStore:
        def __init__(self, store):
            self._store = store

        def set(self, *args, **kwargs):
            _count_bootstrap()
            return self._store.set(*args, **kwargs)

        def get(self, *args, **kwargs):
            _count_bootstrap()
            return self._store.get(*args, **kwargs)

    def _count_bootstrap():
        node = getattr(_tls, "node", None)
        if node is not None:
            node.bootstrap_ops += 1

    def build(rank, store, local_addr, server_port=None):
        return original_build(rank, _CountingStore(store), local_addr, server_port)

    rdzv_api.RendezvousStoreInfo.build = staticmethod(build)

    def _create_tcp_store_server(self, master_addr, master_port):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", master_port or 0))
        sock.listen(4096)
        port = sock.getsockname()[1]
        return dist.TCPStore(host_name="127.0.0.1", port=port, is_master=True,
                             multi_tenant=True, wait_for_workers=False,
                             master_listen_fd=sock.detach(),
                             timeout=datetime.timedelta(seconds=300))

    dynamic_rendezvous.DynamicRendezvousHandler._create_tcp_store_server = \
        _create_tcp_store_server

    from consul_rdzv import client as consul_client
    from consul_rdzv.client import ConsulClient

    original_request = ConsulClient._request
    own_http = not hasattr(consul_client, "urllib3")  # (else cp_urlopen counts its requests)

    def _request(self, method, path, **kwargs):
        if own_http:
            with _lock:
                WIRE[method] += 1
        t = time.monotonic()
        got = 0
        try:
            resp = original_request(self, method, path, **kwargs)
            got = len(getattr(resp, "content", b"") or b"")
            return resp
        finally:
            cat = _consul_category(method, path, kwargs.get("params"))
            body = kwargs.get("raw")
            if body is None and kwargs.get("body") is not None:
                body = json.dumps(kwargs["body"]).encode()
            with _lock:
                HTTP_TIMES.setdefault(cat, []).append(time.monotonic() - t)
                sizes = HTTP_BYTES.setdefault(cat, [0, 0, 0])
                sizes[0] += 1
                sizes[1] += len(body or b"")
                sizes[2] += got

    ConsulClient._request = _request

    # The consul handler opens its trainer-store TCPStore inside next_rendezvous(): time it.
    import consul_rdzv.torch as consul_torch

    real_tcpstore = consul_torch.TCPStore

    def timed_tcpstore(*args, **kwargs):
        master = args[3] if len(args) > 3 else kwargs.get("is_master", False)
        t = time.monotonic()
        try:
            return real_tcpstore(*args, **kwargs)
        finally:
            cat = "TCPStore server start" if master else "TCPStore client connect"
            with _lock:
                HTTP_TIMES.setdefault(cat, []).append(time.monotonic() - t)

    consul_torch.TCPStore = timed_tcpstore

    # Versions whose RoundResult has no "announced" timing (--compare against an older one):
    # the moment the member write returned, on the node's own thread.
    # (Versions before the runtime split have no consul_rdzv.join: no "announced" moment.)
    try:
        from consul_rdzv import join as consul_join
    except ImportError:
        return

    writer = getattr(getattr(consul_join, "Join", None), "_write_member", None)
    if writer is not None:
        def _write_member(self, *args, **kwargs):
            out = writer(self, *args, **kwargs)
            _tls.announced = time.time()
            return out

        consul_join.Join._write_member = _write_member


class Node:
    """One simulated node: its handler, its thread and what it measured."""

    def __init__(self, idx: int, backend: str, handler) -> None:
        self.idx = idx
        self.backend = backend
        self.handler = handler
        #: Rounds after the first: (phase, monotonic start time or None); None ends the thread.
        self.phases: queue.Queue = queue.Queue()
        self.rejoin = threading.Event()
        self.rejoin_cause = ""
        self.rejoin_at: float | None = None
        self.detected_at: float | None = None
        self.killed = False
        self.bootstrap_ops = 0
        self.infos = []
        self.nnw_calls = 0
        self.nnw_time = 0.0
        self.nnw_errors = 0
        self.nnw_last_error = ""

    # -- identity
    @property
    def name(self) -> str:
        if self.backend == "consul":
            return self.handler.rendezvous.node_id
        return str(self.handler._this_node)

    # -- request counters
    def _ops(self) -> Counter:
        if self.backend == "consul":
            client = self.handler.rendezvous.client
            with client._lock:
                return Counter(client.request_counts)
        if self.backend == "c10d":
            backend = self.handler._state_holder._backend
            return Counter(backend.__dict__.get("_bench_ops") or {})
        http = self.handler._state_holder._backend._client.http
        return Counter(http.__dict__.get("_bench_ops") or {})

    def counts(self) -> Counter:
        return self._ops()

    @staticmethod
    def state_requests(ops: Counter, backend: str) -> int:
        """Requests to the rendezvous state (etcd: without the EtcdStore bootstrap)."""
        if backend == "etcd-v2":
            return sum(v for k, v in ops.items() if k.startswith("rdzv "))
        return sum(ops.values())

    def round_of(self, info) -> int | None:
        if self.backend == "consul":
            return info.result.round
        return self.handler._state_holder.state.round

    def request_round(self, phase: int, cause: str, start_at: float | None = None) -> None:
        """Make this node call ``next_rendezvous()`` again (at ``start_at``, or now)."""
        self.rejoin_cause = cause
        self.rejoin_at = time.monotonic()
        self.rejoin.set()
        self.phases.put((phase, start_at))

    def kill(self) -> None:
        """Thread-mode death: stop this node's heartbeat/keep-alive, no cleanup at all."""
        self.killed = True
        self.phases.put(None)
        if self.backend != "consul":
            self.handler._stop_heartbeats()
            return
        rdzv = self.handler.rendezvous
        if hasattr(rdzv, "halt"):
            rdzv.halt()
            return
        # Older versions (--compare): no halt(); one heartbeat thread, a generation ends the watch.
        with rdzv._lock:
            rdzv._generation += 1
        heartbeat = getattr(rdzv, "_heartbeat", None)
        if heartbeat is not None:
            heartbeat.stop()


def _round(node: Node, phase: int, out) -> None:
    before = node.counts()
    node.bootstrap_ops = 0
    _tls.announced = None
    c0 = time.thread_time()
    t0 = time.monotonic()
    rec = {"type": "result", "idx": node.idx, "phase": phase, "pid": os.getpid(),
           "t_start": t0, "wall_start": time.time(), "cause": node.rejoin_cause,
           "rejoin_at": node.rejoin_at, "detected_at": node.detected_at}
    try:
        info = node.handler.next_rendezvous()
        t1 = time.monotonic()
        rec["wall_end"] = time.time()
        rec["thread_cpu_s"] = time.thread_time() - c0  # this node's thread alone
        node.infos.append(info)  # keep the stores alive
        ops = node.counts() - before
        rec.update(ok=True, t_end=t1, rank=int(info.rank), world=int(info.world_size),
                   round=node.round_of(info),
                   requests=Node.state_requests(ops, node.backend), ops=dict(ops),
                   bootstrap_ops=node.bootstrap_ops)
        bsi = getattr(info, "bootstrap_store_info", None)
        if bsi is not None:
            rec["endpoint"] = f"{bsi.master_addr}:{bsi.master_port}"
        if node.backend == "consul":
            res = info.result
            rec.update(product_requests=res.requests, seal_id=res.seal_id,
                       coordinator=res.coordinator, sealed_wall=res.timings.get("sealed"),
                       first_join_wall=res.timings.get("first_join"),
                       released_wall=res.timings.get("released"),
                       join_started_wall=res.timings.get("join_started"),
                       timings={k: v for k, v in res.timings.items() if v})
            if _tls.announced and "announced" not in rec["timings"]:
                rec["timings"]["announced"] = _tls.announced
    except BaseException as exc:
        rec.update(ok=False, t_end=time.monotonic(),
                   error=f"{type(exc).__name__}: {exc}"[:600])
        logging.getLogger("bench").warning("node %d phase %d failed:\n%s", node.idx, phase,
                                           traceback.format_exc())
    out.put(rec)


PROFILE_ENV = "BENCH_PROFILE_DIR"
"""When set, every node's first round runs under cProfile (thread CPU time) and its stats go to
``$BENCH_PROFILE_DIR/<pid>-<node>.prof``: ``python -m pstats`` or :mod:`pstats` sums them."""


def _node_thread(node: Node, go: threading.Event, start: list[float], out) -> None:
    _tls.node = node
    go.wait()
    delay = start[0] - time.monotonic()  # one instant for every node (bench.run.START_LEAD)
    if delay > 0:
        time.sleep(delay)
    profile_dir = os.environ.get(PROFILE_ENV)
    if profile_dir:  # opt-in: where the first round's client CPU goes, one file per node
        import cProfile  # cProfile profiles the calling thread only, so each node its own

        prof = cProfile.Profile(time.thread_time)
        prof.enable()
        _round(node, 1, out)
        prof.disable()
        prof.dump_stats(os.path.join(profile_dir, f"{os.getpid()}-{node.idx}.prof"))
    else:
        _round(node, 1, out)
    while True:
        item = node.phases.get()
        if item is None or node.killed:
            return
        phase, start_at = item
        if start_at is not None:
            delay = start_at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        _round(node, phase, out)


class Monitor(threading.Thread):
    """torchrun's agent loop: ``num_nodes_waiting()`` on every node every ``interval`` seconds.

    With ``trigger`` set, a node that sees a waiting node re-rendezvouses (as the agent's
    ``_restart_workers`` does). Detections are reported either way.
    """

    def __init__(self, nodes: list[Node], interval: float, trigger: bool, out) -> None:
        super().__init__(name="bench-monitor", daemon=True)
        self.nodes = nodes
        self.interval = interval
        self.trigger = trigger
        self.out = out
        self.stop_event = threading.Event()
        self.ticks = 0
        self.late_ticks = 0

    def run(self) -> None:
        next_tick = time.monotonic()
        while not self.stop_event.is_set():
            for node in self.nodes:
                if node.killed or node.rejoin.is_set():
                    continue
                t = time.monotonic()
                try:
                    waiting = node.handler.num_nodes_waiting()
                except Exception as exc:
                    node.nnw_errors += 1
                    node.nnw_last_error = f"{type(exc).__name__}: {exc}"[:300]
                    waiting = 0
                node.nnw_time += time.monotonic() - t
                node.nnw_calls += 1
                if waiting > 0 and node.detected_at is None:
                    node.detected_at = t
                    self.out.put({"type": "detect", "idx": node.idx, "t": t, "waiting": waiting})
                    if self.trigger:
                        node.request_round(2, "detected")
            self.ticks += 1
            next_tick += self.interval
            delay = next_tick - time.monotonic()
            if delay > 0:
                self.stop_event.wait(delay)
            else:
                self.late_ticks += 1
                next_tick = time.monotonic()


def _train(nodes: list[Node], seconds: float, interval: float, out) -> dict:
    """Training-time load: requests per node while num_nodes_waiting() is polled."""
    live = [n for n in nodes if not n.killed]
    wire0 = sum(WIRE.values())
    before = {n.idx: n.counts() for n in live}
    calls0 = {n.idx: (n.nnw_calls, n.nnw_time) for n in live}
    mon = Monitor(live, interval, False, out)
    t0 = time.monotonic()
    mon.start()
    time.sleep(seconds)
    mon.stop_event.set()
    mon.join()
    elapsed = time.monotonic() - t0
    per_node = []
    for n in live:
        ops = n.counts() - before[n.idx]
        calls = n.nnw_calls - calls0[n.idx][0]
        per_node.append({
            "idx": n.idx, "requests": sum(ops.values()),
            "state_requests": Node.state_requests(ops, n.backend), "ops": dict(ops),
            "nnw_calls": calls,
            "nnw_mean_s": (n.nnw_time - calls0[n.idx][1]) / calls if calls else None,
            "errors": n.nnw_errors, "last_error": n.nnw_last_error,
        })
    # Tight loop on one node: how many requests do 200 back-to-back calls cost?
    probe = None
    if live:
        node = live[0]
        c0 = node.counts()
        t = time.monotonic()
        for _ in range(200):
            node.handler.num_nodes_waiting()
        probe = {"calls": 200, "seconds": time.monotonic() - t,
                 "requests": sum((node.counts() - c0).values())}
    return {"type": "train", "pid": os.getpid(), "seconds": elapsed, "per_node": per_node,
            "wire_requests": sum(WIRE.values()) - wire0, "ticks": mon.ticks,
            "late_ticks": mon.late_ticks, "probe": probe}


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


_THREADS0: dict[int, float] = {}  # CPU seconds per thread id at "ready" (_thread_cpu_mark)
_CPU0 = [0.0]


def _thread_cpu_now() -> dict[int, float]:
    """CPU seconds of each live thread of this process, from /proc (nanoseconds: ``stat``'s
    clock ticks of 10 ms would round a node's few milliseconds to nothing)."""
    now: dict[int, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            ns = Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0]
        except (OSError, IndexError):
            continue
        now[int(tid)] = int(ns) / 1e9
    return now


def _thread_cpu_mark() -> None:
    _THREADS0.clear()
    _THREADS0.update(_thread_cpu_now())
    _CPU0[0] = time.process_time()  # nanoseconds too, ended threads included


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's threads since ``ready`` (:func:`_thread_cpu_mark`), grouped
    by name without the node id (``consul-rdzv-watch``, ``node``, ...): where a loaded worker's
    CPU goes. Threads that ended since are one line, ``(ended threads)``."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    groups: Counter = Counter()
    for tid, sec in _thread_cpu_now().items():
        name = names.get(tid, "(threads of torch/libuv)")
        group = name.rsplit("-n", 1)[0] if name.startswith("consul-rdzv-") else name
        group = group.rstrip("0123456789").rstrip("-") or group
        groups[group] += sec - _THREADS0.get(tid, 0.0)
    groups["(ended threads)"] = max(0.0, time.process_time() - _CPU0[0] - sum(groups.values()))
    return {k: round(v, 4) for k, v in groups.items() if v >= 0.0005}


def main(spec: dict, conn, go_mp, start_mp, out) -> None:
    """Entry point of one worker process (started by the forkserver)."""
    if spec.get("hosts_file"):
        from bench.servers import use_hosts_file

        use_hosts_file(spec["hosts_file"])  # first: the process is still single-threaded
    log = open(spec["log_path"], "a", buffering=1)  # noqa: SIM115 - lives as long as the process
    os.dup2(log.fileno(), 2)
    sys.stderr = log
    logging.basicConfig(level=spec.get("log_level", "WARNING"), stream=log, force=True,
                        format="%(asctime)s %(process)d %(threadName)s %(name)s "
                               "%(levelname)s %(message)s")
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    install_hooks()
    backend = spec["backend"]
    nodes: list[Node] = []
    try:
        for idx in spec["nodes"]:
            conf = dict(spec["conf"])
            if backend == "consul":
                conf["node_id"] = f"n{idx:04d}"
            params = RendezvousParameters(
                backend=backend, endpoint=spec["endpoint"], run_id=spec["run_id"],
                min_nodes=spec["min_nodes"], max_nodes=spec["max_nodes"],
                local_addr="127.0.0.1", **conf)
            nodes.append(Node(idx, backend, get_rendezvous_handler(params)))
    except BaseException as exc:
        out.put({"type": "fatal", "pid": os.getpid(),
                 "error": f"handler creation failed: {type(exc).__name__}: {exc}"[:600]})
        log.write(traceback.format_exc())
        log.flush()
        os._exit(1)

    go = threading.Event()
    start = [0.0]  # the first round's instant, read from start_mp once the release came
    threads = [threading.Thread(target=_node_thread, args=(n, go, start, out), daemon=True,
                                name=f"node-{n.idx}") for n in nodes]
    for t in threads:
        t.start()

    def relay():
        go_mp.wait()
        with _lock:
            HTTP_TIMES.clear()  # latencies of the round only, not of handler creation
            HTTP_BYTES.clear()
        start[0] = start_mp.value
        go.set()

    threading.Thread(target=relay, daemon=True, name="go-relay").start()
    if spec.get("term_victim"):
        signal.signal(signal.SIGTERM, _raise_signal_exception)
    _thread_cpu_mark()
    out.put({"type": "ready", "pid": os.getpid(), "nodes": {n.idx: n.name for n in nodes},
             "cpu": _cpu(), "files": compare.loaded_files() if backend == "consul" else {},
             "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0]})
    try:
        _serve(nodes, conn, out, log)
    except BaseException as exc:
        if not spec.get("term_victim"):
            raise
        _exit_as_an_agent(exc, nodes, conn, log)


def _raise_signal_exception(signum: int, frame) -> None:
    """What torch's agent does on SIGTERM while its workers run (``_terminate_process_handler``)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    sig = signal.Signals(signum)
    raise SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)


def _exit_as_an_agent(exc: BaseException, nodes: list[Node], conn, log) -> None:
    """The SIGTERM victim unwound (``SignalException``): run the atexit hooks as the
    interpreter of a torchrun agent would at exit, tell the runner how long they took, exit."""
    t_caught = time.monotonic()
    error = None
    try:
        atexit._run_exitfuncs()  # consul_rdzv.torch leaves here (older versions: no hook)
    except BaseException as err:  # pragma: no cover - reported
        error = f"{type(err).__name__}: {err}"
    t_done = time.monotonic()
    left = []
    for n in nodes:
        rdzv = getattr(n.handler, "rendezvous", None)
        left.append(bool(getattr(rdzv, "left", False)) if rdzv is not None else None)
    with contextlib.suppress(OSError, BrokenPipeError):
        conn.send({"type": "terminated", "pid": os.getpid(), "exception": type(exc).__name__,
                   "t_caught": t_caught, "t_atexit_done": t_done, "left": left,
                   "error": error})
    log.write(f"{time.strftime('%H:%M:%S')} {os.getpid()} terminated by "
              f"{type(exc).__name__}: {exc}; atexit hooks took {t_done - t_caught:.3f}s; "
              f"left: {left}\n")
    log.flush()
    os._exit(0)


def _serve(nodes: list[Node], conn, out, log) -> None:
    """The runner's commands, until it says exit (or goes away)."""
    by_idx = {n.idx: n for n in nodes}
    monitor: Monitor | None = None
    while True:
        try:
            cmd = conn.recv()
        except EOFError:
            os._exit(0)
        op = cmd[0]
        if op == "exit":
            log.flush()
            os._exit(0)
        elif op == "train":
            out.put(_train(nodes, cmd[1], cmd[2], out))
        elif op == "monitor":
            _, interval, trigger = cmd
            monitor = Monitor([n for n in nodes if not n.killed], interval, trigger, out)
            monitor.start()
        elif op == "kill":
            node = by_idx[cmd[1]]
            node.kill()
            out.put({"type": "killed", "idx": node.idx, "t": time.monotonic()})
        elif op == "rejoin":
            for n in nodes:
                if not n.killed and not n.rejoin.is_set():
                    n.request_round(2, "told")
        elif op == "rounds":  # back-to-back: node idx enters at start + idx * stagger
            _, phase, start, stagger = cmd
            for n in nodes:
                if not n.killed:
                    n.request_round(phase, "back-to-back", start + n.idx * stagger)
        elif op == "cpu":
            with _lock:
                times = {k: list(v) for k, v in HTTP_TIMES.items()}
                HTTP_TIMES.clear()
                sizes = {k: list(v) for k, v in HTTP_BYTES.items()}
                HTTP_BYTES.clear()
            out.put({"type": "cpu", "pid": os.getpid(), "cpu": _cpu(), "http": times,
                     "http_bytes": sizes, "threads": _thread_cpu()})
