"""The KV transfer term of the cost model: seconds to move a request's KV blocks from a prefill to a decode replica.

    time = latency_s + kv_bytes_per_token * tokens / bandwidth

Bytes per token are the model's (`CostModel.kv_bytes_per_token`: layers x 2 x kv heads x head dim x dtype bytes;
131,072 B = 128 KiB for Llama-3-8B in BF16). A transfer moves every prompt token's KV, partial last block
included. One transfer at a time per replica and direction (a GPU's NVLink or NIC carries one stream at full
rate), so concurrent hand-offs from one prefill replica queue (`LinkClock`).

Profiles (per GPU, one direction, peak: what a well-tuned transfer library approaches, not what it always gets):
- `nvlink`: NVLink 4 on H100/H200 SXM, 900 GB/s per GPU in total (NVIDIA H200 Tensor Core GPU datasheet), i.e.
  450 GB/s each way; latency 5 us (an assumption: the order of a CUDA peer copy's launch and completion).
- `rdma`: one 400 Gb/s ConnectX-7 NIC per GPU (NVIDIA DGX H200 user guide: eight single-port ConnectX-7, 400 Gb/s
  InfiniBand or Ethernet each), i.e. 50 GB/s; latency 20 us (an assumption: a few network round trips of
  registration and completion per transfer).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LINKS", "LinkClock", "LinkProfile", "link_profile", "transfer_seconds"]


@dataclass(frozen=True)
class LinkProfile:
    """A link between a prefill and a decode GPU."""

    name: str
    bandwidth_bytes_per_s: float
    """One direction, peak."""
    latency_s: float
    """Fixed cost of one transfer (set-up and completion), whatever its size."""


LINKS: dict[str, LinkProfile] = {
    "nvlink": LinkProfile("nvlink", 450e9, 5e-6),
    "rdma": LinkProfile("rdma", 50e9, 20e-6),
}


def link_profile(name: str) -> LinkProfile:
    """Return the named link profile; raises ValueError listing the known ones."""
    try:
        return LINKS[name]
    except KeyError:
        raise ValueError(f"unknown KV link {name!r}; known: {', '.join(sorted(LINKS))}") from None


def transfer_seconds(tokens: int, kv_bytes_per_token: int, link: LinkProfile) -> float:
    """Return the seconds one transfer of `tokens` tokens' KV takes on `link` (0 tokens: nothing moves, 0 s)."""
    if tokens <= 0:
        return 0.0
    return link.latency_s + tokens * kv_bytes_per_token / link.bandwidth_bytes_per_s


@dataclass
class LinkClock:
    """When each replica's outgoing and incoming link is free again (transfers on one link run one at a time)."""

    egress_free_at: dict[str, float]
    ingress_free_at: dict[str, float]

    @classmethod
    def empty(cls) -> LinkClock:
        return cls({}, {})

    def book(self, source: str, target: str, now: float, seconds: float) -> tuple[float, float]:
        """Book a transfer of `seconds` from `source` to `target` at or after `now`; return (start, end)."""
        start = max(now, self.egress_free_at.get(source, 0.0), self.ingress_free_at.get(target, 0.0))
        end = start + seconds
        self.egress_free_at[source] = end
        self.ingress_free_at[target] = end
        return start, end
