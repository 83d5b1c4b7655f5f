"""Helm itself (its Go SDK, through the helm-python-sdk wheel from PyPI: no `helm` binary is packaged for this
machine's registries) lints deploy/helm/sluice clean and renders it exactly as the test-only renderer
(tests/helm_render.py) does, so the Kubernetes-schema validation and every check of tests/unit/test_helm_chart.py,
made on that renderer's output, hold for what `helm install` applies."""

from __future__ import annotations

import json
from typing import Any

import helm_python as helm
import pytest
import yaml

from tests.helm_render import RenderFailed, render_chart
from tests.unit.test_helm_chart import CHART, VARIANTS


def _canonical(documents: list[dict[str, Any]]) -> list[str]:
    return sorted(json.dumps(doc, sort_keys=True) for doc in documents)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_helm_lint_finds_nothing(variant: str) -> None:
    """`helm lint --strict` with the variant's values reports no error and no warning."""
    report = helm.lint(str(CHART), VARIANTS[variant], strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report["messages"]
    assert report["total_charts_linted"] == 1


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_helm_renders_what_the_test_renderer_renders(variant: str) -> None:
    """Helm's own template engine (`helm template`) gives the same documents as tests/helm_render.py."""
    manifests = helm.Chart.load(str(CHART)).render(VARIANTS[variant], name="sluice", namespace="sluice",
                                                    is_install=True)
    by_helm = [doc for text in manifests.values() for doc in yaml.safe_load_all(text) if doc]
    assert len(by_helm) > 10
    assert _canonical(by_helm) == _canonical(render_chart(CHART, VARIANTS[variant]))


def test_helm_refuses_disagg_with_engine_vllm_with_the_test_renderers_message() -> None:
    """engine vllm with disagg.enabled: Helm's engine stops at the chart's `fail` too, with the same message."""
    values = {"engine": "vllm", "disagg": {"enabled": True}}
    with pytest.raises(RenderFailed) as ours:
        render_chart(CHART, values)
    with pytest.raises(helm.HelmRenderError) as helms:
        helm.Chart.load(str(CHART)).render(values, name="sluice", namespace="sluice", is_install=True)
    assert str(ours.value) in str(helms.value) and "disagg.enabled" in str(ours.value)
