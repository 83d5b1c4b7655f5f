"""What `sluice up` prints is true: --public-tls covers the OpenAI HTTP port too, a configured API key is never
printed, and the printed commands work as printed (with the key exported, as the banner says)."""

from __future__ import annotations

import json
import os
import shlex
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice_tools.commands.up import _banner, mask_key
from sluice_tools.stack import Stack, StackConfig

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]
ROOT = Path(__file__).resolve().parents[2]
SECRET = "sk-acme-0123456789abcdef"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, str]]:
    """A public-TLS stack with an HTTP port and a config file holding a real-looking key."""
    run = tmp_path_factory.mktemp("banner")
    config = run / "sluice.toml"
    config.write_text(f'[tenants.acme]\napi_keys = ["{SECRET}"]\n')
    with Stack(StackConfig(backend="costmodel", model="llama-3-8b", mtls=True, public_tls=True, http_port=0,
                           config_file=str(config), run_dir=run / "run")) as running:
        yield running, str(config)


def _completion(url: str, context: ssl.SSLContext | None) -> dict:  # type: ignore[type-arg]
    request = urllib.request.Request(url + "/completions", method="POST",
                                     data=json.dumps({"model": "llama-3-8b", "prompt": "hi", "max_tokens": 3}).encode(),
                                     headers={"Authorization": f"Bearer {SECRET}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30, context=context) as reply:
        return dict(json.loads(reply.read()))


def test_public_tls_serves_the_openai_port_over_https_only(stack: tuple[Stack, str]) -> None:
    """Under --public-tls the HTTP API is https with the stack's CA; plain http on that port gets no answer."""
    running, _config = stack
    assert running.http_base_url.startswith("https://")
    assert running.tls_ca is not None
    answer = _completion(running.http_base_url, ssl.create_default_context(cafile=running.tls_ca))
    assert answer["usage"]["completion_tokens"] == 3
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        _completion(running.http_base_url.replace("https://", "http://"), None)


def test_the_banner_masks_a_configured_key_and_its_commands_work_as_printed(stack: tuple[Stack, str]) -> None:
    """The configured key appears nowhere in the banner, only its mask; the Try and curl lines succeed when run
    by a shell with SLUICE_API_KEY exported, as the banner tells."""
    running, config = stack
    banner = _banner(running, config)
    assert SECRET not in banner and mask_key(SECRET) in banner, banner
    assert "public endpoint: TLS, gRPC and HTTP" in banner and "traces:" in banner
    env = {**os.environ, "SLUICE_API_KEY": SECRET, "PYTHONPATH": str(ROOT)}
    lines = banner.splitlines()
    tried = next(line for line in lines if line.startswith("Try: ")).removeprefix("Try: ")
    done = subprocess.run(shlex.split(tried), cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    curl = next(line for line in lines if line.startswith("Or:  ")).removeprefix("Or:  ")
    done = subprocess.run(["bash", "-c", curl], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and json.loads(done.stdout)["usage"]["completion_tokens"] == 16, done.stdout + done.stderr
