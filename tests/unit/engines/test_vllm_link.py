"""What the agent sends vLLM and reads back: every sampling parameter passed through, logprobs parsed, metrics read."""

from __future__ import annotations

from scheduler_svc.core.request import Request
from scheduler_svc.engines.vllm.link import parse_logprobs, parse_metrics, request_body
from sluice.types import NewRequest, SamplingParams, TokenLogprobs


def make_request(**sampling: object) -> Request:
    params = SamplingParams(max_tokens=8, **sampling)  # type: ignore[arg-type]
    return Request(NewRequest("r1", (5, 6, 7), params, tenant="gold", priority=3, eos_token_id=257), 1)


def test_every_sampling_parameter_reaches_vllm_and_defaults_stay_out() -> None:
    """Penalties, min_p, logit_bias, logprobs, stops and the priority (negated: vLLM runs smaller first) are sent;
    parameters at vLLM's defaults are not."""
    body = request_body(make_request(temperature=0.5, top_k=4, seed=9, presence_penalty=0.5, frequency_penalty=-1.0,
                                     repetition_penalty=1.2, min_p=0.1, logit_bias=((3, 5.0),), logprobs=2,
                                     stop_strings=("END",), stop_token_ids=(9,)), "tiny", priority_passthrough=True)
    assert body["prompt"] == [5, 6, 7] and body["max_tokens"] == 8 and body["model"] == "tiny"
    assert (body["presence_penalty"], body["frequency_penalty"], body["repetition_penalty"], body["min_p"]) == (
        0.5, -1.0, 1.2, 0.1)
    assert body["logit_bias"] == {"3": 5.0} and body["logprobs"] == 2 and body["return_tokens_as_token_ids"]
    assert body["stop"] == ["END"] and body["include_stop_str_in_output"] and body["stop_token_ids"] == [9, 257]
    assert (body["priority"], body["top_k"], body["seed"]) == (-3, 4, 9)
    plain = request_body(make_request(), "tiny", priority_passthrough=False)
    assert not {"presence_penalty", "repetition_penalty", "min_p", "logit_bias", "logprobs", "priority", "top_k",
                "seed", "stop"} & set(plain)


def test_logprobs_of_a_chunk_are_read_by_token_id_most_likely_first() -> None:
    """vLLM's completions logprobs with token-id keys become one TokenLogprobs per streamed token."""
    raw = {"tokens": ["token_id:7"], "token_logprobs": [-0.5],
           "top_logprobs": [{"token_id:3": -2.0, "token_id:7": -0.5}]}
    assert parse_logprobs(raw, 1) == [TokenLogprobs(-0.5, (7, 3), (-0.5, -2.0))]
    assert parse_logprobs(raw, 2) is None and parse_logprobs(None, 1) is None


def test_metrics_are_summed_over_label_sets_and_cache_info_read() -> None:
    """The engine view sums vllm:* series; cache_config_info's labels give block size and blocks."""
    text = "\n".join([
        '# HELP vllm:num_requests_running x', 'vllm:num_requests_running{engine="0",model_name="tiny"} 2.0',
        'vllm:num_requests_running{engine="1",model_name="tiny"} 1.0', 'vllm:kv_cache_usage_perc{engine="0"} 0.25',
        'vllm:prefix_cache_hits_total{engine="0"} 64.0', 'vllm:prefix_cache_queries_total{engine="0"} 128.0',
        'vllm:cache_config_info{block_size="32",num_gpu_blocks="16384"} 1.0', 'vllm:num_requests_waiting{a="b"} NaN'])
    view, info = parse_metrics(text)
    assert (view.running, view.waiting, view.kv_usage) == (3, 0, 0.25)
    assert (view.prefix_hit_tokens, view.prefix_query_tokens) == (64, 128)
    assert (info["block_size"], info["num_gpu_blocks"]) == ("32", "16384")
