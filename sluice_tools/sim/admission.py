"""The simulator's admission glue: what admission_svc's front door does around AdmissionCore, on the virtual clock.

The decisions are AdmissionCore's; this module only feeds it what the front door feeds it:

- the max_tokens clients ask for: `SimConfig.client_max_tokens` (clients rarely ask for exactly what they
  will get; a trace records only what they got), clamped to the model length as clients do;
- the prompt's block-hash chain for the KV-block budget (computed only when there is one), as the front
  door hashes before reserving;
- the early refusal after routing: `check_ttft` with the router's predicted TTFT;
- the growth signal from streamed token counts, and the output length learnt at release.
"""

from __future__ import annotations

from admission_svc.core import AdmissionCore, OverBudget
from sluice.config import ReservationPolicy
from sluice.hashing import hash_chain
from sluice_tools.workload import WorkloadRequest


class SimAdmission:
    """The front door's calls into one AdmissionCore, for the simulator."""

    def __init__(self, core: AdmissionCore, model: str, client_max_tokens: int | None, max_model_len: int,
                 block_size: int, salt: int, vocab_size: int) -> None:
        self.core = core
        self.vocab_size = vocab_size
        self.model = model
        self.client_max_tokens = client_max_tokens
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.salt = salt
        self.hash_blocks = core.config.budgets.max_reserved_kv_blocks is not None or any(
            t.budgets is not None and t.budgets.max_reserved_kv_blocks is not None for t in core.config.tenants)
        self.grows = core.config.reservation.policy is not ReservationPolicy.CONSERVATIVE
        """Only a policy that reserves less than max_tokens needs the per-token growth signal."""

    def max_tokens(self, request: WorkloadRequest) -> int:
        """Return the max_tokens the client sends: `client_max_tokens` (None: the output length), clamped to
        the model length, never below what the request will generate."""
        if self.client_max_tokens is None:
            return request.output_length
        room = self.max_model_len - request.input_length
        return max(request.output_length, min(self.client_max_tokens, room))

    def admit(self, request: WorkloadRequest, now: float) -> None:
        """Validate and reserve as the front door does; raises InvalidRequest or OverBudget."""
        max_tokens = self.max_tokens(request)
        self.core.validate(request.input_length, max_tokens)
        hashes: tuple[int, ...] = ()
        if self.hash_blocks:
            hashes = tuple(hash_chain(request.prompt_token_ids(self.vocab_size), self.block_size, self.salt))
        self.core.admit(request.request_id, request.tenant, request.input_length, max_tokens, now,
                        model=self.model, block_hashes=hashes, block_size=self.block_size)

    def refused_early(self, request_id: str, predicted_ttft_s: float, now: float) -> OverBudget | None:
        """Return the early refusal of a routed request (its reservation released), or None to submit it."""
        try:
            self.core.check_ttft(request_id, predicted_ttft_s, now)
        except OverBudget as refusal:
            self.core.release(request_id, now)
            return refusal
        return None

    def on_token(self, request_id: str, index: int, now: float) -> None:
        """Token `index` of the request was streamed: the growth signal (needed only when `grows`)."""
        self.core.on_tokens(request_id, index + 1, now)

    def release(self, request_id: str, now: float, output_tokens: int | None) -> None:
        """The request is terminal: reclaim its reservation (and learn its length if it finished)."""
        self.core.release(request_id, now, output_tokens)
