"""Admission's pure core: who is calling, is the request valid, and is there room for it.

Theory of operation
-------------------
The admission ledger holds, for every accepted request until its terminal completion, a
*reservation* of predicted work: its input tokens (pending until its first token shows the
prefill is done) and its reserved output tokens (max_tokens, the conservative choice). Budgets
are checked globally and per tenant, before anything else happens:

* active requests (accepted and not terminal),
* queued requests (accepted, no first token yet): the bound on the queue behind the front door,
* pending input tokens (accepted, prefill not done),
* reserved output tokens.

A request that does not fit is refused with OverBudget naming the budget and a retry delay
derived from the observed drain rate (releases per second, smoothed): the time until enough
requests have left for this one to fit. Nothing is ever truncated and the queue never grows
without bound. `release` is idempotent: a completion delivered twice (at-least-once streams)
releases once.

Idempotency keys map (tenant, key) to the request they started, for `idempotency_ttl_s`, so a
client retry attaches to the running request instead of starting a second one.

Pure: no clock, no I/O; `now` is an argument.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from sluice.config import Budgets, TenantConfig
from sluice.core_errors import CoreError, DuplicateRequest, InvalidRequest, OverBudget, UnknownApiKey


@dataclass(frozen=True)
class AdmissionConfig:
    """Budgets and tenants of one admission process (the file's part comes from sluice.config)."""

    budgets: Budgets = field(default_factory=Budgets)
    """Process-wide caps (each tenant's own caps, if it has any, apply as well)."""
    max_model_len: int = 4096
    """Prompt + max_tokens may not exceed this."""
    tenants: tuple[TenantConfig, ...] = ()
    """Every tenant, its keys, weight and caps."""
    allow_anonymous: bool = False
    """Accept calls without an API key as tenant `anonymous_tenant`."""
    anonymous_tenant: str = "anonymous"
    """Tenant of calls without an API key when `allow_anonymous`."""
    idempotency_ttl_s: float = 600.0
    """How long an idempotency key keeps pointing at its request."""
    min_retry_after_s: float = 0.05
    """Shortest retry delay an over-budget refusal advises."""
    max_retry_after_s: float = 30.0
    """Longest retry delay an over-budget refusal advises."""
    drain_rate_halflife_s: float = 5.0
    """Smoothing of the observed release rate used for retry delays."""


@dataclass
class Reservation:
    request_id: str
    tenant: str
    input_tokens: int
    reserved_output_tokens: int
    admitted_at: float
    started: bool = False


@dataclass
class _Usage:
    """The four ledgers, for one tenant or globally."""

    active: int = 0
    queued: int = 0
    pending_input_tokens: int = 0
    reserved_output_tokens: int = 0

    def add(self, reservation: Reservation, sign: int) -> None:
        self.active += sign
        if not reservation.started:
            self.queued += sign
            self.pending_input_tokens += sign * reservation.input_tokens
        self.reserved_output_tokens += sign * reservation.reserved_output_tokens


@dataclass(frozen=True)
class AdmissionStats:
    active: int
    queued: int
    pending_input_tokens: int
    reserved_output_tokens: int
    admitted: int
    rejected: Mapping[str, int]
    released: int
    drain_rate_per_s: float
    per_tenant_active: Mapping[str, int] = field(default_factory=dict)


_BUDGETS = ("active", "queued", "pending_input_tokens", "reserved_output_tokens")
_DRAIN_WINDOW_S = 10.0


class AdmissionCore:
    """Identity, validation and the admission ledger. See the module docstring."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self._tenants = {t.name: t for t in config.tenants}
        self._keys = {key: t.name for t in config.tenants for key in t.api_keys}
        self._reservations: dict[str, Reservation] = {}
        self._total = _Usage()
        self._per_tenant: dict[str, _Usage] = {}
        self._releases: deque[tuple[float, int]] = deque()
        self._idempotency: dict[tuple[str, str], tuple[str, float]] = {}
        self._idempotency_order: deque[tuple[float, tuple[str, str]]] = deque()
        self.admitted = 0
        self.released = 0
        self.rejected: dict[str, int] = {}

    # ---- identity and validation --------------------------------------------------------
    def authenticate(self, api_key: str | None) -> str:
        """Return the tenant of `api_key`; raises UnknownApiKey (missing or unknown key)."""
        if not api_key:
            if self.config.allow_anonymous:
                return self.config.anonymous_tenant
            raise UnknownApiKey("missing API key (send metadata 'authorization: Bearer <key>')")
        tenant = self._keys.get(api_key)
        if tenant is None:
            raise UnknownApiKey("unknown API key")
        return tenant

    def tenant_weight(self, tenant: str) -> float:
        config = self._tenants.get(tenant)
        return config.weight if config is not None else 1.0

    def cache_salt(self, tenant: str) -> str:
        """Return the tenant's prefix-cache salt ("" shares cached prefixes with every tenant)."""
        config = self._tenants.get(tenant)
        return config.cache_salt if config is not None else ""

    def validate(self, prompt_tokens: int, max_tokens: int, *, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0) -> None:
        """Check a request against the model length and the sampling ranges.

        Raises InvalidRequest naming the field and the numbers; never truncates."""
        if prompt_tokens <= 0:
            raise InvalidRequest("prompt", "prompt is empty")
        if max_tokens < 1:
            raise InvalidRequest("sampling.max_tokens", f"max_tokens must be >= 1, got {max_tokens}")
        if not math.isfinite(temperature) or temperature < 0:
            raise InvalidRequest("sampling.temperature", f"temperature must be >= 0, got {temperature}")
        if not math.isfinite(top_p) or not 0.0 <= top_p <= 1.0:
            raise InvalidRequest("sampling.top_p", f"top_p must be in (0, 1] (0 = unset), got {top_p}")
        if top_k < 0:
            raise InvalidRequest("sampling.top_k", f"top_k must be >= 0 (0 = off), got {top_k}")
        total, limit = prompt_tokens + max_tokens, self.config.max_model_len
        if total > limit:
            raise InvalidRequest(
                "sampling.max_tokens",
                f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} exceeds the "
                f"model length of {limit} tokens",
            )

    # ---- the ledger -------------------------------------------------------------------------
    def admit(self, request_id: str, tenant: str, input_tokens: int, max_tokens: int, now: float) -> Reservation:
        """Reserve room for a request. Raises DuplicateRequest, InvalidRequest (it could never fit)
        or OverBudget (not now: retry after the delay it carries); on a refusal nothing changes."""
        if request_id in self._reservations:
            raise DuplicateRequest(f"request {request_id!r} is already active")
        reservation = Reservation(request_id, tenant, input_tokens, max_tokens, admitted_at=now)
        try:
            self._check_fits_ever(reservation)
            self._check_budgets(reservation, now)
        except CoreError as exc:
            key = getattr(exc, "budget", exc.reason)
            self.rejected[key] = self.rejected.get(key, 0) + 1
            raise
        self._reservations[request_id] = reservation
        self._total.add(reservation, +1)
        self._per_tenant.setdefault(tenant, _Usage()).add(reservation, +1)
        self.admitted += 1
        return reservation

    def _caps(self, tenant: str | None) -> tuple[int | None, ...]:
        """The caps in _BUDGETS order: the process's (tenant None) or the tenant's own (None: uncapped)."""
        if tenant is None:
            budgets: Budgets | None = self.config.budgets
        else:
            t = self._tenants.get(tenant)
            budgets = t.budgets if t is not None else None
        if budgets is None:
            return (None, None, None, None)
        return (budgets.max_active_requests, budgets.max_queue_length, budgets.max_pending_input_tokens,
                budgets.max_reserved_output_tokens)

    def _check_fits_ever(self, r: Reservation) -> None:
        for scope in (None, r.tenant):
            caps = self._caps(scope)
            if caps[2] is not None and r.input_tokens > caps[2]:
                raise InvalidRequest("prompt", f"prompt of {r.input_tokens} tokens exceeds the pending-input "
                                               f"budget of {caps[2]} tokens and could never be admitted")
            if caps[3] is not None and r.reserved_output_tokens > caps[3]:
                raise InvalidRequest("sampling.max_tokens", f"max_tokens {r.reserved_output_tokens} exceeds the "
                                                            f"output budget of {caps[3]} tokens")

    def _check_budgets(self, r: Reservation, now: float) -> None:
        demand = (1, 1, r.input_tokens, r.reserved_output_tokens)
        for scope in (None, r.tenant):
            usage = self._total if scope is None else self._per_tenant.get(r.tenant, _Usage())
            used = (usage.active, usage.queued, usage.pending_input_tokens, usage.reserved_output_tokens)
            for name, cap, in_use, want in zip(_BUDGETS, self._caps(scope), used, demand, strict=True):
                if cap is not None and in_use + want > cap:
                    where = "global" if scope is None else f"tenant {r.tenant!r}"
                    retry = self._retry_after(name, in_use + want - cap, now)
                    raise OverBudget(
                        f"{name}" if scope is None else f"tenant.{name}", retry,
                        f"{where} budget {name} is full ({in_use} in use + {want} requested > {cap}); "
                        f"retry after {retry:.2f}s",
                    )

    def _retry_after(self, budget: str, excess: int, now: float) -> float:
        """Time until `excess` units have drained at the observed release rate."""
        self._prune_releases(now)
        releases = len(self._releases)
        if releases == 0:
            return min(max(1.0, self.config.min_retry_after_s), self.config.max_retry_after_s)
        if budget in ("active", "queued"):
            units_per_s = releases / _DRAIN_WINDOW_S
        else:
            units_per_s = sum(tokens for _, tokens in self._releases) / _DRAIN_WINDOW_S
        delay = excess / max(units_per_s, 1e-9)
        return min(max(delay, self.config.min_retry_after_s), self.config.max_retry_after_s)

    def _prune_releases(self, now: float) -> None:
        while self._releases and self._releases[0][0] < now - _DRAIN_WINDOW_S:
            self._releases.popleft()

    def mark_started(self, request_id: str, now: float) -> bool:
        """The request's first token arrived: it leaves the queue and its input is no longer pending.
        Returns False if unknown or already started."""
        r = self._reservations.get(request_id)
        if r is None or r.started:
            return False
        for usage in (self._total, self._per_tenant[r.tenant]):
            usage.queued -= 1
            usage.pending_input_tokens -= r.input_tokens
        r.started = True
        return True

    def release(self, request_id: str, now: float) -> Reservation | None:
        """Return a terminal request's reservation, exactly once (None the second time)."""
        r = self._reservations.pop(request_id, None)
        if r is None:
            return None
        self._total.add(r, -1)
        self._per_tenant[r.tenant].add(r, -1)
        self.released += 1
        self._releases.append((now, r.input_tokens + r.reserved_output_tokens))
        self._prune_releases(now)
        return r

    def reservation(self, request_id: str) -> Reservation | None:
        return self._reservations.get(request_id)

    # ---- idempotency ----------------------------------------------------------------------
    def remember_key(self, tenant: str, key: str, request_id: str, now: float) -> None:
        """Point (tenant, key) at `request_id` for idempotency_ttl_s."""
        self._idempotency[(tenant, key)] = (request_id, now)
        self._idempotency_order.append((now, (tenant, key)))

    def lookup_key(self, tenant: str, key: str, now: float) -> str | None:
        """Return the request a live idempotency key started, or None."""
        limit = now - self.config.idempotency_ttl_s
        while self._idempotency_order and self._idempotency_order[0][0] < limit:
            stamp, old = self._idempotency_order.popleft()
            entry = self._idempotency.get(old)
            if entry is not None and entry[1] == stamp:
                del self._idempotency[old]
        entry = self._idempotency.get((tenant, key))
        return entry[0] if entry is not None else None

    def stats(self, now: float) -> AdmissionStats:
        self._prune_releases(now)
        t = self._total
        return AdmissionStats(
            t.active, t.queued, t.pending_input_tokens, t.reserved_output_tokens, self.admitted,
            dict(self.rejected), self.released, len(self._releases) / _DRAIN_WINDOW_S,
            {name: u.active for name, u in self._per_tenant.items()},
        )
