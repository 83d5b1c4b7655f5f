"""What one simulated deployment looks like (frozen; built once from flags or a scenario)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from admission_svc.core import AdmissionConfig
from router_svc.core import RouterConfig, RoutingPolicy
from scheduler_svc.core.config import Policy, PreemptionMode, SchedulerConfig
from sluice.config import Budgets, TenantConfig
from worker_svc.costmodel import CostCoefficients

# vLLM V1 defaults for GPUs with >= 70 GiB that are not A100 (H100, H200), OpenAI server context:
# max_num_batched_tokens 8192, max_num_seqs 1024, chunked prefill and prefix caching on, no
# per-request prefill cap (long_prefill_token_threshold 0). Source: vllm/engine/arg_utils.py,
# EngineArgs.get_batch_defaults (vLLM 0.9+).
VLLM_DEFAULT_BATCHED_TOKENS = 8192
VLLM_DEFAULT_MAX_SEQS = 1024

# Sluice's own round budgets are the scheduler's defaults (one definition).
_SCHEDULER_DEFAULTS = SchedulerConfig(num_blocks=1)

# Per-model context limits used by the simulator (Llama 3: max_position_embeddings 8192).
DEFAULT_MAX_MODEL_LEN = {"llama-3-8b": 8192, "llama-3-70b": 8192}


@dataclass(frozen=True)
class SimConfig:
    """A deployment to simulate: replicas, their scheduler, the router, admission and the clock."""

    replicas: int = 8
    """Number of replicas (each one SchedulerCore + one cost model)."""
    gpu: str = "h200"
    """GPU profile name (worker_svc.gpu_profiles)."""
    model: str = "llama-3-8b"
    """Model shape name (Llama 3 or a repo preset)."""
    cost_coefficients: CostCoefficients | None = None
    """Fitted cost-model coefficients (`python -m worker_svc.calibrate --json`); None: datasheet defaults."""
    policy: Policy = Policy.FCFS
    """Scheduler queue order."""
    preemption: PreemptionMode = PreemptionMode.RECOMPUTE
    router: RoutingPolicy = RoutingPolicy.SCORE
    max_num_batched_tokens: int = _SCHEDULER_DEFAULTS.max_num_batched_tokens
    """Query tokens per round."""
    max_num_seqs: int = _SCHEDULER_DEFAULTS.max_num_seqs
    max_prefill_chunk: int = _SCHEDULER_DEFAULTS.max_prefill_chunk
    """Per-request prefill chunk cap (the vLLM default has none beyond the round budget)."""
    max_kv_read_tokens: int | None = None
    max_waiting: int = 4096
    """Bounded waiting queue per replica."""
    max_model_len: int | None = None
    """Prompt + max_tokens limit; None picks DEFAULT_MAX_MODEL_LEN or the model's own."""
    num_blocks: int | None = None
    """Override the KV blocks the cost model derives from GPU memory (scenarios use tiny pools)."""
    block_size: int = 16
    aging_rate: float = 1.0
    """Priority points per second of waiting (priority policy)."""
    tenant_weights: tuple[tuple[str, float], ...] = ()
    """Share weight per tenant (fair policy, fairness report)."""
    max_active_requests: int = 100_000
    """Admission: accepted and not yet terminal (all replicas together)."""
    max_queued_requests: int = 100_000
    """Admission: accepted without a first token yet."""
    max_pending_input_tokens: int = 1_000_000_000
    max_reserved_output_tokens: int = 1_000_000_000
    max_retries: int = 0
    """Client retries after an over-budget or no-replica refusal (after the advised delay)."""
    heartbeat_interval_s: float = 0.05
    """How often the router's load view is refreshed from the replicas' stats."""
    sample_interval_s: float = 1.0
    """Period of the timeline samples (queue length, running, KV use, replicas)."""
    warmup_s: float = 0.0
    """Replica warm-up: registered WARMING at t=0, READY (mark_ready) at warmup_s."""
    slo_ttft_s: float = 1.0
    slo_tpot_s: float = 0.05
    seed: int = 0
    prediction_ttl_s: float = 2.0
    """How long the router trusts its own routing decisions as cached prefixes."""
    route_prefill_weight: float = 1.0
    """The score router's weight of a request's own uncached prefill (RouterConfig.prefill_weight)."""

    def scheduler_config(self, num_blocks: int, num_host_blocks: int, max_model_len: int) -> SchedulerConfig:
        """Return one replica's scheduler configuration for the given capacity."""
        return SchedulerConfig(
            num_blocks=num_blocks,
            block_size=self.block_size,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_prefill_chunk=self.max_prefill_chunk,
            max_kv_read_tokens=self.max_kv_read_tokens,
            max_waiting=self.max_waiting,
            policy=self.policy,
            aging_rate=self.aging_rate,
            tenant_weights=self.tenant_weights,
            preemption_mode=self.preemption,
            num_host_blocks=num_host_blocks if self.preemption is PreemptionMode.SWAP else 0,
            model_id=self.model,
            max_model_len=max_model_len,
        )

    def admission_config(self, max_model_len: int) -> AdmissionConfig:
        """Return the front door's budgets."""
        return AdmissionConfig(
            budgets=Budgets(max_active_requests=self.max_active_requests, max_queue_length=self.max_queued_requests,
                            max_pending_input_tokens=self.max_pending_input_tokens,
                            max_reserved_output_tokens=self.max_reserved_output_tokens),
            max_model_len=max_model_len,
            tenants=tuple(TenantConfig(name, weight=weight) for name, weight in self.tenant_weights),
        )

    def router_config(self) -> RouterConfig:
        """Return the router's configuration (seeded from the simulation seed)."""
        return RouterConfig(
            policy=self.router,
            seed=self.seed,
            prediction_ttl_s=self.prediction_ttl_s,
            prefill_weight=self.route_prefill_weight,
        )


def vllm_default(config: SimConfig) -> SimConfig:
    """Return `config` with vLLM V1's default round budgets on H100/H200 (an honest baseline)."""
    return replace(
        config,
        max_num_batched_tokens=VLLM_DEFAULT_BATCHED_TOKENS,
        max_num_seqs=VLLM_DEFAULT_MAX_SEQS,
        max_prefill_chunk=VLLM_DEFAULT_BATCHED_TOKENS,
        max_kv_read_tokens=None,
    )


def parse_enum(kind: type, name: str) -> object:
    """Return the member of an Enum with value `name`; raises ValueError listing the known values."""
    try:
        return kind(name)
    except ValueError:
        known = ", ".join(member.value for member in kind)  # type: ignore[attr-defined]
        raise ValueError(f"unknown {kind.__name__} {name!r}; known: {known}") from None
