"""What one simulated deployment looks like (frozen; built once from flags or a scenario)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TypeVar

from admission_svc.core import AdmissionConfig
from router_svc.core import RouterConfig
from scheduler_svc.core.config import PreemptionMode, SchedulerConfig
from sluice.choices import enum_member
from sluice.config import Budgets, ReservationPolicy, TenantConfig
from sluice_tools.sim.control_plane import ControlPlaneConfig
from worker_svc.costmodel import DEFAULT_HOST_KV_BYTES, CostCoefficients

E = TypeVar("E", bound=enum.Enum)

# vLLM V1 defaults for GPUs with >= 70 GiB that are not A100 (H100, H200), OpenAI server context:
# max_num_batched_tokens 8192, max_num_seqs 1024, chunked prefill and prefix caching on, no
# per-request prefill cap (long_prefill_token_threshold 0). Source: vllm/engine/arg_utils.py,
# EngineArgs.get_batch_defaults (vLLM 0.9+).
VLLM_DEFAULT_BATCHED_TOKENS = 8192
VLLM_DEFAULT_MAX_SEQS = 1024

# Per-model context limits used by the simulator (Llama 3: max_position_embeddings 8192).
DEFAULT_MAX_MODEL_LEN = {"llama-3-8b": 8192, "llama-3-70b": 8192}

SCHEDULER = SchedulerConfig(num_blocks=0)
"""The replicas' scheduler: the core's own defaults (num_blocks, num_host_blocks, model_id and max_model_len are
filled in per run from the cost model). Tenant weights reach it as in production: on each request, from admission."""
ADMISSION = AdmissionConfig(budgets=Budgets(max_active_requests=100_000, max_queue_length=100_000,
                                            max_pending_input_tokens=1_000_000_000,
                                            max_reserved_output_tokens=1_000_000_000))
"""The front door: practically unbounded, so a simulation measures the replicas unless budgets are given."""


@dataclass(frozen=True)
class SimConfig:
    """A deployment to simulate: the cores' own configurations, plus the replicas, the clock and the clients."""

    replicas: int = 8
    """Number of replicas (each one SchedulerCore + one cost model)."""
    gpu: str = "h200"
    """GPU profile name (worker_svc.gpu_profiles)."""
    model: str = "llama-3-8b"
    """Model shape name (Llama 3 or a repo preset)."""
    cost_coefficients: CostCoefficients | None = None
    """Fitted cost-model coefficients (`python -m worker_svc.calibrate --json`); None: datasheet defaults."""
    scheduler: SchedulerConfig = SCHEDULER
    """Every replica's scheduler core (round budgets, queue policy, preemption, block size)."""
    router: RouterConfig = field(default_factory=RouterConfig)
    """The router core (policy, prediction TTL, prefill weight); its seed is the simulation's `seed`."""
    admission: AdmissionConfig = ADMISSION
    """The admission core (budgets; tenants and their fair-share weights)."""
    max_model_len: int | None = None
    """Prompt + max_tokens limit; None picks DEFAULT_MAX_MODEL_LEN or the model's own."""
    num_blocks: int | None = None
    """Override the KV blocks the cost model derives from GPU memory (scenarios use tiny pools)."""
    host_cache_gb: float | None = None
    """Host (CPU) memory per replica for a second tier of the prefix cache, in GB (10^9 bytes): blocks the device
    evicts are copied there and copied back, at the GPU profile's host-link bandwidth, instead of computed
    (scheduler_svc/core/host_blocks.py). None: no tier (swap-mode preemption keeps the cost model's 32 GB)."""
    max_retries: int = 0
    """Client retries after an over-budget or no-replica refusal (after the advised delay)."""
    pipeline: bool = True
    """Plan each round while the one before executes, as the live scheduler does (`--no-pipeline` there)."""
    round_gap_s: float = 0.0
    """Device idle between rounds that the live control plane leaves (its `sluice_worker_idle_seconds`)."""
    submit_delay_s: float = 0.0
    """Arrival at admission to the replica core's submit in the live stack (tokenize, route, Submit RPC)."""
    token_delay_s: float = 0.0
    """A token's way from the replica's round to the client in the live stack (Redis stream, admission)."""
    control_plane: ControlPlaneConfig | None = None
    """The control plane as a shared CPU whose load stretches the three delays above (sim/control_plane.py);
    None: the delays are constant."""
    heartbeat_interval_s: float = 0.05
    """How often the router's load view is refreshed from the replicas' stats."""
    sample_interval_s: float = 1.0
    """Period of the timeline samples (queue length, running, KV use, replicas)."""
    warmup_s: float = 0.0
    """Replica warm-up: registered WARMING at t=0, READY (mark_ready) at warmup_s."""
    slo_ttft_s: float = 1.0
    """Time-to-first-token objective of the report."""
    slo_tpot_s: float = 0.05
    """Time-per-output-token objective of the report."""
    seed: int = 0
    """Seed of the router's tie-breaks (and of nothing else: the workload has its own)."""
    client_max_tokens: int | None = None
    """max_tokens every client asks for (clamped to the model length, never below its output); None: exactly
    its output length. Admission reserves from it; the replicas still stop at the trace's output length."""
    disagg: tuple[int, int] | None = None
    """Prefill/decode disaggregation (sluice_tools/sim/disagg.py): (prefill replicas, decode replicas), whose sum
    is `replicas`; None: aggregated serving (every replica runs whole requests)."""
    kv_link: str = "nvlink"
    """With `disagg`: the KV transfer link profile (sluice_tools/sim/transfer.py: nvlink, rdma)."""
    disagg_prefill_chunk: int | None = None
    """With `disagg`: the prefill replicas' per-request prefill chunk cap (tokens of one prompt per round); None:
    the whole round budget, since no decodes run there for the cap to protect. Decode replicas keep `scheduler`'s."""

    @property
    def tenant_weights(self) -> tuple[tuple[str, float], ...]:
        """(tenant, weight) of every configured tenant (admission's tenants, the one source)."""
        return tuple((t.name, t.weight) for t in self.admission.tenants)

    def scheduler_config(self, num_blocks: int, num_host_blocks: int, max_model_len: int) -> SchedulerConfig:
        """Return one replica's scheduler configuration for the given capacity."""
        swap = self.scheduler.preemption_mode is PreemptionMode.SWAP
        tier = self.host_cache_gb is not None
        return replace(self.scheduler, num_blocks=num_blocks, num_host_blocks=num_host_blocks if swap or tier else 0,
                       host_prefix_cache=tier, model_id=self.model, max_model_len=max_model_len)

    @property
    def host_kv_bytes(self) -> float:
        """The cost model's `host_kv_bytes`: the host tier's size, else the cost model's default (32 GB)."""
        return DEFAULT_HOST_KV_BYTES if self.host_cache_gb is None else self.host_cache_gb * 1e9

    def admission_config(self, max_model_len: int) -> AdmissionConfig:
        """Return the front door's configuration for the model length."""
        return replace(self.admission, max_model_len=max_model_len)

    def router_config(self) -> RouterConfig:
        """Return the router's configuration (seeded from the simulation seed)."""
        return replace(self.router, seed=self.seed)


def with_tenant_weights(config: SimConfig, weights: Mapping[str, float]) -> SimConfig:
    """Return `config` whose admission knows the tenants of `weights` with those fair-share weights."""
    tenants = tuple(TenantConfig(name, weight=weight) for name, weight in sorted(weights.items()))
    return replace(config, admission=replace(config.admission, tenants=tenants))


def with_budgets(config: SimConfig, **budgets: int) -> SimConfig:
    """Return `config` with admission's process-wide budgets changed (Budgets field names)."""
    admission = config.admission
    return replace(config, admission=replace(admission, budgets=replace(admission.budgets, **budgets)))


def with_admission(config: SimConfig, *, reservation: ReservationPolicy | None = None,
                   ttft_slo_s: float | None = None) -> SimConfig:
    """Return `config` whose admission uses that reservation policy and refuses early past `ttft_slo_s`
    (each None: unchanged)."""
    admission = config.admission
    if reservation is not None:
        admission = replace(admission, reservation=replace(admission.reservation, policy=reservation))
    if ttft_slo_s is not None:
        admission = replace(admission, ttft_slo_s=ttft_slo_s)
    return replace(config, admission=admission)


def vllm_default(config: SimConfig) -> SimConfig:
    """Return `config` with vLLM V1's default round budgets on H100/H200 (an honest baseline)."""
    return replace(config, scheduler=replace(
        config.scheduler,
        max_num_batched_tokens=VLLM_DEFAULT_BATCHED_TOKENS,
        max_num_seqs=VLLM_DEFAULT_MAX_SEQS,
        max_prefill_chunk=VLLM_DEFAULT_BATCHED_TOKENS,
        max_kv_read_tokens=None,
        attention_pairs_per_token=None,
    ))


def with_slo_budget(config: SimConfig) -> SimConfig:
    """Return `config` whose round budgets (query tokens, KV read, the attention charge of deep chunks, the seat
    cap) are derived from its TPOT target and the cost model of its model and GPU (sluice.round_budget), instead of
    fixed numbers (the configured max_num_seqs included: the seats are the decodes that fit a round)."""
    from sluice.round_budget import derive_round_budget
    from worker_svc.costmodel import CostModel, RoundShape

    cost = CostModel(config.model, config.gpu, block_size=config.scheduler.block_size,
                     coefficients=config.cost_coefficients)

    def round_time(query: int, pairs: int, read: int, sampled: int) -> float:
        return cost.shape_time(RoundShape(query, pairs, read, query, sampled))

    max_model_len = config.max_model_len or DEFAULT_MAX_MODEL_LEN.get(config.model, cost.max_model_len)
    budget = derive_round_budget(config.slo_tpot_s, round_time, max_num_seqs=config.scheduler.max_num_seqs,
                                 min_kv_read=max_model_len, max_context=max_model_len)
    seats = config.scheduler.max_num_seqs if budget.max_num_seqs is None else budget.max_num_seqs
    # The host tier's copies run beside the forward: a round moves, each way, what the host link carries in the
    # time of a budget-sized round (Llama-3-8B on an H200's PCIe: ~1,370 blocks of 16 tokens in 45 ms).
    tokens = budget.max_num_batched_tokens
    per_block = cost.shape_time(RoundShape(tokens, 0, 0, tokens, 0, 1)) - round_time(tokens, 0, 0, 0)
    copies = max(int(round_time(tokens, 0, 0, 0) / per_block), 1)
    return replace(config, scheduler=replace(config.scheduler, max_num_batched_tokens=budget.max_num_batched_tokens,
                                             max_kv_read_tokens=budget.max_kv_read_tokens, max_num_seqs=seats,
                                             attention_pairs_per_token=budget.attention_pairs_per_token,
                                             attention_free_context=budget.attention_free_context,
                                             host_load_blocks=copies, host_page_out_blocks=copies))


def parse_enum(kind: type[E], name: str) -> E:
    """Return the member of an Enum with value `name`; raises ValueError listing the known values."""
    return enum_member(kind, name, kind.__name__)
