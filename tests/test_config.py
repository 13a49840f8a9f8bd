"""ConsulConfig.resolve: explicit arguments beat CONSUL_* variables, which beat the defaults.

Pure logic (the ``env=`` argument stands in for the environment), except the last tests, which
check that a client resolved from the real process environment talks to the agent it names.
"""

from __future__ import annotations

import os

import pytest

from consul_rdzv.client import ConsulClient
from consul_rdzv.config import ConsulConfig, normalize_address
from consul_rdzv.errors import ConsulConfigError, ConsulUnavailableError

TOKEN = "6f1c2b7e-0d1a-4c55-9e0b-6b3f9a1d2c4e"
OTHER_TOKEN = "0a9b8c7d-1111-4222-8333-944455556666"


@pytest.fixture
def files(tmp_path):
    """Two of each file kind the config checks for existence (contents do not matter here)."""
    paths = {}
    for name in ("ca1.pem", "ca2.pem", "cert1.pem", "key1.pem", "cert2.pem", "key2.pem"):
        path = tmp_path / name
        path.write_text("dummy\n")
        paths[name.split(".")[0]] = str(path)
    for name in ("capath1", "capath2"):
        (tmp_path / name).mkdir()
        paths[name] = str(tmp_path / name)
    return paths


def resolve(env=None, **kwargs) -> ConsulConfig:
    return ConsulConfig.resolve(env=env or {}, **kwargs)


# ----------------------------------------------------------------------------- defaults


def test_resolve_returns_defaults_if_nothing_is_set():
    cfg = resolve()
    assert cfg.url == "http://127.0.0.1:8500"
    assert cfg.token is None
    assert cfg.datacenter is None
    assert cfg.verify is True
    assert cfg.client_cert is None
    assert cfg.tls_server_name is None


# ----------------------------------------------------------------------------- explicit beats env


def test_resolve_prefers_argument_address_if_env_also_sets_one():
    cfg = resolve({"CONSUL_HTTP_ADDR": "10.0.0.1:9000"}, address="10.0.0.2:9100")
    assert cfg.url == "http://10.0.0.2:9100"


def test_resolve_prefers_argument_token_if_env_sets_token_and_token_file(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(OTHER_TOKEN)
    env = {"CONSUL_HTTP_TOKEN": OTHER_TOKEN, "CONSUL_HTTP_TOKEN_FILE": str(token_file)}
    assert resolve(env, token=TOKEN).token == TOKEN


def test_resolve_prefers_argument_token_file_if_env_sets_a_token(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    cfg = resolve({"CONSUL_HTTP_TOKEN": OTHER_TOKEN}, token_file=str(token_file))
    assert cfg.token == TOKEN


def test_resolve_prefers_env_token_if_env_also_sets_token_file(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(OTHER_TOKEN)
    env = {"CONSUL_HTTP_TOKEN": TOKEN, "CONSUL_HTTP_TOKEN_FILE": str(token_file)}
    assert resolve(env).token == TOKEN


def test_resolve_prefers_argument_datacenter_if_env_sets_one():
    assert resolve({"CONSUL_DATACENTER": "dc-env"}, datacenter="dc-arg").datacenter == "dc-arg"
    assert resolve({"CONSUL_DATACENTER": "dc-env"}).datacenter == "dc-env"


def test_resolve_prefers_argument_ca_file_if_env_sets_cacert_and_capath(files):
    env = {"CONSUL_CACERT": files["ca2"], "CONSUL_CAPATH": files["capath2"]}
    assert resolve(env, ca_file=files["ca1"]).verify == files["ca1"]


def test_resolve_prefers_argument_ca_path_if_env_sets_cacert(files):
    cfg = resolve({"CONSUL_CACERT": files["ca2"]}, ca_path=files["capath1"])
    assert cfg.verify == files["capath1"]


def test_resolve_prefers_env_cacert_if_env_also_sets_capath(files):
    env = {"CONSUL_CACERT": files["ca2"], "CONSUL_CAPATH": files["capath2"]}
    assert resolve(env).verify == files["ca2"]


def test_resolve_prefers_argument_client_cert_if_env_sets_one(files):
    env = {"CONSUL_CLIENT_CERT": files["cert2"], "CONSUL_CLIENT_KEY": files["key2"]}
    cfg = resolve(env, client_cert=files["cert1"], client_key=files["key1"])
    assert cfg.client_cert == (files["cert1"], files["key1"])
    assert resolve(env).client_cert == (files["cert2"], files["key2"])


def test_resolve_prefers_argument_server_name_if_env_sets_one():
    env = {"CONSUL_TLS_SERVER_NAME": "env.example"}
    assert resolve(env, tls_server_name="arg.example").tls_server_name == "arg.example"
    assert resolve(env).tls_server_name == "env.example"


def test_resolve_prefers_argument_use_ssl_false_if_env_says_ssl_true():
    cfg = resolve({"CONSUL_HTTP_SSL": "true"}, address="127.0.0.1:8500", use_ssl=False)
    assert cfg.url == "http://127.0.0.1:8500"


def test_resolve_prefers_argument_verify_true_if_env_disables_verify():
    assert resolve({"CONSUL_HTTP_SSL_VERIFY": "false"}, verify=True).verify is True


# ----------------------------------------------------------------------------- addresses


@pytest.mark.parametrize(
    ("value", "url"),
    [
        ("10.1.2.3:8600", "http://10.1.2.3:8600"),
        ("http://10.1.2.3:8600", "http://10.1.2.3:8600"),
        ("https://10.1.2.3:8600", "https://10.1.2.3:8600"),
        ("https://consul.example/", "https://consul.example:8501"),
        ("consul.example", "http://consul.example:8500"),
        ("http://consul.example", "http://consul.example:8500"),
        ("[::1]:8600", "http://[::1]:8600"),
        ("http://[fe80::1]", "http://[fe80::1]:8500"),
        ("https://[::1]", "https://[::1]:8501"),
        ("  10.1.2.3:8600  ", "http://10.1.2.3:8600"),
    ],
)
def test_resolve_normalizes_env_address_if_given_with_or_without_scheme(value, url):
    assert resolve({"CONSUL_HTTP_ADDR": value}).url == url


def test_resolve_uses_https_for_bare_address_if_consul_http_ssl_is_true():
    env = {"CONSUL_HTTP_ADDR": "10.1.2.3:8600", "CONSUL_HTTP_SSL": "true"}
    assert resolve(env).url == "https://10.1.2.3:8600"


def test_resolve_defaults_to_port_8501_if_ssl_and_no_port():
    env = {"CONSUL_HTTP_ADDR": "consul.example", "CONSUL_HTTP_SSL": "1"}
    assert resolve(env).url == "https://consul.example:8501"


def test_resolve_keeps_explicit_http_scheme_if_consul_http_ssl_is_true():
    env = {"CONSUL_HTTP_ADDR": "http://10.1.2.3:8600", "CONSUL_HTTP_SSL": "true"}
    assert resolve(env).url == "http://10.1.2.3:8600"


@pytest.mark.parametrize("value", ["unix:///var/run/consul.sock", "ftp://10.0.0.1:21"])
def test_resolve_raises_config_error_if_scheme_is_not_http(value):
    with pytest.raises(ConsulConfigError, match=r"only http and https are supported"):
        resolve({"CONSUL_HTTP_ADDR": value})


@pytest.mark.parametrize("value", ["10.0.0.1:notaport", "10.0.0.1:99999", "http://10.0.0.1:0"])
def test_resolve_raises_config_error_if_port_is_invalid(value):
    with pytest.raises(ConsulConfigError, match=r"port") as info:
        resolve({"CONSUL_HTTP_ADDR": value})
    assert value in str(info.value)


@pytest.mark.parametrize("value", ["http://10.0.0.1:8500/v1", "http://:8500", "   "])
def test_normalize_address_raises_config_error_if_path_or_host_is_wrong(value):
    with pytest.raises(ConsulConfigError, match=r"path|host|empty"):
        normalize_address(value)


def test_config_error_is_also_a_value_error():
    with pytest.raises(ValueError):
        resolve({"CONSUL_HTTP_ADDR": "unix:///tmp/sock"})


# ----------------------------------------------------------------------------- tokens


def test_resolve_reads_and_strips_token_file_if_env_names_one(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(f"  {TOKEN}\n\n")
    assert resolve({"CONSUL_HTTP_TOKEN_FILE": str(token_file)}).token == TOKEN


def test_resolve_raises_config_error_if_token_file_is_missing(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(ConsulConfigError, match="CONSUL_HTTP_TOKEN_FILE") as info:
        resolve({"CONSUL_HTTP_TOKEN_FILE": missing})
    assert missing in str(info.value)


def test_resolve_raises_config_error_if_token_file_is_empty(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(" \n")
    with pytest.raises(ConsulConfigError, match="is empty"):
        resolve(token_file=str(token_file))


def test_resolve_strips_env_and_argument_tokens_if_they_carry_whitespace():
    assert resolve({"CONSUL_HTTP_TOKEN": f" {TOKEN}\n"}).token == TOKEN
    assert resolve(token=f"{TOKEN}\n").token == TOKEN


@pytest.mark.parametrize("bad", [f"{TOKEN[:8]}\n{TOKEN[9:]}", f"{TOKEN[:8]} {TOKEN[9:]}",
                                 f"{TOKEN}\x00", f"{TOKEN}\u00e9"])
def test_resolve_raises_config_error_without_echo_if_token_has_bad_characters(bad):
    with pytest.raises(ConsulConfigError, match="token") as info:
        resolve(token=bad)
    assert TOKEN[:8] not in str(info.value)
    assert TOKEN[9:] not in str(info.value)


def test_resolve_treats_blank_argument_token_as_unset_if_env_sets_one():
    assert resolve({"CONSUL_HTTP_TOKEN": TOKEN}, token="").token == TOKEN
    assert resolve({"CONSUL_HTTP_TOKEN": TOKEN}, token="  ").token == TOKEN


def test_repr_hides_token_if_token_is_set():
    cfg = resolve(token=TOKEN)
    assert TOKEN not in repr(cfg)
    assert TOKEN not in str(cfg)
    assert "token=<set>" in repr(cfg)


# ----------------------------------------------------------------------------- TLS


def test_resolve_disables_verification_if_ssl_verify_is_false(files):
    env = {"CONSUL_HTTP_SSL_VERIFY": "false", "CONSUL_CACERT": files["ca1"]}
    assert resolve(env).verify is False
    assert resolve(verify=False, ca_file=files["ca1"]).verify is False


def test_resolve_uses_capath_directory_if_env_names_one(files):
    assert resolve({"CONSUL_CAPATH": files["capath1"]}).verify == files["capath1"]


def test_resolve_raises_config_error_if_capath_is_a_file(files):
    with pytest.raises(ConsulConfigError, match=r"CONSUL_CAPATH") as info:
        resolve({"CONSUL_CAPATH": files["ca1"]})
    assert "directory" in str(info.value)


def test_resolve_raises_config_error_if_cacert_is_missing(tmp_path):
    missing = str(tmp_path / "ca.pem")
    with pytest.raises(ConsulConfigError, match="CONSUL_CACERT") as info:
        resolve({"CONSUL_CACERT": missing})
    assert missing in str(info.value)


def test_resolve_raises_config_error_if_cert_has_no_key(files):
    with pytest.raises(ConsulConfigError, match="CONSUL_CLIENT_KEY"):
        resolve({"CONSUL_CLIENT_CERT": files["cert1"]})
    with pytest.raises(ConsulConfigError, match="both a certificate and a key"):
        resolve(client_key=files["key1"])


def test_resolve_raises_config_error_if_client_key_file_is_missing(files, tmp_path):
    env = {"CONSUL_CLIENT_CERT": files["cert1"], "CONSUL_CLIENT_KEY": str(tmp_path / "k.pem")}
    with pytest.raises(ConsulConfigError, match="CONSUL_CLIENT_KEY"):
        resolve(env)


@pytest.mark.parametrize("name", ["CONSUL_HTTP_SSL", "CONSUL_HTTP_SSL_VERIFY"])
def test_resolve_raises_config_error_if_boolean_is_not_one(name):
    with pytest.raises(ConsulConfigError, match=rf"{name}='maybe' is not a boolean"):
        resolve({name: "maybe"})


@pytest.mark.parametrize(("text", "url"), [("TRUE", "https"), ("yes", "https"), ("0", "http"),
                                           ("off", "http")])
def test_resolve_parses_boolean_spellings_if_ssl_is_set(text, url):
    assert resolve({"CONSUL_HTTP_ADDR": "h:1", "CONSUL_HTTP_SSL": text}).url == f"{url}://h:1"


# ----------------------------------------------------------------------------- the real environment


def test_resolve_reads_process_environment_if_env_argument_is_none(monkeypatch):
    monkeypatch.setenv("CONSUL_HTTP_ADDR", "https://10.9.8.7:1234")
    monkeypatch.setenv("CONSUL_DATACENTER", "dc-x")
    cfg = ConsulConfig.resolve()
    assert (cfg.url, cfg.datacenter) == ("https://10.9.8.7:1234", "dc-x")


def test_client_from_env_talks_to_agent_if_consul_http_addr_points_at_it(agent):
    assert os.environ["CONSUL_HTTP_ADDR"] == agent.address
    client = ConsulClient()  # ConsulConfig.resolve() from the process environment
    try:
        assert client.config.url == agent.url
        nodes = client.catalog_nodes()
        assert agent.node_name in {n["Node"] for n in nodes}
    finally:
        client.close()


def test_client_from_env_is_unavailable_if_env_points_nowhere():
    client = ConsulClient(retry_timeout=0.2)  # conftest points CONSUL_HTTP_ADDR at a dead port
    try:
        with pytest.raises(ConsulUnavailableError, match=r"127\.0\.0\.1:9\b"):
            client.status_leader()
    finally:
        client.close()
