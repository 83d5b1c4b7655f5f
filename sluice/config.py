"""Service configuration: API keys -> tenants, per-tenant budgets, global budgets.

Loaded once at start from a TOML or JSON file, then environment, then flags, into frozen
dataclasses that are never mutated. The file format (docs/usage.md has the full example):

```toml
default_model = "tiny"
ttft_slo_s = 2.0               # optional: refuse early a request the router predicts would miss it

[budgets]                      # whole admission process
max_active_requests = 256
max_pending_input_tokens = 262144
max_reserved_output_tokens = 262144
max_queue_length = 1024
# max_reserved_kv_blocks = 65536   # optional: KV blocks reserved at admission (shared prefix blocks once)

[reservation]                  # how much output an admitted request reserves (docs/routing-and-admission.md)
policy = "predicted"           # conservative (max_tokens, the default) | predicted
percentile = 0.95              # of the last `window` output lengths of the tenant and model
window = 1000
min_samples = 50               # conservative until this many completions were seen
growth_factor = 2.0            # a request that outruns its reservation grows it by this factor

[tenants.acme]
api_keys = ["sk-acme-1"]
weight = 2.0
max_active_requests = 32       # any budget field may be overridden per tenant

[tenants.beta]
api_keys = ["sk-beta-1"]
```

Every key of every table is checked: an unknown key (a typo) or a value of the wrong type is a
ConfigError naming it, never silently ignored.

With no file, one tenant "default" with the key `DEFAULT_API_KEY` exists, so a fresh
`sluice up` works out of the box. `SLUICE_API_KEYS="key1=tenantA,key2=tenantB"` adds keys.
"""

from __future__ import annotations

import enum
import json
import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

DEFAULT_API_KEY = "sk-sluice-local"
DEFAULT_TENANT = "default"


class ConfigError(ValueError):
    """The configuration file or environment is malformed; the message names the field."""


@dataclass(frozen=True)
class Budgets:
    """Admission limits; a request that would exceed one is RESOURCE_EXHAUSTED with RetryInfo."""

    max_active_requests: int = 256
    """Requests admitted and not yet terminal."""
    max_pending_input_tokens: int = 1 << 18
    """Prompt tokens of admitted requests that have not finished."""
    max_reserved_output_tokens: int = 1 << 18
    """Output tokens reserved (max_tokens) by admitted requests that have not finished."""
    max_queue_length: int = 1024
    """Admitted requests that have not produced their first token yet."""
    max_reserved_kv_blocks: int | None = None
    """KV blocks reserved by admitted requests (prompt blocks shared by several requests counted once, plus
    each one's own tail and reserved output); None: no KV-block budget at admission."""
    max_queued_requests: int | None = None
    """Requests over a budget that wait at the front door for room (per tenant, in arrival order) instead of an
    immediate RESOURCE_EXHAUSTED; one more is refused at once. None: none wait (backpressure to the client)."""
    queue_timeout_s: int = 30
    """Seconds a request waits at the front door for room before it is RESOURCE_EXHAUSTED after all."""


class ReservationPolicy(enum.Enum):
    """How many output tokens an admitted request reserves (admission_svc/reservations.py has the classes)."""

    CONSERVATIVE = "conservative"
    """Its whole max_tokens: never outrun, often far more than it uses."""
    PREDICTED = "predicted"
    """A high percentile of the recent output lengths of its tenant and model, grown when outrun."""


@dataclass(frozen=True)
class ReservationConfig:
    """Admission's reservation policy and its prediction settings."""

    policy: ReservationPolicy = ReservationPolicy.CONSERVATIVE
    """Which policy reserves output tokens."""
    percentile: float = 0.95
    """The predicted policy reserves this quantile (0 < p <= 1) of the observed output lengths."""
    window: int = 1000
    """Completions remembered per (tenant, model): a sliding window, so the prediction follows drift."""
    min_samples: int = 50
    """Fewer completions than this: reserve max_tokens (conservative) until enough are seen."""
    growth_factor: float = 2.0
    """A request that outruns its reservation grows it to max(generated, reserved x this), at most max_tokens."""


@dataclass(frozen=True)
class TenantConfig:
    """One tenant: its keys, its fair-share weight and its own caps (the one tenant type of every component)."""

    name: str
    """Tenant name (appears in traces, metrics and completions)."""
    api_keys: tuple[str, ...] = ()
    """Keys that authenticate as this tenant (`authorization: Bearer <key>`)."""
    weight: float = 1.0
    """Fair-share weight (a tenant of weight 2 gets twice the service under contention)."""
    budgets: Budgets | None = None
    """This tenant's caps (the process-wide caps apply as well); None: only the process-wide caps."""
    cache_salt: str = ""
    """A secret mixed into this tenant's prefix-cache block hashes: its prompts then share cached blocks with
    no other tenant (no timing side channel); "": share with every tenant of the model (docs/security.md)."""


@dataclass(frozen=True)
class ServiceConfig:
    """Everything the admission service reads at start; never mutated."""

    tenants: tuple[TenantConfig, ...] = ()
    """All tenants; every API key belongs to exactly one."""
    budgets: Budgets = field(default_factory=Budgets)
    """Process-wide caps."""
    default_model: str = "tiny"
    """Model used when a request leaves `model` empty."""
    reservation: ReservationConfig = field(default_factory=ReservationConfig)
    """How admitted requests reserve output tokens."""
    ttft_slo_s: float | None = None
    """Refuse early (RESOURCE_EXHAUSTED + RetryInfo) a request whose predicted TTFT exceeds this; None: off."""

    def tenant_of_key(self) -> dict[str, str]:
        """Return the map API key -> tenant name."""
        return {key: tenant.name for tenant in self.tenants for key in tenant.api_keys}

    def tenant(self, name: str) -> TenantConfig | None:
        """Return the tenant of that name, or None."""
        return next((t for t in self.tenants if t.name == name), None)


_BUDGET_KEYS = frozenset(f.name for f in fields(Budgets))
_TENANT_KEYS = frozenset({"api_keys", "weight", "cache_salt"}) | _BUDGET_KEYS
_TOP_KEYS = frozenset({"budgets", "tenants", "default_model", "reservation", "ttft_slo_s"})
_RESERVATION_KEYS = frozenset(f.name for f in fields(ReservationConfig))


def _table(raw: object, where: str, known: frozenset[str] | None = None) -> Mapping[str, Any]:
    """Return `raw` checked to be a table whose keys are all in `known` (None: any key); raises ConfigError."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where or 'the configuration'} must be a table, got {type(raw).__name__} {raw!r}")
    for key in raw:
        if known is not None and key not in known:
            raise ConfigError(f"unknown key {_dotted(where, key)!r}; known: {', '.join(sorted(known))}")
    return raw


def _dotted(where: str, key: str) -> str:
    return f"{where}.{key}" if where else str(key)


def _budgets(raw: Mapping[str, Any], base: Budgets, where: str) -> Budgets:
    values: dict[str, int] = {}
    for key, value in raw.items():
        if key not in _BUDGET_KEYS:
            continue  # the caller checked the keys of its table
        if not _positive(value, int):
            raise ConfigError(f"{where}.{key} must be a positive integer, got {value!r}")
        values[key] = value
    return replace(base, **values)


def _positive(value: object, kind: type) -> bool:
    """True for a finite number > 0 of `kind` (int: an int; float: an int or a float), never a bool."""
    if isinstance(value, bool) or not isinstance(value, int | float if kind is float else int):
        return False
    return 0 < value < math.inf


def _reservation(raw: object) -> ReservationConfig:
    """Return the [reservation] table as a ReservationConfig; raises ConfigError naming the bad key."""
    table = _table(raw, "reservation", _RESERVATION_KEYS)
    base = ReservationConfig()
    policy = table.get("policy", base.policy.value)
    known = [p.value for p in ReservationPolicy]
    if policy not in known:
        raise ConfigError(f"reservation.policy {policy!r} is unknown; known: {', '.join(known)}")
    numbers: dict[str, Any] = {}
    for key, kind in (("percentile", float), ("window", int), ("min_samples", int), ("growth_factor", float)):
        value = table.get(key, getattr(base, key))
        if not _positive(value, kind):
            raise ConfigError(f"reservation.{key} must be a positive {kind.__name__}, got {value!r}")
        numbers[key] = kind(value)
    config = ReservationConfig(ReservationPolicy(policy), **numbers)
    if config.percentile > 1 or config.growth_factor <= 1:
        raise ConfigError(f"reservation.percentile must be in (0, 1] and growth_factor > 1, got "
                          f"{config.percentile} and {config.growth_factor}")
    return config


def _tenant(name: str, raw: object, base: Budgets) -> TenantConfig:
    where = f"tenants.{name}"
    table = _table(raw, where, _TENANT_KEYS)
    keys = table.get("api_keys", [])
    if not isinstance(keys, list) or not all(isinstance(k, str) and k for k in keys):
        raise ConfigError(f"{where}.api_keys must be a list of non-empty strings, got {keys!r}")
    weight = table.get("weight", 1.0)
    if not isinstance(weight, int | float) or isinstance(weight, bool) or not 0 < weight < float("inf"):
        raise ConfigError(f"{where}.weight must be a positive number, got {weight!r}")
    budgets = _budgets(table, base, where) if _BUDGET_KEYS & set(table) else None
    salt = table.get("cache_salt", "")
    if not isinstance(salt, str):
        raise ConfigError(f"{where}.cache_salt must be a string, got {type(salt).__name__}")
    return TenantConfig(name, tuple(keys), float(weight), budgets, salt)


def parse_config(raw: Mapping[str, Any]) -> ServiceConfig:
    """Return the ServiceConfig for a parsed file; raises ConfigError naming the bad or unknown key."""
    _table(raw, "", _TOP_KEYS)
    budgets = _budgets(_table(raw.get("budgets", {}), "budgets", _BUDGET_KEYS), Budgets(), "budgets")
    tenants_raw = _table(raw.get("tenants", {}), "tenants")
    tenants = tuple(_tenant(name, spec, budgets) for name, spec in tenants_raw.items())
    default_model = raw.get("default_model", "tiny")
    if not isinstance(default_model, str) or not default_model:
        raise ConfigError(f"default_model must be a non-empty string, got {default_model!r}")
    ttft_slo_s = raw.get("ttft_slo_s")
    if ttft_slo_s is not None and not _positive(ttft_slo_s, float):
        raise ConfigError(f"ttft_slo_s must be a positive number of seconds, got {ttft_slo_s!r}")
    config = ServiceConfig(tenants, budgets, default_model, _reservation(raw.get("reservation", {})),
                           None if ttft_slo_s is None else float(ttft_slo_s))
    _check_unique_keys(config)
    return config


def _check_unique_keys(config: ServiceConfig) -> None:
    seen: dict[str, str] = {}
    for tenant in config.tenants:
        for key in tenant.api_keys:
            if key in seen and seen[key] != tenant.name:
                raise ConfigError(f"API key given to both tenants {seen[key]!r} and {tenant.name!r}")
            seen[key] = tenant.name


def _with_env_keys(config: ServiceConfig, spec: str) -> ServiceConfig:
    """Add `key=tenant` pairs (comma-separated) to the config, creating tenants as needed."""
    tenants = {t.name: t for t in config.tenants}
    for pair in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, name = pair.partition("=")
        if not sep or not key or not name:
            raise ConfigError(f"SLUICE_API_KEYS entry {pair!r} is not of the form key=tenant")
        current = tenants.get(name, TenantConfig(name))
        tenants[name] = replace(current, api_keys=(*current.api_keys, key))
    result = replace(config, tenants=tuple(tenants.values()))
    _check_unique_keys(result)
    return result


def load_config(path: str | Path | None = None, env: Mapping[str, str] | None = None) -> ServiceConfig:
    """Return the configuration from `path` (TOML or JSON; None = built-in default) and the environment.

    Raises ConfigError for a malformed file, FileNotFoundError for a missing one.
    """
    env = os.environ if env is None else env
    if path is None:
        config = ServiceConfig(tenants=(TenantConfig(DEFAULT_TENANT, (DEFAULT_API_KEY,)),))
    else:
        text = Path(path).read_text()
        try:
            raw = json.loads(text) if str(path).endswith(".json") else tomllib.loads(text)
        except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{path}: {exc}") from exc
        config = parse_config(raw)
    if env.get("SLUICE_API_KEYS"):
        config = _with_env_keys(config, env["SLUICE_API_KEYS"])
    if not config.tenants:
        raise ConfigError("no tenants configured: every request would be UNAUTHENTICATED")
    return config
