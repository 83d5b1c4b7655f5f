"""With vLLM engines every parameter passes through: the same request sent straight to a vLLM engine and through
Sluice (admission, router, the engine's agent) gives the same tokens and log-probabilities (within float
tolerance): greedy with logprobs, penalties, logit_bias, stop strings; seeded sampling with min_p and n; and
structured output (vLLM's own grammar applies the schema). Named so it runs before test_vllm_engines.py's
destructive tests on the shared session stack.
"""

from __future__ import annotations

import json
import math
import urllib.request
from typing import Any

import pytest

from sluice_tools.stack import Stack
from tests.engines.conftest import engine_url

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

PROMPT = [72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 44, 32, 116, 104, 101]  # "Hello world, the"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "city": {"enum": ["Paris", "Lima"]}},
          "required": ["ok", "city"], "additionalProperties": False}
CASES: list[dict[str, Any]] = [
    {"temperature": 0, "max_tokens": 12, "logprobs": 3, "ignore_eos": True},
    {"temperature": 0, "max_tokens": 12, "logprobs": 0, "presence_penalty": 1.5, "frequency_penalty": 0.5,
     "repetition_penalty": 1.3, "ignore_eos": True},
    {"temperature": 0, "max_tokens": 12, "logprobs": 1, "logit_bias": {"65": 4.0, "66": -100}, "ignore_eos": True},
    {"temperature": 0, "max_tokens": 24, "logprobs": 0, "stop": ["e"], "ignore_eos": True},
    {"temperature": 0.9, "max_tokens": 12, "seed": 1234, "min_p": 0.1, "n": 2, "logprobs": 0, "ignore_eos": True},
]


def _post(url: str, body: dict[str, Any], api_key: str = "") -> dict[str, Any]:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(request, timeout=300) as reply:  # noqa: S310 (loopback)
        result: dict[str, Any] = json.loads(reply.read())
    return result


def _choices(answer: dict[str, Any]) -> list[tuple[str, list[str], list[float]]]:
    """Return (text, logprob tokens, logprobs) per choice, in index order."""
    out = []
    for choice in sorted(answer["choices"], key=lambda c: c["index"]):
        logprobs = choice.get("logprobs") or {}
        out.append((choice["text"], logprobs.get("tokens") or [], logprobs.get("token_logprobs") or []))
    return out


@pytest.mark.parametrize("params", CASES, ids=["logprobs", "penalties", "logit_bias", "stop", "seeded_min_p_n"])
def test_the_same_request_through_sluice_equals_vllm_alone(vllm_stack: Stack, params: dict[str, Any]) -> None:
    """Tokens (`token_id:N`), log-probabilities (1e-3) and text of every choice equal vLLM's own answer (the text
    but for a trailing incomplete UTF-8 character: vLLM drops it at the end, Sluice sends it as U+FFFD)."""
    body = {"model": "tiny", "prompt": PROMPT, "return_tokens_as_token_ids": True, **params}
    direct = _choices(_post(engine_url(vllm_stack, 0), body))
    through = _choices(_post(vllm_stack.http_base_url.removesuffix("/v1"), body, api_key="k-gold"))
    assert len(through) == len(direct) == params.get("n", 1)
    for (text, tokens, logprobs), (ref_text, ref_tokens, ref_logprobs) in zip(through, direct, strict=True):
        assert tokens == ref_tokens and text.rstrip("\ufffd") == ref_text.rstrip("\ufffd")
        assert all(math.isclose(a, b, abs_tol=1e-3) for a, b in zip(logprobs, ref_logprobs, strict=True))
    if params.get("n", 1) > 1:
        assert through[0][0] != through[1][0]  # seed + j: the samples differ, in vLLM as in Sluice
    if "stop" in params:
        assert "e" not in through[0][0]


def test_structured_output_passes_through_to_vllms_grammar(vllm_stack: Stack) -> None:
    """response_format json_schema through Sluice gives vLLM's own structured answer, in the schema's property
    order (vLLM's grammar allows any whitespace, which the random tiny model fills until max_tokens)."""
    body = {"model": "tiny", "prompt": PROMPT, "temperature": 0, "max_tokens": 60,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}}
    direct = _choices(_post(engine_url(vllm_stack, 0), body))[0][0]
    through = _choices(_post(vllm_stack.http_base_url.removesuffix("/v1"), body, api_key="k-gold"))[0][0]
    assert through == direct
    assert "".join(through.split()).startswith('{"ok"')
    plain = _choices(_post(engine_url(vllm_stack, 0), {**body, "response_format": None}))[0][0]
    assert not "".join(plain.split()).startswith('{"ok"')  # without the schema vLLM writes no such thing
