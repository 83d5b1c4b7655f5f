"""The service configuration file: API keys -> tenants and budgets, loaded into frozen dataclasses."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from sluice.config import DEFAULT_API_KEY, ConfigError, load_config


def test_toml_tenants_keys_and_budget_overrides(tmp_path: Path) -> None:
    """Keys map to their tenant, per-tenant caps override the process caps, and the result is frozen."""
    path = tmp_path / "sluice.toml"
    path.write_text('[budgets]\nmax_active_requests = 8\n[tenants.acme]\napi_keys = ["k1", "k2"]\n'
                    'weight = 2\nmax_queue_length = 3\n[tenants.beta]\napi_keys = ["k3"]\n')
    config = load_config(path, env={})
    assert config.tenant_of_key() == {"k1": "acme", "k2": "acme", "k3": "beta"}
    acme = config.tenant("acme")
    assert acme is not None and acme.weight == 2.0
    assert (acme.budgets.max_queue_length, acme.budgets.max_active_requests) == (3, 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.default_model = "x"  # type: ignore[misc]


def test_default_config_and_env_keys() -> None:
    """Without a file the default key works; SLUICE_API_KEYS adds key=tenant pairs."""
    config = load_config(None, env={"SLUICE_API_KEYS": "sk-x=xco, sk-y=yco"})
    assert config.tenant_of_key() == {DEFAULT_API_KEY: "default", "sk-x": "xco", "sk-y": "yco"}


@pytest.mark.parametrize("text, field", [
    ('[tenants.a]\napi_keys = ["k"]\nweight = -1\n', "tenants.a.weight"),
    ('[budgets]\nmax_active_requests = 0\n', "budgets.max_active_requests"),
    ('[tenants.a]\napi_keys = ["k"]\n[tenants.b]\napi_keys = ["k"]\n', "both tenants"),
    ('colour = "red"\n', "colour"),
])
def test_malformed_config_names_the_field(tmp_path: Path, text: str, field: str) -> None:
    """A malformed file raises ConfigError naming the offending field."""
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=field):
        load_config(path, env={})


@pytest.mark.parametrize("text, message", [
    ('[budgets]\nmax_activ_requests = 8\n', "unknown key 'budgets.max_activ_requests'"),
    ('[tenants.a]\napi_keys = ["k"]\nwieght = 2\n', "unknown key 'tenants.a.wieght'"),
    ('budgets = 3\n', "budgets must be a table, got int 3"),
    ('tenants = ["a"]\n', "tenants must be a table"),
    ('[tenants]\na = 1\n', "tenants.a must be a table"),
    ('[tenants.a]\napi_keys = "k"\n', "tenants.a.api_keys must be a list"),
])
def test_unknown_or_mistyped_keys_are_refused_by_name(tmp_path: Path, text: str, message: str) -> None:
    """A misspelt key in any table, or a key of the wrong type, raises a one-line ConfigError naming it."""
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(message)) as raised:
        load_config(path, env={})
    assert "\n" not in str(raised.value)


def test_json_config_of_the_wrong_shape_is_refused_by_name(tmp_path: Path) -> None:
    """A JSON file whose `budgets` is a number (or which is not an object) gets a ConfigError, not a traceback."""
    path = tmp_path / "bad.json"
    path.write_text('{"budgets": 3}')
    with pytest.raises(ConfigError, match="budgets must be a table"):
        load_config(path, env={})
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="the configuration must be a table"):
        load_config(path, env={})
