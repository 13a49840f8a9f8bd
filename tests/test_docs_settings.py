"""docs/configuration.md's tables against the code: every setting, its default, every key.

Pure logic, no Consul: the tables are parsed from the Markdown and compared with
``RendezvousSettings``' defaults, with the keys ``--rdzv-conf`` accepts, and with the keys torch's
c10d backend reads (from torch's own source), so that a default changed in one place only, a key
added to the code but not to the page (or the other way round), or a c10d key the adapter would
refuse, fails here.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from consul_rdzv.settings import (
    CONNECTION_KEYS,
    VALID_KEYS,
    RendezvousSettings,
    settings_from_conf,
)

DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def table_after(heading: str) -> list[list[str]]:
    """The rows (cells, stripped) of the first table after ``heading``, header row excluded."""
    text = DOC.read_text()
    start = text.index(heading)
    rows = []
    for line in text[start:].splitlines()[1:]:
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split(" | ")])
        elif rows:
            break
    assert len(rows) > 2 and set(rows[1][0]) <= set("-|"), rows[:2]
    return rows[2:]


def keys_of(cell: str) -> list[str]:
    """``a``, ``b`` -> [a, b]; a cell in parentheses (``(--rdzv-endpoint)``) names no key."""
    if cell.startswith("("):
        return []
    return re.findall(r"`([a-z_]+)`", cell)


def settings_rows() -> dict[str, str]:
    """key -> its default cell, from the rendezvous settings table."""
    rows = {}
    for cells in table_after("## Rendezvous settings"):
        assert len(cells) == 3, cells
        for key in keys_of(cells[0]):
            assert key not in rows, f"{key} documented twice"
            rows[key] = cells[2]
    return rows


def connection_keys() -> list[str]:
    keys = []
    for cells in table_after("## Reaching Consul"):
        assert len(cells) == 5, cells
        keys += keys_of(cells[0])
    return keys


DEFAULTS = {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
            for f in dataclasses.fields(RendezvousSettings) if f.name != "run_id"}


def parse_default(cell: str):
    """What a default cell says: ``900 s`` -> 900.0, ``5`` (a count) -> 5, ```stable``` ->
    "stable", ``-`` -> None."""
    if m := re.fullmatch(r"(\d+(?:\.\d+)?) s", cell):
        return float(m.group(1))
    if re.fullmatch(r"\d+", cell):
        return int(cell)
    if m := re.fullmatch(r"`([^`]*)`", cell):
        return m.group(1)
    if cell == "-" or cell.startswith("- ("):
        return None
    raise AssertionError(f"default cell {cell!r} is in no known form")


def test_every_key_the_code_accepts_is_documented_and_every_documented_key_is_accepted():
    documented = set(settings_rows()) | set(connection_keys())
    assert documented == set(VALID_KEYS), (
        f"documented, not accepted: {sorted(documented - set(VALID_KEYS))}; "
        f"accepted, not documented: {sorted(set(VALID_KEYS) - documented)}")
    assert set(connection_keys()) == set(CONNECTION_KEYS)


def test_every_settings_field_is_in_the_table_with_the_codes_default():
    rows = settings_rows()
    missing = set(DEFAULTS) - {"min_nodes", "max_nodes"} - set(rows)
    assert not missing, f"settings fields missing from docs/configuration.md: {sorted(missing)}"
    special = {
        # derived defaults, stated as what they derive from
        "keep_alive_interval": ("`heartbeat_timeout` / 3", None),
        "service_name": ("`torchelastic-<run_id>`", None),
        "health_evict": ("`true`", True),
    }
    for name, default in DEFAULTS.items():
        if name in ("min_nodes", "max_nodes"):
            continue  # torchrun's --nnodes
        if name in special:
            cell, value = special[name]
            assert rows[name] == cell and default == value, (name, rows[name], default)
            continue
        said = parse_default(rows[name])
        expected = default if default not in ((), {}) else None
        assert said == expected, f"{name}: docs say {rows[name]!r}, the code {default!r}"
    s = RendezvousSettings(run_id="j")
    assert s.heartbeat_interval == s.heartbeat_timeout / 3
    assert s.service == "torchelastic-j"


def test_timeout_row_states_torchruns_injected_value_and_it_is_our_join_timeout():
    rows = settings_rows()
    assert parse_default(rows["timeout"]) == DEFAULTS["join_timeout"] == 900.0
    # torchrun's injected value changes nothing: the same wait as without it
    assert settings_from_conf("j", 1, 1, {"timeout": 900}).join_timeout == DEFAULTS["join_timeout"]


def test_the_figures_quoted_for_the_defaults_match_the_defaults():
    text = DOC.read_text()
    ttl, patience = DEFAULTS["heartbeat_timeout"], DEFAULTS["consul_timeout"]
    assert f"Hence the defaults, {ttl:g} s and {patience:g} s." in text


def _torch_c10d_keys() -> set[str]:
    """Every --rdzv-conf key torch's c10d backend reads (its handler and its backend)."""
    import torch.distributed.elastic.rendezvous as rdzv

    base = Path(rdzv.__file__).parent
    keys: set[str] = set()
    for name in ("dynamic_rendezvous.py", "c10d_rendezvous_backend.py"):
        source = (base / name).read_text()
        keys |= set(re.findall(r'params\.get(?:_as_\w+)?\(\s*"(\w+)"', source))
        keys |= {f"{k}_timeout" for k in re.findall(r'_get_timeout\(params, "(\w+)"\)', source)}
    return keys


def test_every_key_torchs_c10d_backend_reads_is_accepted():
    c10d = _torch_c10d_keys()
    assert {"join_timeout", "keep_alive_interval", "keep_alive_max_attempt", "read_timeout",
            "is_host", "store_type"} <= c10d, c10d  # the parse found them
    assert c10d <= set(VALID_KEYS), sorted(c10d - set(VALID_KEYS))
    documented = (DOC.read_text().split("### c10d's keys", 1)[1]
                  .split("## Choosing", 1)[0])
    for key in c10d:
        assert f"`{key}`" in documented, f"c10d's {key} is not in the c10d section"


@pytest.mark.parametrize("key", sorted(VALID_KEYS))
def test_each_documented_key_is_accepted_with_a_plausible_value(key):
    value = {"ssl": "true", "verify": "false", "use_libuv": "true", "is_host": "false",
             "store_type": "tcp", "store_port": "29400-29401", "rank_policy": "stable",
             "topology_keys": "zone", "node_meta": "zone=a", "node_rank": "0",
             "keep_alive_max_attempt": "3", "keep_alive_interval": "5",
             "closed_retention": "600", "watch_wait": "30", "history_retention": "3600",
             "storm_rounds": "5", "storm_window": "600", "storm_min_round": "60",
             "key_prefix": "p", "service_name": "s", "metrics_port": "0",
             "metrics_host": "127.0.0.1", "health_evict": "false",
             "health_checks": "gpu-*", "quarantine_failures": "3",
             "quarantine_window": "600", "quarantine_cooldown": "300",
             "quarantine_cooldown_max": "3600"}.get(key, "7" if key.endswith("timeout") else "x")
    # metrics_host only goes with metrics_port (alone it is refused: nothing would listen)
    extra = {"metrics_port": "0"} if key == "metrics_host" else {}
    settings_from_conf("j", 1, 1, {key: value, **extra})
