"""How to reach Consul: address, token, datacenter and TLS, from arguments or the environment.

This is the one place that reads environment variables (documented in ``docs/configuration.md``).
An explicit argument always wins over the environment; the environment wins over the defaults.

| variable | meaning |
|---|---|
| ``CONSUL_HTTP_ADDR`` | ``host:port`` or ``http(s)://host:port`` (default ``127.0.0.1:8500``) |
| ``CONSUL_HTTP_TOKEN`` / ``CONSUL_HTTP_TOKEN_FILE`` | ACL token, or a file holding it |
| ``CONSUL_HTTP_SSL`` | ``true``: use https when the address names no scheme |
| ``CONSUL_HTTP_SSL_VERIFY`` | ``false``: do not verify the server certificate |
| ``CONSUL_CACERT`` / ``CONSUL_CAPATH`` | CA bundle file / directory to verify the server with |
| ``CONSUL_CLIENT_CERT`` / ``CONSUL_CLIENT_KEY`` | client certificate and key (mTLS) |
| ``CONSUL_TLS_SERVER_NAME`` | name to expect in the server certificate (and send as SNI) |
| ``CONSUL_DATACENTER`` | datacenter to address (the agent's own when unset) |

The torch adapter hands each round to its workers in ``CONSUL_RDZV_*`` variables (set in the
agent's environment before torchrun starts the workers, which inherit it): :func:`round_env`
writes them, :class:`WorkerRound` reads them back (``consul_rdzv.worker``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from .errors import ConsulConfigError

DEFAULT_ADDRESS = "127.0.0.1:8500"

_TRUE = frozenset({"1", "true", "yes", "on", "t", "y"})
_FALSE = frozenset({"0", "false", "no", "off", "f", "n"})


def parse_bool(name: str, value: object) -> bool:
    """The one boolean parser of consul-rdzv (environment variables and ``--rdzv-conf``).

    ``True``/``False`` (and the ints 1/0) as they are; a string must be one of
    1/true/yes/on/t/y or 0/false/no/off/f/n (any case): anything else (``treu``, ``2``, an empty
    string) is a :class:`ConsulConfigError` (a ``ValueError``) naming ``name``.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    text = value.strip().lower() if isinstance(value, str) else None
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConsulConfigError(
        f"{name}={value!r} is not a boolean; use true or false (also accepted: 1/0, yes/no, "
        "on/off, t/f, y/n)."
    )


def _read_token_file(path: str, source: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            token = fh.read().strip()
    except OSError as exc:
        raise ConsulConfigError(
            f"Cannot read the Consul token file {path!r} (from {source}): {exc.strerror}. "
            "Point it at a readable file that holds the ACL token."
        ) from None
    if not token:
        raise ConsulConfigError(f"The Consul token file {path!r} (from {source}) is empty.")
    return token


def _check_file(path: str, what: str, source: str, *, directory: bool = False) -> str:
    ok = os.path.isdir(path) if directory else os.path.isfile(path)
    if not ok:
        kind = "directory" if directory else "file"
        raise ConsulConfigError(
            f"The {what} {kind} {path!r} (from {source}) does not exist. "
            f"Fix the path or unset {source}."
        )
    return path


def normalize_address(address: str, *, use_ssl: bool = False) -> str:
    """Turn ``host:port``, ``host`` or ``http(s)://host:port`` into a base URL."""
    text = address.strip().rstrip("/")
    if not text:
        raise ConsulConfigError("The Consul address is empty; give host:port or http(s)://host:port.")
    if "://" not in text:
        text = ("https://" if use_ssl else "http://") + text
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https"):
        raise ConsulConfigError(
            f"Consul address {address!r} uses scheme {parts.scheme!r}; only http and https are "
            "supported (unix sockets are not)."
        )
    if not parts.hostname:
        raise ConsulConfigError(f"Consul address {address!r} names no host; give host:port.")
    try:
        port = parts.port
    except ValueError:
        raise ConsulConfigError(f"Consul address {address!r} has an invalid port.") from None
    if parts.path not in ("", "/"):
        raise ConsulConfigError(f"Consul address {address!r} has a path; give only host:port.")
    host = parts.hostname
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    if port is None:
        port = 8501 if parts.scheme == "https" else 8500
    elif port == 0:
        raise ConsulConfigError(f"Consul address {address!r} has port 0; give the agent's port.")
    return f"{parts.scheme}://{host}:{port}"


@dataclass(frozen=True)
class ConsulConfig:
    """Resolved client settings. Build it with :meth:`resolve`; the token never shows in repr."""

    url: str = "http://127.0.0.1:8500"
    token: str | None = field(default=None, repr=False)
    datacenter: str | None = None
    verify: bool | str = True
    client_cert: tuple[str, str] | None = None
    tls_server_name: str | None = None

    def __post_init__(self) -> None:
        # An HTTP header cannot carry whitespace or control characters; requests would reject
        # the token on every call with an error that quotes it. Refuse it here without echoing.
        if self.token is not None and any(
            ch.isspace() or not ch.isprintable() or ord(ch) > 0x7E for ch in self.token
        ):
            raise ConsulConfigError(
                "The Consul ACL token contains whitespace, control or non-ASCII characters (a "
                "stray newline from a file?); give the bare token."
            )

    def __repr__(self) -> str:
        return (
            f"ConsulConfig(url={self.url!r}, token={'<set>' if self.token else None}, "
            f"datacenter={self.datacenter!r}, verify={self.verify!r}, "
            f"client_cert={self.client_cert!r}, tls_server_name={self.tls_server_name!r})"
        )

    @classmethod
    def resolve(
        cls,
        address: str | None = None,
        *,
        token: str | None = None,
        token_file: str | None = None,
        datacenter: str | None = None,
        use_ssl: bool | None = None,
        verify: bool | None = None,
        ca_file: str | None = None,
        ca_path: str | None = None,
        client_cert: str | None = None,
        client_key: str | None = None,
        tls_server_name: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ConsulConfig:
        """Explicit arguments first, then ``CONSUL_*`` environment variables, then defaults."""
        env = os.environ if env is None else env

        def pick(explicit, name):
            if explicit is not None and explicit != "":
                return explicit, "argument"
            value = env.get(name)
            if value:
                return value, name
            return None, None

        ssl_value, ssl_src = pick(use_ssl, "CONSUL_HTTP_SSL")
        if isinstance(ssl_value, str):
            ssl_value = parse_bool(ssl_src, ssl_value)
        addr, _ = pick(address, "CONSUL_HTTP_ADDR")
        url = normalize_address(addr or DEFAULT_ADDRESS, use_ssl=bool(ssl_value))

        if token and token.strip():
            resolved_token: str | None = token.strip()
        elif token_file:
            resolved_token = _read_token_file(token_file, "argument token_file")
        elif env.get("CONSUL_HTTP_TOKEN"):
            resolved_token = env["CONSUL_HTTP_TOKEN"].strip()
        elif env.get("CONSUL_HTTP_TOKEN_FILE"):
            resolved_token = _read_token_file(env["CONSUL_HTTP_TOKEN_FILE"],
                                              "CONSUL_HTTP_TOKEN_FILE")
        else:
            resolved_token = None

        dc, _ = pick(datacenter, "CONSUL_DATACENTER")

        verify_value, verify_src = pick(verify, "CONSUL_HTTP_SSL_VERIFY")
        if isinstance(verify_value, str):
            verify_value = parse_bool(verify_src, verify_value)
        resolved_verify: bool | str = True if verify_value is None else bool(verify_value)
        if resolved_verify:
            # An explicit ca_file or ca_path beats both CONSUL_CACERT and CONSUL_CAPATH.
            if ca_file:
                resolved_verify = _check_file(ca_file, "CA certificate", "argument ca_file")
            elif ca_path:
                resolved_verify = _check_file(ca_path, "CA", "argument ca_path", directory=True)
            elif env.get("CONSUL_CACERT"):
                resolved_verify = _check_file(env["CONSUL_CACERT"], "CA certificate",
                                              "CONSUL_CACERT")
            elif env.get("CONSUL_CAPATH"):
                resolved_verify = _check_file(env["CONSUL_CAPATH"], "CA", "CONSUL_CAPATH",
                                              directory=True)

        cert, cert_src = pick(client_cert, "CONSUL_CLIENT_CERT")
        key, key_src = pick(client_key, "CONSUL_CLIENT_KEY")
        if bool(cert) != bool(key):
            raise ConsulConfigError(
                "A client certificate needs both a certificate and a key: set both "
                "CONSUL_CLIENT_CERT and CONSUL_CLIENT_KEY (or the client_cert/client_key "
                "arguments)."
            )
        pair = (
            (_check_file(cert, "client certificate", cert_src),
             _check_file(key, "client key", key_src))
            if cert and key
            else None
        )
        server_name, _ = pick(tls_server_name, "CONSUL_TLS_SERVER_NAME")
        return cls(
            url=url,
            token=resolved_token or None,
            datacenter=dc,
            verify=resolved_verify,
            client_cert=pair,
            tls_server_name=server_name,
        )


# ----------------------------------------------------------------------------- a worker's round

@dataclass(frozen=True)
class WorkerRound:
    """The round a worker process belongs to, as its torchrun agent joined it."""

    run_id: str
    prefix: str  # P = <key_prefix>/<run_id>
    node_id: str
    round: int
    epoch: int  # the round key's ModifyIndex as sealed: grows with every round of the run
    seal_id: str
    config: ConsulConfig

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> WorkerRound:
        """Read the round from ``CONSUL_RDZV_*``; a ConsulConfigError saying what is missing."""
        env = os.environ if env is None else env
        missing = [n for n in ("CONSUL_RDZV_PREFIX", "CONSUL_RDZV_EPOCH", "CONSUL_RDZV_SEAL_ID",
                               "CONSUL_RDZV_ROUND") if not env.get(n)]
        if missing:
            raise ConsulConfigError(
                f"{', '.join(missing)} not set: this process is not a worker started by torchrun "
                "with --rdzv-backend consul (consul-rdzv's torch adapter sets them for the "
                "workers of each round)."
            )
        try:
            round_no, epoch = int(env["CONSUL_RDZV_ROUND"]), int(env["CONSUL_RDZV_EPOCH"])
        except ValueError:
            raise ConsulConfigError(
                f"CONSUL_RDZV_ROUND={env['CONSUL_RDZV_ROUND']!r} / CONSUL_RDZV_EPOCH="
                f"{env['CONSUL_RDZV_EPOCH']!r} are not whole numbers."
            ) from None
        verify = env.get("CONSUL_RDZV_VERIFY", "")
        ca = verify if verify and verify.lower() not in _TRUE | _FALSE else None
        config = ConsulConfig.resolve(
            address=env.get("CONSUL_RDZV_ADDR") or None,
            token_file=env.get("CONSUL_RDZV_TOKEN_FILE") or None,
            datacenter=env.get("CONSUL_RDZV_DATACENTER") or None,
            verify=None if ca or not verify else parse_bool("CONSUL_RDZV_VERIFY", verify),
            ca_file=ca if ca and not os.path.isdir(ca) else None,
            ca_path=ca if ca and os.path.isdir(ca) else None,
            client_cert=env.get("CONSUL_RDZV_CLIENT_CERT") or None,
            client_key=env.get("CONSUL_RDZV_CLIENT_KEY") or None,
            tls_server_name=env.get("CONSUL_RDZV_TLS_SERVER_NAME") or None,
            env=env)
        return cls(run_id=env.get("CONSUL_RDZV_RUN_ID", ""), prefix=env["CONSUL_RDZV_PREFIX"],
                   node_id=env.get("CONSUL_RDZV_NODE_ID", ""), round=round_no, epoch=epoch,
                   seal_id=env["CONSUL_RDZV_SEAL_ID"], config=config)


def round_env(*, run_id: str, prefix: str, node_id: str, round_no: int, epoch: int,
              seal_id: str, config: ConsulConfig, token_file: str | None = None) -> dict[str, str]:
    """The ``CONSUL_RDZV_*`` variables of one round for the workers (never the token itself)."""
    cert, key = config.client_cert or ("", "")
    verify = config.verify if isinstance(config.verify, str) else str(config.verify).lower()
    return {"CONSUL_RDZV_RUN_ID": run_id, "CONSUL_RDZV_PREFIX": prefix,
            "CONSUL_RDZV_NODE_ID": node_id, "CONSUL_RDZV_ROUND": str(round_no),
            "CONSUL_RDZV_EPOCH": str(epoch), "CONSUL_RDZV_SEAL_ID": seal_id,
            "CONSUL_RDZV_ADDR": config.url, "CONSUL_RDZV_DATACENTER": config.datacenter or "",
            "CONSUL_RDZV_VERIFY": verify, "CONSUL_RDZV_CLIENT_CERT": cert,
            "CONSUL_RDZV_CLIENT_KEY": key,
            "CONSUL_RDZV_TLS_SERVER_NAME": config.tls_server_name or "",
            "CONSUL_RDZV_TOKEN_FILE": token_file or ""}
