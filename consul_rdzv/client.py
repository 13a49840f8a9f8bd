"""A thin, typed client for the parts of Consul's HTTP API the rendezvous needs.

Design rules (see docs/consul.md, "Why our own client"):

* Every HTTP call has a timeout. A blocking query's read timeout is ``wait + wait/16 + slack``
  because the server adds up to wait/16 of jitter.
* Consul's answers become typed exceptions in exactly one function, :func:`_raise_for`.
* Retries live in one place, :meth:`ConsulClient._call`: only ``ConsulUnavailableError`` is
  retried, with jittered exponential backoff, until the call's monotonic deadline and at most
  ``retry_timeout`` past its first failure.
* The ACL token travels only in the ``X-Consul-Token`` header; it is never logged or shown.
"""

from __future__ import annotations

import base64
import enum
import json
import logging
import random
import re
import ssl
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .config import ConsulConfig
from .errors import (
    ConsulBadRequest,
    ConsulConfigError,
    ConsulError,
    ConsulNotFound,
    ConsulPermissionDenied,
    ConsulSessionInvalid,
    ConsulTxnConflict,
    ConsulUnavailableError,
    TxnOpError,
)
from .service import DEFAULT_KEY_PREFIX, SERVICE_PREFIX
from .transport import AddressError, Headers, Pool, TLSError, TransportError, tls_context

logger = logging.getLogger(__name__)

#: Consul's limits on one transaction (``/v1/txn``): 64 operations, a 512 KiB body
#: (``txn_max_req_len``); and on one KV value.
MAX_TXN_OPS = 64
MAX_TXN_BYTES = 512 * 1024
MAX_VALUE_BYTES = 512 * 1024

#: Extra read-timeout slack for blocking queries, on top of wait + wait/16.
BLOCKING_SLACK = 5.0


@dataclass(frozen=True)
class KVEntry:
    key: str
    value: bytes | None
    create_index: int
    modify_index: int
    lock_index: int
    flags: int
    session: str | None

    @classmethod
    def from_json(cls, item: dict) -> KVEntry:
        raw = item.get("Value")
        return cls(
            key=item["Key"],
            value=base64.b64decode(raw) if raw is not None else None,
            create_index=int(item.get("CreateIndex", 0)),
            modify_index=int(item.get("ModifyIndex", 0)),
            lock_index=int(item.get("LockIndex", 0)),
            flags=int(item.get("Flags", 0)),
            session=item.get("Session") or None,
        )


@dataclass(frozen=True)
class QueryResult:
    """What a (possibly blocking) read returned, with the ``X-Consul-Index`` to block on next."""

    index: int
    data: Any


class Step(enum.Enum):
    """What one answer of a blocking query did to its index (see :class:`BlockingIndex`)."""

    SAME = "same"  # not past the index we blocked on: nothing under the query changed
    MOVED = "moved"  # past it: something under the query was written or deleted
    RESET = "reset"  # below the last answer of this query: start over, compare data


class BlockingIndex:
    """The index of one blocking query, by Consul's rules ("Blocking Queries", implementation
    details):

    * an answer is not a change: :attr:`Step.MOVED` only says that the index moved forward,
      callers compare data to learn what changed;
    * an answer below the previous answer of *this* query means the index went backwards (a
      snapshot restore, tombstones reaped, a server with less state, an agent that lost its
      state): the index resets to 0 (:attr:`Step.RESET`), the next query does not block, and
      whatever the caller knew must be read again;
    * once a query has answered, an index below 1 is sent as 1 (never a busy loop on 0);
    * an index taken from another query is never compared with this one's answers, with one
      exception the protocol relies on, ``borrowed``: a starting index whose Raft position is
      known (e.g. the index of the member snapshot a round was sealed from). Raft indexes are
      global, and an answer's index is the newest write (or delete) under the query's prefix,
      so the first answer at or below a borrowed index means "nothing under this query was
      written since", not "backwards"; from then on the query's own answers are the baseline.
    """

    def __init__(self, index: int = 0, *, borrowed: bool = False) -> None:
        self.index = max(index, 0)
        self._borrowed = borrowed and self.index > 0
        #: The last answer of this query as Consul gave it (before the "at least 1" rule).
        self._answer: int | None = self.index if self.index and not self._borrowed else None
        #: How often the index went backwards (tests and logs).
        self.resets = 0

    def update(self, returned: int) -> Step:
        """Record an answer's index; what it means for the data the caller holds."""
        returned = max(returned, 0)
        if self._borrowed:
            self._borrowed = False
            step = Step.MOVED if returned > self.index else Step.SAME
        elif self._answer is not None and returned < self._answer:
            self.index = 0
            self._answer = None
            self.resets += 1
            return Step.RESET
        else:
            step = Step.MOVED if returned > (self._answer or 0) else Step.SAME
        self._answer = returned
        self.index = max(returned, 1)
        return step

    def rebase(self, returned: int) -> None:
        """Take a fresh read's index as the baseline (after a reset or a failure: the caller
        read the data again, so nothing is compared)."""
        self._borrowed = False
        self._answer = max(returned, 0)
        self.index = max(returned, 1)

    def reset(self) -> None:
        """Start over: the next query does not block (after a failed query)."""
        self._borrowed = False
        self._answer = None
        self.index = 0

    @property
    def param(self) -> int | None:
        """The ``?index=`` to send: None (do not block) only before the first answer or after a
        reset."""
        return self.index if self.index >= 1 else None


def _duration(seconds: float) -> str:
    ms = max(1, round(seconds * 1000))
    return f"{ms}ms"


_LACKS = re.compile(r"lacks permission '(?P<res>[a-z_]+):(?P<access>[a-z]+)' on \"(?P<on>[^\"]*)\"")

#: Where the least-privilege policy lives (the rules below are its rules, in its words).
ACL_POLICY_FILE = "docs/acl-policy.hcl"
#: Consul's anonymous token: what a request without a token runs as.
_ANONYMOUS_ACCESSOR = "00000000-0000-0000-0000-000000000002"
#: A key of a run: ``<key_prefix>/<run_id>/`` or below it, ``members/<node>`` or ``round/...``.
_RUN_KEY = re.compile(r"^(?P<prefix>.+)/[^/]+/(?:(?:members|round)(?:/[^/]*)?)?$")


def _is_acl_denial(text: str) -> bool:
    lowered = text.lower()
    return "permission denied" in lowered or "acl not found" in lowered


def _reusable_rule(res: str, access: str, on: str) -> tuple[str, str]:
    """The rule of docs/acl-policy.hcl that covers ``res:access`` on ``on`` for every run, and
    what it covers besides ``on``, in words.

    The client does not know the run's key prefix or service name: they are read back from the
    denied resource. A run's keys are ``<key_prefix>/<run_id>/...`` (the prefix is what precedes
    the run id); its service is ``torchelastic-<run_id>`` unless ``service_name`` names one
    service for every run. A session is named after the Consul node of the agent it was created
    on: the exact rule for that node is given, the policy's prefix rule (the node-name prefix
    the job's agents share) is named by the caller.
    """
    if res == "key":
        m = _RUN_KEY.match(on)
        prefix = m.group("prefix") if m else on.split("/", 1)[0]
        return (f'key_prefix "{prefix}/" {{ policy = "write" }}',
                f'the keys of every other run under key_prefix "{prefix}"')
    if res == "service":
        if on.startswith(SERVICE_PREFIX):
            return (f'service_prefix "{SERVICE_PREFIX}" {{ policy = "write" }}',
                    "the service of every other run (service_name defaults to "
                    f"{SERVICE_PREFIX}<run_id>)")
        return (f'service "{on}" {{ policy = "write" }}',
                "every run that uses this service_name")
    if res == "session":
        return (f'session "{on}" {{ policy = "write" }}',
                "nothing else (better: one session_prefix rule with the prefix that the Consul "
                f'node names of all the job\'s agents share, as {ACL_POLICY_FILE} ships it: '
                f'session_prefix "<node-prefix>" {{ policy = "write" }})')
    if res in ("node", "agent", "query", "event"):
        return (f'{res}_prefix "" {{ policy = "{access}" }}', f"every other {res}")
    return (f'{res} = "{access}"', f"all of {res}")


def _acl_hint(text: str) -> str:
    """What to do about a 403 (or a denied transaction operation), after Consul's ``text``.

    A missing permission: the rule to add, in the reusable form docs/acl-policy.hcl ships
    (``key_prefix "torchelastic/"``, not one run's key), and the exact resource denied. An
    unknown token ("ACL not found"): that the token is unknown, not short of a permission.
    """
    if "acl not found" in text.lower():
        return (
            "The token is unknown to this Consul (expired, deleted, or created in another "
            "Consul cluster or datacenter): no permission is missing, the token itself is not "
            "known. Check CONSUL_HTTP_TOKEN / CONSUL_HTTP_TOKEN_FILE (or --rdzv-conf token_file) "
            "and use a token of this cluster, e.g. `consul acl token create -policy-name "
            f"consul-rdzv` with the policy of {ACL_POLICY_FILE}."
        )
    anonymous = _ANONYMOUS_ACCESSOR in text or "anonymous token" in text.lower()
    no_token = ("No token was sent (Consul used its anonymous token): set CONSUL_HTTP_TOKEN or "
                "CONSUL_HTTP_TOKEN_FILE. " if anonymous else "")
    m = _LACKS.search(text)
    if not m:
        return (
            f"{no_token}The token's policy needs the rules of {ACL_POLICY_FILE}: "
            f'key_prefix "{DEFAULT_KEY_PREFIX}/", service_prefix "{SERVICE_PREFIX}" and '
            'session_prefix "<node-prefix>" (the prefix of the Consul node names of the job\'s '
            'agents), each { policy = "write" } (for the default key_prefix and service_name).'
        )
    res, access, on = m.group("res"), m.group("access"), m.group("on")
    rule, covers = _reusable_rule(res, access, on)
    denied = f'sessions on Consul node "{on}"' if res == "session" else f'{res} "{on}"'
    return (
        f"{no_token}Add the rule {rule} to the token's policy: it covers {denied} and "
        f"{covers}. The whole least-privilege policy, and how to adapt it to another "
        f"key_prefix or service_name, is {ACL_POLICY_FILE}."
    )


@dataclass(frozen=True)
class Response:
    """One HTTP answer from Consul, read in full."""

    status_code: int
    headers: Headers  # looked up by any case of the name
    content: bytes
    url: str = ""  # the Consul base URL, for error messages
    what: str = ""  # "METHOD /path"

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    @property
    def from_consul(self) -> bool:
        """Consul sets ``X-Consul-*`` headers on every answer of the API endpoints we call."""
        return any(name.lower().startswith("x-consul-") for name in self.headers)

    def json(self) -> Any:
        try:
            return json.loads(self.content) if self.content else None
        except ValueError:
            raise _not_consul(self.url, self.what, self, "the body is not JSON") from None


def _body_text(resp: Response) -> str:
    text = (resp.text or "").strip()
    return text[:500]


#: Answers a gateway in front of Consul gives while Consul itself is away: transient, retried.
_GATEWAY_STATUSES = (502, 503, 504)


def _not_consul(url: str, what: str, resp: Response, detail: str) -> ConsulConfigError:
    kind = resp.headers.get("Content-Type", "no content type").split(";")[0]
    snippet = " ".join(_body_text(resp).split())[:80]
    return ConsulConfigError(
        f"The server at {url} does not answer like a Consul agent ({what} got HTTP "
        f"{resp.status_code}, {kind}{': ' + repr(snippet) if snippet else ''}; {detail}). Point "
        "--rdzv-endpoint / CONSUL_HTTP_ADDR at the HTTP API of a Consul agent (port 8500 by "
        "default, 8501 for HTTPS).",
        status=resp.status_code,
    )


#: Validation errors that Consul's RPC layer answers with a 500: permanent, not an outage, so
#: they must not be retried (and "Invalid Session TTL" is no invalidated session).
_PERMANENT_500 = re.compile(
    r"Invalid Behavior setting|Session TTL '.*' invalid|Invalid Session TTL|"
    r"Invalid session operation|Must provide (ID|Node)|is in critical state",
    re.IGNORECASE,
)


#: What Consul says of a session that does not exist, in its own words (the state store's
#: ``invalid session "<id>"``, the renew endpoint's ``Session id '<id>' not found``), matched
#: with the quoted id, so that ids in the request (a check or key named "invalid-session")
#: never make another error look like a lost session.
_SESSION_GONE = re.compile(
    r"invalid session \"[^\"]*\"|Session id '[^']*' not found|session \"[^\"]*\" "
    r"(?:does not exist|not found)",
    re.IGNORECASE,
)


def _raise_for(resp: Response, what: str) -> None:
    """Map a Consul HTTP answer onto the ConsulError tree. The one place that does this."""
    status = resp.status_code
    if status < 400:
        return
    text = _body_text(resp)
    if status == 403:
        raise ConsulPermissionDenied(
            f"Consul denied {what}: {text or 'permission denied'}. {_acl_hint(text)}", status=status
        )
    if status == 404:
        if _SESSION_GONE.search(text):
            raise ConsulSessionInvalid(f"{what}: {text}", status=status)
        raise ConsulNotFound(f"{what}: {text or 'not found'}", status=status)
    if status == 409 and what.startswith("PUT /v1/txn"):
        conflict = _txn_conflict(resp)
        denied = next((e for e in conflict.errors if _is_acl_denial(e.what)), None)
        if denied is not None:
            # Consul rolls a transaction back (409) when the token may not do one of its
            # operations: a permission problem, never a conflict that retrying could resolve.
            raise ConsulPermissionDenied(
                f"Consul denied {what} (operation {denied.op_index}): {denied.what}. "
                f"{_acl_hint(denied.what)}", status=status
            )
        raise conflict
    if status >= 500 and _PERMANENT_500.search(text):
        raise ConsulBadRequest(f"Consul rejected {what} ({status}): {text}", status=status)
    if _SESSION_GONE.search(text):
        raise ConsulSessionInvalid(f"{what}: {text}", status=status)
    if status in (400, 405, 409, 413):
        raise ConsulBadRequest(f"Consul rejected {what} ({status}): {text}", status=status)
    if status == 429:
        raise ConsulUnavailableError(f"Consul rate-limited {what} (429): {text}", status=status)
    if status >= 500:
        raise ConsulUnavailableError(f"Consul failed {what} ({status}): {text}", status=status)
    raise ConsulError(f"Unexpected answer to {what} ({status}): {text}", status=status)


def _txn_conflict(resp: Response) -> ConsulTxnConflict:
    try:
        body = resp.json()
    except ValueError:
        return ConsulTxnConflict([TxnOpError(-1, _body_text(resp))])
    errors = [
        TxnOpError(int(e.get("OpIndex", -1)), str(e.get("What", "")))
        for e in (body or {}).get("Errors") or []
    ]
    return ConsulTxnConflict(errors)


def _pool(config: ConsulConfig, maxsize: int) -> Pool:
    """A thread-safe keep-alive pool to the one Consul address of ``config``
    (:mod:`consul_rdzv.transport`: a request at well under half of urllib3's CPU;
    docs/consul.md)."""
    tls = None
    if config.url.startswith("https://"):
        try:
            tls = tls_context(config.verify, config.client_cert)
        except (OSError, ssl.SSLError) as exc:
            raise ConsulConfigError(
                f"Cannot load the TLS files for Consul at {config.url}: {exc}. Check "
                "CONSUL_CACERT/CONSUL_CAPATH and CONSUL_CLIENT_CERT/CONSUL_CLIENT_KEY."
            ) from exc
    return Pool(config.url, maxsize=maxsize, tls=tls, server_name=config.tls_server_name)


#: Characters left as they are in a request path (what requests leaves unquoted).
_PATH_SAFE = "!#$%&'()*+,/:;=?@[]~"


def txn_kv(verb: str, key: str, *, value: bytes | None = None, index: int | None = None,
           session: str | None = None) -> dict:
    """Build one ``KV`` operation for :meth:`ConsulClient.txn`."""
    op: dict[str, Any] = {"Verb": verb, "Key": key}
    if value is not None:
        op["Value"] = base64.b64encode(value).decode("ascii")
    if index is not None:
        op["Index"] = index
    if session is not None:
        op["Session"] = session
    return {"KV": op}


class ConsulClient:
    """Consul HTTP API client. Thread-safe; one per node is the intended use.

    ``retry_timeout`` bounds how long a call keeps retrying transient failures after the first
    one (and is the deadline of a call whose caller passes none). ``timeout`` is the
    connect/read timeout of non-blocking calls.
    """

    def __init__(
        self,
        config: ConsulConfig | None = None,
        *,
        timeout: float = 10.0,
        retry_timeout: float = 30.0,
        pool_size: int = 8,
    ) -> None:
        self.config = config or ConsulConfig.resolve()
        self.timeout = timeout
        self.retry_timeout = retry_timeout
        try:
            self._pool = _pool(self.config, pool_size)
        except AddressError as exc:
            raise ConsulConfigError(f"Invalid Consul URL {self.config.url!r}: {exc}") from exc
        self._headers = {"User-Agent": "consul-rdzv"}
        if self.config.token:
            self._headers["X-Consul-Token"] = self.config.token
        self._lock = threading.Lock()
        self._mine = threading.local()
        self.request_counts: Counter[str] = Counter()
        #: Called once per HTTP request with its path and status code (None: no answer), from
        #: the thread that sent it: the node's metrics (:mod:`consul_rdzv.metrics`) when on.
        self.observer: Callable[[str, int | None], None] | None = None

    def __repr__(self) -> str:
        return f"ConsulClient(url={self.config.url!r})"

    # ------------------------------------------------------------------ plumbing

    @property
    def requests_sent(self) -> int:
        with self._lock:
            return sum(self.request_counts.values())

    @property
    def requests_sent_by_this_thread(self) -> int:
        """Requests made by the calling thread (a join's own cost, without the heartbeats)."""
        return getattr(self._mine, "count", 0)

    def close(self) -> None:
        self._pool.close()

    def _request(self, method: str, path: str, *, params: dict | None = None,
                 body: Any = None, raw: bytes | None = None,
                 read_timeout: float | None = None, ok_404: bool = False) -> Response:
        """One HTTP request. ``read_timeout`` defaults to ``timeout``; the connect timeout is at
        most 5 s and never longer than the read timeout."""
        params = {k: v for k, v in (params or {}).items() if v is not None}
        if self.config.datacenter and "dc" not in params and not path.startswith("/v1/agent/"):
            params["dc"] = self.config.datacenter
        what = f"{method} {path}"
        with self._lock:
            group = path.split("/")[2] if path.count("/") > 1 else path
            self.request_counts[f"{method} {group}"] += 1
        self._mine.count = getattr(self._mine, "count", 0) + 1
        url = urllib.parse.quote(path, safe=_PATH_SAFE)
        if params:
            url += "?" + urllib.parse.urlencode(params)
        if raw is None and body is not None:
            raw = json.dumps(body).encode()
        read = read_timeout or self.timeout
        code: int | None = None
        try:
            answer = self._pool.request(method, url, body=raw, headers=self._headers,
                                        connect_timeout=min(self.timeout, 5.0, read),
                                        read_timeout=read)
            code = answer.status
            resp = Response(answer.status, answer.headers, answer.body, self.config.url, what)
        except TLSError as exc:
            raise ConsulConfigError(
                f"TLS handshake with Consul at {self.config.url} failed for {what}: "
                f"{_short(exc)}. Check CONSUL_CACERT/CONSUL_CAPATH, CONSUL_TLS_SERVER_NAME and "
                "the client certificate (CONSUL_CLIENT_CERT/CONSUL_CLIENT_KEY)."
            ) from exc
        except TransportError as exc:
            raise ConsulUnavailableError(
                f"Consul at {self.config.url} did not answer {what}: {_short(exc)}"
            ) from exc
        finally:
            if self.observer is not None:
                self.observer(path, code)
        if (resp.status_code == 400
                and "Client sent an HTTP request to an HTTPS server" in resp.text):
            raise ConsulConfigError(
                f"Consul at {self.config.url} speaks HTTPS: use an https:// address or set "
                "CONSUL_HTTP_SSL=true."
            )
        if (resp.status_code >= 400 and resp.status_code not in _GATEWAY_STATUSES
                and not resp.from_consul):
            # Consul marks its answers with X-Consul-* headers; an error from a web server that
            # is not Consul (an HTML 404 or 501) must fail at once, not be retried for
            # consul_timeout. (A 200 that is not JSON is caught by Response.json.)
            raise _not_consul(self.config.url, what, resp, "no X-Consul-* header")
        if not (ok_404 and resp.status_code == 404):
            _raise_for(resp, what)
        return resp

    def _call(self, method: str, path: str, *, deadline: float | None = None,
              **kwargs: Any) -> Response:
        """One request, retried on ``ConsulUnavailableError`` with backoff.

        Retries stop at ``deadline`` (default: ``retry_timeout`` from now) and at most
        ``retry_timeout`` after the first failure: an answer that was merely slow (an overloaded
        agent, past the read timeout) still gets retried when the caller's deadline is far. A
        retry of a plain (non-blocking) request waits for its answer no longer than what is
        left of that window (at least 1 s), so a call that fails ends within its read timeout
        plus ``retry_timeout`` (plus that second), however long the agent holds each request.
        """
        if deadline is None:
            deadline = time.monotonic() + self.retry_timeout
        delay = 0.02
        attempt = 0
        first_failure: float | None = None
        plain = kwargs.get("read_timeout") is None  # not a blocking query
        while True:
            attempt += 1
            if first_failure is not None and plain:
                window = min(deadline, first_failure + self.retry_timeout) - time.monotonic()
                kwargs["read_timeout"] = min(self.timeout, max(window, 1.0))
            try:
                return self._request(method, path, **kwargs)
            except ConsulError as exc:
                if not exc.retryable:
                    raise
                now = time.monotonic()
                if first_failure is None:
                    first_failure = now
                remaining = min(deadline, first_failure + self.retry_timeout) - now
                if remaining <= 0:
                    raise
                pause = min(remaining, delay * (0.5 + random.random()))
                logger.debug("Retrying %s %s in %.2fs after attempt %d failed: %s",
                             method, path, pause, attempt, exc)
                time.sleep(pause)
                delay = min(delay * 2, 2.0)

    @staticmethod
    def _index(resp: Response) -> int:
        try:
            return int(resp.headers.get("X-Consul-Index", "0"))
        except ValueError:
            return 0

    @classmethod
    def _result(cls, resp: Response, data: Any) -> QueryResult:
        return QueryResult(cls._index(resp), data)

    def _blocking_params(self, index: int | None, wait: float | None) -> tuple[dict, float]:
        params: dict[str, Any] = {}
        read_timeout = self.timeout
        if index is not None and index >= 1 and wait is not None:
            params["index"] = index
            params["wait"] = _duration(wait)
            read_timeout = wait + wait / 16 + BLOCKING_SLACK
        return params, read_timeout

    # ------------------------------------------------------------------ status / catalog

    def status_leader(self, *, deadline: float | None = None) -> str:
        return self._call("GET", "/v1/status/leader", deadline=deadline).json()

    def catalog_nodes(self, *, deadline: float | None = None) -> list[dict]:
        return self._call("GET", "/v1/catalog/nodes", deadline=deadline).json()

    def catalog_service(self, name: str, *, deadline: float | None = None) -> list[dict]:
        return self._call("GET", f"/v1/catalog/service/{name}", deadline=deadline).json()

    def health_service(self, name: str, *, passing: bool = True, index: int | None = None,
                       wait: float | None = None, deadline: float | None = None) -> QueryResult:
        params, read_timeout = self._blocking_params(index, wait)
        if passing:
            params["passing"] = "true"
        resp = self._call("GET", f"/v1/health/service/{name}", params=params,
                          read_timeout=read_timeout, deadline=deadline)
        return self._result(resp, resp.json())

    # ------------------------------------------------------------------ agent

    def agent_members(self, *, deadline: float | None = None) -> list[dict]:
        """The LAN members as this agent's own gossip sees them (answered by the agent alone:
        it works while the agent is cut off from every server)."""
        return self._call("GET", "/v1/agent/members", deadline=deadline).json()

    def agent_service_register(self, definition: dict, *, replace_existing_checks: bool = True,
                               deadline: float | None = None,
                               timeout: float | None = None) -> None:
        params = {"replace-existing-checks": "true"} if replace_existing_checks else None
        self._call("PUT", "/v1/agent/service/register", params=params, body=definition,
                   deadline=deadline, read_timeout=timeout)

    def agent_service(self, service_id: str, *, deadline: float | None = None,
                      timeout: float | None = None) -> dict | None:
        """This agent's registration of one service instance, or None if it has none."""
        resp = self._call("GET", f"/v1/agent/service/{service_id}", deadline=deadline,
                          read_timeout=timeout, ok_404=True)
        return None if resp.status_code == 404 else resp.json()

    def agent_service_deregister(self, service_id: str, *, deadline: float | None = None) -> None:
        self._call("PUT", f"/v1/agent/service/deregister/{service_id}", deadline=deadline)

    def agent_services(self, *, deadline: float | None = None) -> dict:
        return self._call("GET", "/v1/agent/services", deadline=deadline).json()

    def agent_checks(self, *, deadline: float | None = None) -> dict:
        return self._call("GET", "/v1/agent/checks", deadline=deadline).json()

    def agent_check_update(self, check_id: str, status: str = "pass", note: str = "", *,
                           deadline: float | None = None, timeout: float | None = None) -> None:
        """``status`` is one of pass, warn, fail (TTL checks). ``timeout`` bounds each attempt
        (a heartbeat must never wait longer than its interval for one answer)."""
        if status not in ("pass", "warn", "fail"):
            raise ValueError(f"check status must be pass, warn or fail, not {status!r}")
        self._call("PUT", f"/v1/agent/check/{status}/{check_id}",
                   params={"note": note or None}, deadline=deadline, read_timeout=timeout)

    # ------------------------------------------------------------------ sessions

    def session_create(self, *, name: str, service_checks: Iterable[str] = (),
                       node_checks: Iterable[str] | None = None, behavior: str = "delete",
                       lock_delay: str = "0s", ttl: str | None = None,
                       deadline: float | None = None) -> str:
        """Create a session; retries "Missing check/node registration" while the agent syncs."""
        body: dict[str, Any] = {"Name": name, "Behavior": behavior, "LockDelay": lock_delay}
        checks = [{"ID": c} for c in service_checks]
        if checks:
            body["ServiceChecks"] = checks
        if node_checks is not None:
            body["NodeChecks"] = list(node_checks)
        if ttl:
            body["TTL"] = ttl
        return self._call("PUT", "/v1/session/create", body=body, deadline=deadline).json()["ID"]

    def session_renew(self, session_id: str, *, deadline: float | None = None,
                      timeout: float | None = None) -> dict:
        resp = self._call("PUT", f"/v1/session/renew/{session_id}", deadline=deadline,
                          read_timeout=timeout)
        data = resp.json() or []
        if not data:
            raise ConsulSessionInvalid(f"session {session_id} does not exist")
        return data[0]

    def session_destroy(self, session_id: str, *, deadline: float | None = None) -> None:
        self._call("PUT", f"/v1/session/destroy/{session_id}", deadline=deadline)

    def session_info(self, session_id: str, *, deadline: float | None = None) -> dict | None:
        data = self._call("GET", f"/v1/session/info/{session_id}", deadline=deadline).json()
        return data[0] if data else None

    # ------------------------------------------------------------------ KV

    def kv_get(self, key: str, *, index: int | None = None, wait: float | None = None,
               consistent: bool = False, stale: bool = False,
               deadline: float | None = None) -> QueryResult:
        """One key. ``data`` is a :class:`KVEntry` or None when the key does not exist."""
        params, read_timeout = self._blocking_params(index, wait)
        if consistent:
            params["consistent"] = ""
        if stale:
            params["stale"] = ""
        resp = self._call("GET", f"/v1/kv/{key}", params=params, read_timeout=read_timeout,
                          deadline=deadline, ok_404=True)
        if resp.status_code == 404:
            return self._result(resp, None)
        return self._result(resp, KVEntry.from_json(resp.json()[0]))

    def kv_list(self, prefix: str, *, index: int | None = None, wait: float | None = None,
                consistent: bool = False, stale: bool = False,
                deadline: float | None = None) -> QueryResult:
        """Every key under ``prefix`` (``data`` is a list of :class:`KVEntry`, maybe empty).

        ``stale``: any server may answer (no leader needed; may lag a little)."""
        params, read_timeout = self._blocking_params(index, wait)
        params["recurse"] = ""
        if consistent:
            params["consistent"] = ""
        if stale:
            params["stale"] = ""
        resp = self._call("GET", f"/v1/kv/{prefix}", params=params, read_timeout=read_timeout,
                          deadline=deadline, ok_404=True)
        if resp.status_code == 404:
            return self._result(resp, [])
        return self._result(resp, [KVEntry.from_json(i) for i in resp.json()])

    def kv_keys(self, prefix: str, *, separator: str | None = None,
                deadline: float | None = None) -> list[str]:
        return self.kv_keys_query(prefix, separator=separator, deadline=deadline).data

    def kv_keys_query(self, prefix: str, *, separator: str | None = None,
                      index: int | None = None, wait: float | None = None, stale: bool = False,
                      deadline: float | None = None) -> QueryResult:
        """The key names under ``prefix`` (``data``: list of str), as a possibly blocking query.

        A tenth of a ``kv_list``'s bytes for small values, and nothing to decode: what a watcher
        that only needs to see keys come and go should block on.
        """
        params, read_timeout = self._blocking_params(index, wait)
        params.update(keys="", separator=separator)
        if stale:
            params["stale"] = ""
        resp = self._call("GET", f"/v1/kv/{prefix}", params=params, read_timeout=read_timeout,
                          deadline=deadline, ok_404=True)
        return self._result(resp, [] if resp.status_code == 404 else resp.json())

    def kv_put(self, key: str, value: bytes, *, cas: int | None = None,
               acquire: str | None = None, release: str | None = None,
               flags: int | None = None, deadline: float | None = None) -> bool:
        """Write a key. Returns Consul's true/false (false: CAS or lock not obtained)."""
        if sum(x is not None for x in (cas, acquire, release)) > 1:
            raise ValueError("cas, acquire and release cannot be combined on one write; use txn()")
        _check_value(key, value)
        params = {"cas": cas, "acquire": acquire, "release": release, "flags": flags}
        resp = self._call("PUT", f"/v1/kv/{key}", params=params, raw=value, deadline=deadline)
        return resp.json() is True

    def kv_delete(self, key: str, *, cas: int | None = None, recurse: bool = False,
                  deadline: float | None = None) -> bool:
        params: dict[str, Any] = {"cas": cas}
        if recurse:
            params["recurse"] = ""
        resp = self._call("DELETE", f"/v1/kv/{key}", params=params, deadline=deadline)
        return resp.json() is True

    def txn(self, ops: list[dict], *, deadline: float | None = None) -> QueryResult:
        """Run up to :data:`MAX_TXN_OPS` operations atomically.

        ``data`` is the list of result KV entries (``KVEntry``; None for a non-KV result). It is
        not aligned with ``ops``: Consul returns no result for ``delete*`` and
        ``check-not-exists``, one per entry for ``get-tree``, and one for every other KV verb.
        A rollback raises :class:`ConsulTxnConflict` naming every failed operation.
        """
        if not ops:
            raise ValueError("a transaction needs at least one operation")
        if len(ops) > MAX_TXN_OPS:
            raise ValueError(
                f"a transaction takes at most {MAX_TXN_OPS} operations, not {len(ops)}"
            )
        payload = json.dumps(ops).encode()
        if len(payload) > MAX_TXN_BYTES:
            raise ValueError(f"a transaction is at most {MAX_TXN_BYTES} bytes, not {len(payload)}")
        try:
            resp = self._call("PUT", "/v1/txn", raw=payload, deadline=deadline)
        except ConsulTxnConflict as exc:
            for err in exc.errors:
                if 0 <= err.op_index < len(ops):
                    object.__setattr__(err, "op", ops[err.op_index])
            raise
        body = resp.json() or {}
        results = []
        for item in body.get("Results") or []:
            kv = item.get("KV")
            results.append(KVEntry.from_json(kv) if kv else None)
        return QueryResult(self._index(resp), results)

    def read_with_headers(self, path: str, *, params: dict | None = None,
                          index: int | None = None, wait: float | None = None,
                          deadline: float | None = None) -> tuple[QueryResult, dict[str, str]]:
        """GET any read endpoint, blocking when ``index`` and ``wait`` are given.

        Returns its JSON (None on a 404) with the ``X-Consul-Index``, and Consul's ``X-Consul-*``
        headers (names lower-cased), e.g. ``x-consul-results-filtered-by-acls`` (set only for a
        request that carries a token: the anonymous token's filtered results look empty) and
        ``x-consul-default-acl-policy``. What ``consul-rdzv`` reads the catalog and KV with.
        """
        query, read_timeout = self._blocking_params(index, wait)
        query.update(params or {})
        resp = self._call("GET", path, params=query, read_timeout=read_timeout,
                          deadline=deadline, ok_404=True)
        headers = {k.lower(): v for k, v in resp.headers.items()
                   if k.lower().startswith("x-consul-")}
        data = None if resp.status_code == 404 else resp.json()
        return QueryResult(self._index(resp), data), headers


def _check_value(key: str, value: bytes) -> None:
    if len(value) > MAX_VALUE_BYTES:
        raise ValueError(
            f"value for {key!r} is {len(value)} bytes; Consul allows {MAX_VALUE_BYTES}"
        )


def _short(exc: BaseException) -> str:
    return str(exc)[:300]
