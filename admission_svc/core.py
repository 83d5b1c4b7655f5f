"""Admission's pure core: who is calling, is the request valid, and is there room for it.

Theory of operation
-------------------
The admission ledger holds, for every accepted request until its terminal completion, a
*reservation* of predicted work: its input tokens (pending until its first token shows the
prefill is done), its reserved output tokens (how many, the reservation policy decides:
admission_svc/reservations.py) and its reserved KV blocks. Budgets are checked globally and per
tenant, before anything else happens:

* active requests (accepted and not terminal),
* queued requests (accepted, no first token yet): the bound on the queue behind the front door,
* pending input tokens (accepted, prefill not done),
* reserved output tokens,
* reserved KV blocks (optional): prompt blocks shared by several requests counted once.

A request whose streamed output outruns its reservation grows it (`on_tokens`); growth that finds no
budget is granted over-committed and counted (reservations.py states why). `release` reclaims it all
and teaches the policy the request's real output length.

With `ttft_slo_s` set, `check_ttft` refuses a request the router predicts would wait past the SLO
(RESOURCE_EXHAUSTED, retry after the predicted excess has drained) instead of admitting it to wait.

A request that does not fit is refused with OverBudget naming the budget and a retry delay
derived from the observed drain rate (releases per second, smoothed): the time until enough
requests have left for this one to fit. Nothing is ever truncated and the queue never grows
without bound. `release` is idempotent: a completion delivered twice (at-least-once streams)
releases once.

Idempotency keys map (tenant, key) to the request they started, for `idempotency_ttl_s`, so a
client retry attaches to the running request instead of starting a second one. The key remembers a
fingerprint of its request: the same key with another prompt or other parameters is ALREADY_EXISTS.

Pure: no clock, no I/O; `now` is an argument.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from admission_svc.reservations import Growth, Reservation, Usage, make_reserver
from sluice.config import Budgets, ReservationConfig, TenantConfig
from sluice.core_errors import CoreError, DuplicateRequest, InvalidRequest, OverBudget, UnknownApiKey
from sluice.safe_text import SHOWN_CHARS, shown
from sluice.structured import SchemaError, schema_regex
from sluice.types import MAX_LOGPROBS, SamplingParams


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
    reservation: ReservationConfig = field(default_factory=ReservationConfig)
    """How many output tokens a request reserves (conservative: max_tokens; predicted)."""
    ttft_slo_s: float | None = None
    """Refuse early a request whose predicted TTFT exceeds this many seconds; None: never."""


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
    reserved_kv_blocks: int = 0
    growths: int = 0
    """Reservations grown because their request outran them."""
    overcommitted_growths: int = 0
    """Growths granted with no budget left (the stated rule: run over-committed, counted)."""
    reclaimed_output_tokens: int = 0
    """Reserved output tokens that finished requests did not use, returned at release."""


_BUDGETS = ("active", "queued", "pending_input_tokens", "reserved_output_tokens", "reserved_kv_blocks")
_DRAIN_WINDOW_S = 10.0


class AdmissionCore:
    """Identity, validation and the admission ledger. See the module docstring."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self._tenants = {t.name: t for t in config.tenants}
        self._keys = {key: t.name for t in config.tenants for key in t.api_keys}
        self._reservations: dict[str, Reservation] = {}
        self._total = Usage()
        self._per_tenant: dict[str, Usage] = {}
        self._releases: deque[tuple[float, int, int]] = deque()
        """(time, tokens, KV blocks) of each release in the last _DRAIN_WINDOW_S: the drain rate."""
        self.reserver = make_reserver(config.reservation)
        self._idempotency: OrderedDict[tuple[str, str], tuple[str, float, int]] = OrderedDict()
        """(tenant, key) -> (request id, when remembered, the request's fingerprint), oldest first: the TTL takes
        them from the front, and a forgotten key (its finished record evicted) leaves nothing behind."""
        self.admitted = 0
        self.released = 0
        self.rejected: dict[str, int] = {}
        self.growths = 0
        self.overcommitted_growths = 0
        self.reclaimed_output_tokens = 0
        self._shares: dict[str | None, tuple[int | None, ...]] = {}
        """This process's part of shared caps, by scope (None: global), in _BUDGETS order (admission_svc/shares.py)."""

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

    @staticmethod
    def validate_penalties(sampling: SamplingParams, vocab_size: int) -> None:
        """Check penalties, min_p, logit_bias and logprobs against vLLM's ranges (vllm/sampling_params.py), and a
        structured output's JSON schema against what the grammar can express.

        Raises InvalidRequest naming the field and the value."""
        for name, value, low, high in (("presence_penalty", sampling.presence_penalty, -2.0, 2.0),
                                       ("frequency_penalty", sampling.frequency_penalty, -2.0, 2.0),
                                       ("min_p", sampling.min_p, 0.0, 1.0)):
            if not (math.isfinite(value) and low <= value <= high):
                raise InvalidRequest(f"sampling.{name}", f"{name} must be in [{low:g}, {high:g}], got {value}")
        if not (math.isfinite(sampling.repetition_penalty) and sampling.repetition_penalty > 0):
            raise InvalidRequest("sampling.repetition_penalty", f"repetition_penalty must be a finite number > 0 "
                                                                f"(0 = unset), got {sampling.repetition_penalty}")
        bad = [t for t, _ in sampling.logit_bias if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequest("sampling.logit_bias", f"logit_bias holds token ids outside [0, {vocab_size}), "
                                                        f"e.g. {bad[0]}")
        if not all(math.isfinite(b) and -100.0 <= b <= 100.0 for _, b in sampling.logit_bias):
            raise InvalidRequest("sampling.logit_bias", "logit_bias values must be in [-100, 100]")
        if sampling.logprobs is not None and not 0 <= sampling.logprobs <= MAX_LOGPROBS:
            raise InvalidRequest("sampling.logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], "
                                                      f"got {sampling.logprobs}")
        if sampling.json_schema:
            try:
                schema_regex(sampling.json_schema)
            except SchemaError as exc:
                raise InvalidRequest("sampling.json_schema", f"json_schema cannot be used for structured output: "
                                                             f"{exc}"[:300]) from None
            if sampling.ignore_eos:
                raise InvalidRequest("sampling.ignore_eos", "ignore_eos cannot go with structured output (the "
                                                            "document ends at EOS)")

    # ---- the ledger -------------------------------------------------------------------------
    def admit(self, request_id: str, tenant: str, input_tokens: int, max_tokens: int, now: float, *,
              model: str = "", block_hashes: tuple[int, ...] = (), block_size: int = 16) -> Reservation:
        """Reserve room for a request. Raises DuplicateRequest, InvalidRequest (it could never fit)
        or OverBudget (not now: retry after the delay it carries); on a refusal nothing changes.

        `block_hashes` are its full prompt blocks' hashes (the router's), for the KV-block budget."""
        if request_id in self._reservations:
            raise DuplicateRequest(f"request {request_id!r} is already active")
        reserved = self.reserver.initial(tenant, model, max_tokens)
        reservation = Reservation(request_id, tenant, input_tokens, reserved, admitted_at=now, max_tokens=max_tokens,
                                  model=model, block_hashes=block_hashes, block_size=block_size)
        try:
            self._check_fits_ever(reservation)
            self._check_budgets(reservation, now)
        except CoreError as exc:
            self._count_refusal(getattr(exc, "budget", exc.reason))
            raise
        self._reservations[request_id] = reservation
        self._hold(reservation, +1)
        self.admitted += 1
        return reservation

    def fits(self, tenant: str, input_tokens: int, max_tokens: int, now: float, *, model: str = "",
             block_hashes: tuple[int, ...] = (), block_size: int = 16) -> bool:
        """Return whether `admit` with these arguments would find room in every budget now (it changes nothing
        and counts no refusal; a request that could never fit is `admit`'s to refuse)."""
        reserved = self.reserver.initial(tenant, model, max_tokens)
        reservation = Reservation("", tenant, input_tokens, reserved, admitted_at=now, max_tokens=max_tokens,
                                  model=model, block_hashes=block_hashes, block_size=block_size)
        try:
            self._check_budgets(reservation, now)
        except OverBudget:
            return False
        return True

    def queue_limits(self, tenant: str) -> tuple[int | None, float]:
        """Return (how many requests of `tenant` may wait at the front door for room, for how many seconds):
        the tenant's own budgets when it has them, else the global ones."""
        t = self._tenants.get(tenant)
        budgets = t.budgets if t is not None and t.budgets is not None else self.config.budgets
        return budgets.max_queued_requests, float(budgets.queue_timeout_s)

    def _count_refusal(self, key: str) -> None:
        self.rejected[key] = self.rejected.get(key, 0) + 1

    def _hold(self, reservation: Reservation, sign: int) -> None:
        self._total.add(reservation, sign)
        self._per_tenant.setdefault(reservation.tenant, Usage()).add(reservation, sign)

    def _caps(self, tenant: str | None) -> tuple[int | None, ...]:
        """The caps in _BUDGETS order: the process's (tenant None) or the tenant's own (None: uncapped)."""
        if tenant is None:
            budgets: Budgets | None = self.config.budgets
        else:
            t = self._tenants.get(tenant)
            budgets = t.budgets if t is not None else None
        if budgets is None:
            return (None,) * len(_BUDGETS)
        return (budgets.max_active_requests, budgets.max_queue_length, budgets.max_pending_input_tokens,
                budgets.max_reserved_output_tokens, budgets.max_reserved_kv_blocks)

    def capped_scopes(self) -> dict[str | None, tuple[int | None, ...]]:
        """Return the configured caps of every scope that has any (None: global; else a tenant's own), _BUDGETS order."""
        scopes: list[str | None] = [None, *(t.name for t in self.config.tenants if t.budgets is not None)]
        return {scope: self._caps(scope) for scope in scopes}

    def usage(self, scope: str | None) -> tuple[int, ...]:
        """Return what this process holds in `scope` (None: global; else a tenant), _BUDGETS order."""
        usage = self._total if scope is None else self._per_tenant.get(scope, Usage())
        return usage.used()

    def set_share(self, scope: str | None, share: tuple[int | None, ...] | None) -> None:
        """Admit in `scope` only up to `share` (this process's part of caps shared with other admission processes,
        _BUDGETS order; None in a place: the configured cap); share None: the configured caps again."""
        if share is None:
            self._shares.pop(scope, None)
        else:
            self._shares[scope] = share

    def _limits(self, scope: str | None) -> tuple[int | None, ...]:
        """The caps new work must fit in: this process's share where it has one, else the configured cap."""
        caps = self._caps(scope)
        share = self._shares.get(scope)
        if share is None:
            return caps
        return tuple(cap if part is None else part for cap, part in zip(caps, share, strict=True))

    def _check_fits_ever(self, r: Reservation) -> None:
        for scope in (None, r.tenant):
            caps = self._caps(scope)
            if caps[2] is not None and r.input_tokens > caps[2]:
                raise InvalidRequest("prompt", f"prompt of {r.input_tokens} tokens exceeds the pending-input "
                                               f"budget of {caps[2]} tokens and could never be admitted")
            if caps[3] is not None and r.reserved_output_tokens > caps[3]:
                raise InvalidRequest("sampling.max_tokens", f"max_tokens {r.reserved_output_tokens} exceeds the "
                                                            f"output budget of {caps[3]} tokens")
            blocks = len(set(r.block_hashes)) + r.own_blocks
            if caps[4] is not None and blocks > caps[4]:
                raise InvalidRequest("sampling.max_tokens", f"the request needs {blocks} KV blocks, more than the "
                                                            f"KV-block budget of {caps[4]}, and could never be admitted")

    def _demand(self, r: Reservation, usage: Usage) -> tuple[int, ...]:
        """What admitting `r` adds to `usage`, in _BUDGETS order (prompt blocks it holds already: nothing)."""
        return (1, 1, r.input_tokens, r.reserved_output_tokens, usage.kv.new_blocks(r.block_hashes) + r.own_blocks)

    def _scopes(self, tenant: str) -> tuple[tuple[str | None, Usage], ...]:
        return ((None, self._total), (tenant, self._per_tenant.get(tenant, Usage())))

    def _check_budgets(self, r: Reservation, now: float) -> None:
        for scope, usage in self._scopes(r.tenant):
            full = self._full(self._limits(scope), usage.used(), self._demand(r, usage))
            if full is not None:
                name, in_use, want, cap = full
                where = "global" if scope is None else f"tenant {r.tenant!r}"
                retry = self._retry_after(name, in_use + want - cap, now)
                raise OverBudget(
                    f"{name}" if scope is None else f"tenant.{name}", retry,
                    f"{where} budget {name} is full ({in_use} in use + {want} requested > {cap}); "
                    f"retry after {retry:.2f}s",
                )

    @staticmethod
    def _full(caps: tuple[int | None, ...], used: tuple[int, ...],
              demand: tuple[int, ...]) -> tuple[str, int, int, int] | None:
        """Return (budget, in use, wanted, cap) of the first budget `demand` would exceed, or None."""
        for name, cap, in_use, want in zip(_BUDGETS, caps, used, demand, strict=True):
            if cap is not None and want > 0 and in_use + want > cap:
                return name, in_use, want, cap
        return None

    def _retry_after(self, budget: str, excess: int, now: float) -> float:
        """Time until `excess` units have drained at the observed release rate."""
        self._prune_releases(now)
        releases = len(self._releases)
        if releases == 0:
            return self._clamp_retry(1.0)
        if budget in ("active", "queued"):
            units_per_s = releases / _DRAIN_WINDOW_S
        elif budget == "reserved_kv_blocks":
            units_per_s = sum(blocks for _, _, blocks in self._releases) / _DRAIN_WINDOW_S
        else:
            units_per_s = sum(tokens for _, tokens, _ in self._releases) / _DRAIN_WINDOW_S
        return self._clamp_retry(excess / max(units_per_s, 1e-9))

    def _clamp_retry(self, delay: float) -> float:
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

    def on_tokens(self, request_id: str, generated: int, now: float) -> Growth | None:
        """The request has streamed `generated` output tokens; grow its reservation if it outran it.

        Returns the Growth (None: unknown request, or still within its reservation). Growth with no
        budget left is granted anyway and counted as over-committed (module docstring)."""
        r = self._reservations.get(request_id)
        if r is None:
            return None
        r.generated = max(r.generated, generated)
        if generated <= r.reserved_output_tokens:
            return None
        grown = replace(r, reserved_output_tokens=self.reserver.grown(r.reserved_output_tokens, generated,
                                                                       r.max_tokens))
        extra = (0, 0, 0, grown.reserved_output_tokens - r.reserved_output_tokens, grown.own_blocks - r.own_blocks)
        full = next(filter(None, (self._full(self._limits(scope), usage.used(), extra)
                                  for scope, usage in self._scopes(r.tenant))), None)
        self._hold(r, -1)
        self._reservations[request_id] = grown
        self._hold(grown, +1)
        self.growths += 1
        self.overcommitted_growths += full is not None
        return Growth(request_id, grown.reserved_output_tokens, full is not None, full[0] if full else "")

    def check_ttft(self, request_id: str, predicted_ttft_s: float, now: float) -> None:
        """Refuse a routed request whose predicted TTFT exceeds the SLO (ttft_slo_s; None: never refuse).

        Raises OverBudget("ttft_slo") with a retry delay of the predicted excess (the time the queue
        ahead of it needs to drain until a new request would meet the SLO). The caller releases it."""
        slo = self.config.ttft_slo_s
        if slo is None or predicted_ttft_s <= slo:
            return
        self._count_refusal("ttft_slo")
        retry = self._clamp_retry(predicted_ttft_s - slo)
        raise OverBudget("ttft_slo", retry, f"request {request_id} would wait: predicted time to first token "
                                            f"{predicted_ttft_s:.2f}s exceeds the SLO of {slo:.2f}s; retry after "
                                            f"{retry:.2f}s")

    def release(self, request_id: str, now: float, output_tokens: int | None = None) -> Reservation | None:
        """Return a terminal request's reservation, exactly once (None the second time).

        `output_tokens`: what a request that finished generated (None: it did not finish, e.g.
        cancelled or refused), which the reservation policy learns from."""
        r = self._reservations.pop(request_id, None)
        if r is None:
            return None
        self._hold(r, -1)
        self.released += 1
        if output_tokens is not None:
            self.reserver.observe(r.tenant, r.model, output_tokens)
            self.reclaimed_output_tokens += max(r.reserved_output_tokens - output_tokens, 0)
        self._releases.append((now, r.input_tokens + r.reserved_output_tokens,
                               len(r.block_hashes) + r.own_blocks))
        self._prune_releases(now)
        return r

    def reservation(self, request_id: str) -> Reservation | None:
        return self._reservations.get(request_id)

    # ---- idempotency ----------------------------------------------------------------------
    def remember_key(self, tenant: str, key: str, request_id: str, now: float, fingerprint: int = 0) -> None:
        """Point (tenant, key) at `request_id` for idempotency_ttl_s; `fingerprint` identifies the request the key
        started (what a retry must repeat exactly)."""
        self._idempotency[(tenant, key)] = (request_id, now, fingerprint)
        self._idempotency.move_to_end((tenant, key))
        self._prune_keys(now)

    def lookup_key(self, tenant: str, key: str, now: float, fingerprint: int = 0) -> str | None:
        """Return the request a live idempotency key started, or None.

        Raises DuplicateRequest (ALREADY_EXISTS, naming the key) when the key started a request other than the
        one `fingerprint` identifies: a reused key must not silently answer with another request's output."""
        self._prune_keys(now)
        entry = self._idempotency.get((tenant, key))
        if entry is None:
            return None
        if entry[2] != fingerprint:
            raise DuplicateRequest(f"idempotency key {shown(key)} was used for a different request (another prompt "
                                   "or other parameters); a retry must repeat its request exactly, or use a new key",
                                   field_name="idempotency_key", metadata={"idempotency_key": key[:SHOWN_CHARS]})
        return entry[0]

    def forget_key(self, tenant: str, key: str, request_id: str) -> None:
        """Drop (tenant, key) if it still points at `request_id` (its record was evicted)."""
        entry = self._idempotency.get((tenant, key))
        if entry is not None and entry[0] == request_id:
            del self._idempotency[(tenant, key)]

    def _prune_keys(self, now: float) -> None:
        """Drop the keys older than the TTL (the oldest are first). Keys forgotten before their TTL are gone already:
        the core holds the live keys only (an order kept beside them held every key until its TTL, ~250 bytes a
        request for 10 minutes: ~150 MB at 1,000 requests a second, the SDK sending a key with every call)."""
        keys, limit = self._idempotency, now - self.config.idempotency_ttl_s
        while keys and next(iter(keys.values()))[1] < limit:
            keys.popitem(last=False)

    @property
    def idempotency_keys(self) -> int:
        """Live idempotency keys held."""
        return len(self._idempotency)

    def stats(self, now: float) -> AdmissionStats:
        self._prune_releases(now)
        t = self._total
        return AdmissionStats(
            t.active, t.queued, t.pending_input_tokens, t.reserved_output_tokens, self.admitted,
            dict(self.rejected), self.released, len(self._releases) / _DRAIN_WINDOW_S,
            {name: u.active for name, u in self._per_tenant.items()}, t.kv.blocks, self.growths,
            self.overcommitted_growths, self.reclaimed_output_tokens,
        )
