"""Admission's pure core: identity, validation, the four budgets, retry delays, idempotency."""

from __future__ import annotations

import pytest

from admission_svc.core import (
    AdmissionConfig,
    AdmissionCore,
    DuplicateRequest,
    InvalidRequest,
    OverBudget,
    UnknownApiKey,
)
from sluice.config import Budgets, TenantConfig


def make_admission(max_active_requests: int = 4, max_queue_length: int = 3, **overrides: object) -> AdmissionCore:
    budgets = Budgets(max_active_requests=max_active_requests, max_queue_length=max_queue_length,
                      max_pending_input_tokens=1000, max_reserved_output_tokens=1000)
    alice = Budgets(max_active_requests=2, max_queue_length=10**6, max_pending_input_tokens=10**6,
                    max_reserved_output_tokens=10**6)
    tenants = (TenantConfig("alice", api_keys=("k-alice",), budgets=alice), TenantConfig("bob", ("k-bob",)))
    config: dict[str, object] = {"budgets": budgets, "max_model_len": 512, "tenants": tenants}
    config.update(overrides)
    return AdmissionCore(AdmissionConfig(**config))  # type: ignore[arg-type]


def test_api_keys_map_to_tenants_and_bad_keys_are_refused() -> None:
    """A known key names its tenant; missing or unknown keys raise UnknownApiKey unless anonymous is allowed."""
    core = make_admission()
    assert core.authenticate("k-bob") == "bob"
    for key in (None, "", "nope"):
        with pytest.raises(UnknownApiKey):
            core.authenticate(key)
    assert make_admission(allow_anonymous=True).authenticate(None) == "anonymous"


@pytest.mark.parametrize(
    ("kwargs", "field", "numbers"),
    [
        ({"prompt_tokens": 0, "max_tokens": 4}, "prompt", ""),
        ({"prompt_tokens": 4, "max_tokens": 0}, "sampling.max_tokens", "0"),
        ({"prompt_tokens": 4, "max_tokens": 4, "temperature": -0.5}, "sampling.temperature", "-0.5"),
        ({"prompt_tokens": 4, "max_tokens": 4, "top_p": 1.5}, "sampling.top_p", "1.5"),
        ({"prompt_tokens": 4, "max_tokens": 4, "top_k": -1}, "sampling.top_k", "-1"),
        ({"prompt_tokens": 500, "max_tokens": 100}, "sampling.max_tokens", "prompt (500 tokens) + max_tokens (100)"),
    ],
)
def test_invalid_requests_name_the_field_and_the_numbers(kwargs: dict, field: str, numbers: str) -> None:
    """Each bad value raises InvalidRequest for its field with the offending numbers in the detail."""
    with pytest.raises(InvalidRequest) as info:
        make_admission().validate(**kwargs)
    assert info.value.field == field
    assert numbers in info.value.detail
    if field == "sampling.max_tokens" and "prompt" in numbers:
        assert "512" in info.value.detail


def test_budgets_refuse_without_side_effects_and_release_exactly_once() -> None:
    """Over a budget raises OverBudget and changes no ledger; a second release returns None."""
    core = make_admission()
    core.admit("a1", "alice", 100, 10, now=0.0)
    core.admit("a2", "alice", 100, 10, now=0.0)
    before = core.stats(0.0)
    with pytest.raises(OverBudget) as info:
        core.admit("a3", "alice", 100, 10, now=0.0)
    assert info.value.budget == "tenant.active"
    assert core.stats(0.0).active == before.active and core.reservation("a3") is None
    assert core.release("a1", now=1.0) is not None
    assert core.release("a1", now=1.0) is None
    core.admit("a3", "alice", 100, 10, now=1.0)
    assert core.stats(1.0).active == 2


def test_queue_and_token_budgets_are_global_and_started_requests_leave_the_queue() -> None:
    """The queued bound counts requests without a first token; mark_started frees queue and input budget."""
    core = make_admission()
    for i in range(3):
        core.admit(f"b{i}", "bob", 300, 10, now=0.0)
    with pytest.raises(OverBudget) as info:
        core.admit("b3", "bob", 10, 10, now=0.0)
    assert info.value.budget == "queued"
    assert core.mark_started("b0", now=0.1) and not core.mark_started("b0", now=0.1)
    core.admit("b3", "bob", 10, 10, now=0.2)
    stats = core.stats(0.2)
    assert (stats.queued, stats.pending_input_tokens) == (3, 610)


def test_a_tenants_own_queue_length_is_enforced() -> None:
    """A tenant's max_queue_length (from the config file's tenant table) bounds its requests without a first token."""
    small = Budgets(max_active_requests=10, max_queue_length=1, max_pending_input_tokens=1000,
                    max_reserved_output_tokens=1000)
    core = make_admission(max_queue_length=10, tenants=(TenantConfig("carol", ("k-carol",), budgets=small),))
    core.admit("c1", "carol", 10, 10, now=0.0)
    with pytest.raises(OverBudget) as info:
        core.admit("c2", "carol", 10, 10, now=0.0)
    assert info.value.budget == "tenant.queued"
    core.mark_started("c1", now=0.1)
    core.admit("c2", "carol", 10, 10, now=0.2)


def test_a_request_that_could_never_fit_is_invalid_not_retryable() -> None:
    """Input beyond the whole pending-token budget is InvalidRequest (retrying would never help)."""
    with pytest.raises(InvalidRequest, match="could never be admitted"):
        make_admission().admit("x", "bob", 5000, 1, now=0.0)


def test_retry_delay_follows_the_observed_drain_rate() -> None:
    """With 10 releases in the last 10 s (1/s), one excess request is told to wait about 1 s; faster drain, shorter wait."""
    core = make_admission(max_active_requests=1, max_queue_length=100)
    for i in range(10):
        core.admit(f"r{i}", "bob", 1, 1, now=float(i))
        core.release(f"r{i}", now=float(i) + 0.5)
    core.admit("busy", "bob", 1, 1, now=10.0)
    with pytest.raises(OverBudget) as info:
        core.admit("next", "bob", 1, 1, now=10.0)
    assert info.value.retry_after_s == pytest.approx(1.0)


def test_duplicate_ids_and_idempotency_keys() -> None:
    """An active id cannot be admitted twice; an idempotency key maps to its request until the TTL."""
    core = make_admission(idempotency_ttl_s=5.0)
    core.admit("r", "bob", 1, 1, now=0.0)
    with pytest.raises(DuplicateRequest):
        core.admit("r", "bob", 1, 1, now=0.0)
    core.remember_key("bob", "key-1", "r", now=0.0)
    assert core.lookup_key("bob", "key-1", now=1.0) == "r"
    assert core.lookup_key("alice", "key-1", now=1.0) is None
    assert core.lookup_key("bob", "key-1", now=6.0) is None


def test_keys_forgotten_with_their_records_free_their_memory_before_the_ttl() -> None:
    """The front door forgets a key when its finished record is evicted, long before the key's TTL: what the core
    holds for keys must then stay bounded by the live keys, also behind a long request's key that stays live. Before,
    the TTL order kept every forgotten key's entry and string for the TTL (~250 bytes a request for 10 minutes)."""
    import tracemalloc

    core = make_admission(idempotency_ttl_s=600.0)
    core.remember_key("bob", "long-running", "r-long", now=0.0)  # live for the whole test, at the order's head
    clock = [0.0]

    def requests(first: int, count: int) -> None:
        for i in range(first, first + count):
            clock[0] += 0.001
            core.remember_key("bob", f"key-{i:08d}", f"r-{i}", now=clock[0])
            if i >= 2048:  # the front door keeps 2,048 finished records: the oldest one's key goes
                core.forget_key("bob", f"key-{i - 2048:08d}", f"r-{i - 2048}")

    requests(0, 20_000)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    requests(20_000, 60_000)
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert core.idempotency_keys == 2049
    # bounded by the 2,049 live keys; a TTL order beside them kept ~13 MB here before
    assert grown < 2_000_000, f"60,000 more requests kept {grown:,} bytes for keys already forgotten"
    assert core.lookup_key("bob", "long-running", now=clock[0]) == "r-long"
    assert core.lookup_key("bob", "key-00079999", now=clock[0]) == "r-79999"
    assert core.lookup_key("bob", "key-00000005", now=clock[0]) is None
    assert core.lookup_key("bob", "key-00079999", now=clock[0] + 601.0) is None  # the TTL still ends a live key


def test_a_tenants_cache_salt_comes_from_the_config_file_and_reaches_submit() -> None:
    """`cache_salt` in a tenant's table is that tenant's salt, a non-string is refused, and Submit carries it."""
    from sluice import convert as shared_convert
    from sluice.config import ConfigError, parse_config
    from sluice.v1 import scheduler_pb2

    config = parse_config({"tenants": {"acme": {"api_keys": ["k1"], "cache_salt": "s3cret"},
                                       "beta": {"api_keys": ["k2"]}}})
    core = AdmissionCore(AdmissionConfig(tenants=config.tenants))
    assert (core.cache_salt("acme"), core.cache_salt("beta"), core.cache_salt("nobody")) == ("s3cret", "", "")
    with pytest.raises(ConfigError, match="cache_salt"):
        parse_config({"tenants": {"acme": {"api_keys": ["k1"], "cache_salt": 7}}})
    wire = scheduler_pb2.SubmitRequest(request_id="r", prompt_token_ids=[1], cache_salt="s3cret")
    assert shared_convert.new_request_from_proto(wire, 0.0, default_eos=2).cache_salt == "s3cret"


def test_fits_answers_what_admit_would_without_changing_the_ledger() -> None:
    """`fits` is True while admit would succeed and False once a budget is full; it reserves and counts nothing."""
    core = make_admission()
    assert core.fits("alice", 10, 10, 0.0)
    core.admit("a1", "alice", 10, 10, 0.0)
    assert core.fits("alice", 10, 10, 0.0)
    core.admit("a2", "alice", 10, 10, 0.0)
    assert not core.fits("alice", 10, 10, 0.0) and core.fits("bob", 10, 10, 0.0)  # alice's own cap of 2
    assert core.stats(0.0).active == 2 and not core.stats(0.0).rejected
    core.release("a1", 1.0)
    assert core.fits("alice", 10, 10, 1.0)


def test_queue_limits_are_the_tenants_own_else_the_global_ones() -> None:
    """A tenant with its own budgets queues by them; one without uses the process's."""
    queued = Budgets(max_queued_requests=7, queue_timeout_s=9)
    core = make_admission(budgets=queued, tenants=(TenantConfig("alice", ("k",), budgets=Budgets()),
                                                   TenantConfig("bob", ("k2",))))
    assert core.queue_limits("bob") == (7, 9.0) and core.queue_limits("alice") == (None, 30.0)
