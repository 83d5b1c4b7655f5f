"""A test-only renderer for the subset of Helm's template language deploy/helm/sluice uses.

No `helm` binary is packaged where this project installs from, so the chart's structural tests render it
here, quickly and without a native library; tests/unit/test_helm_sdk.py proves that Helm's own engine (its Go
SDK, from the helm-python-sdk wheel) renders exactly the same documents for every tested set of values.
This is not Helm: it understands only what the chart's templates use, and refuses anything else loudly, so
a template that uses more fails the tests instead of rendering wrongly:

    {{ .Values.a.b }}  {{ .Release.Namespace }}  {{ .Release.Name }}  {{ .Chart.AppVersion }}
    {{ .Files.Get "path" }}  "string"  123   pipelines with |   {{- and -}} whitespace trimming
    functions: eq A B, not A, quote A, toYaml A, toJson A, indent N A, nindent N A
    {{- if COND }} ... {{- else }} ... {{- end }}

A missing value is an error here (Helm would print `<no value>`), so a misspelt key fails the tests.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = ["render_chart"]

ACTION = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.DOTALL)


@dataclass
class _If:
    condition: str
    then: list[Any] = field(default_factory=list)
    otherwise: list[Any] = field(default_factory=list)


def _tokens(text: str) -> list[tuple[str, str]]:
    """("text", s) and ("action", expr) in order, with Helm's whitespace trimming applied."""
    out: list[tuple[str, str]] = []
    position, trim_next = 0, False
    for match in ACTION.finditer(text):
        before = text[position:match.start()]
        if trim_next:
            before = before.lstrip()
        if match.group(1):
            before = before.rstrip()
        out.append(("text", before))
        out.append(("action", match.group(2)))
        position, trim_next = match.end(), bool(match.group(3))
    rest = text[position:]
    out.append(("text", rest.lstrip() if trim_next else rest))
    return out


def _parse(tokens: list[tuple[str, str]]) -> list[Any]:
    """A tree of text, actions and _If nodes; raises ValueError on unbalanced or unknown control words."""
    root: list[Any] = []
    stack: list[tuple[_If, list[Any]]] = []
    body = root
    for kind, value in tokens:
        if kind == "text":
            body.append(value)
        elif value.startswith("if "):
            node = _If(value[3:].strip())
            body.append(node)
            stack.append((node, body))
            body = node.then
        elif value == "else":
            body = stack[-1][0].otherwise
        elif value == "end":
            body = stack.pop()[1]
        elif value.split(" ", 1)[0] in ("range", "with", "define", "template", "include", "block", "else"):
            raise ValueError(f"the test renderer does not support {{{{ {value} }}}}")
        else:
            body.append(("action", value))
    if stack:
        raise ValueError("an {{ if }} has no {{ end }}")
    return root


class _Context:
    def __init__(self, chart: Path, values: dict[str, Any], release: dict[str, str]) -> None:
        self.chart, self.values, self.release = chart, values, release
        self.meta = yaml.safe_load((chart / "Chart.yaml").read_text())

    def term(self, word: str) -> Any:
        if word.startswith('"'):
            return json.loads(word)
        if re.fullmatch(r"-?\d+", word):
            return int(word)
        if word.startswith(".Values."):
            value: Any = self.values
            for part in word.split(".")[2:]:
                if not isinstance(value, dict) or part not in value:
                    raise KeyError(f"{word}: no such value")
                value = value[part]
            return value
        if word.startswith(".Release."):
            return self.release[word.split(".")[2]]
        if word == ".Chart.AppVersion":
            return self.meta["appVersion"]
        raise ValueError(f"the test renderer does not know {word!r}")

    def command(self, words: list[str], piped: list[Any]) -> Any:
        name, args = words[0], [self.term(w) for w in words[1:]] + piped
        functions = {
            "eq": lambda a, b: a == b, "not": lambda a: not a, "quote": lambda a: json.dumps(str(a)),
            "toYaml": lambda a: yaml.safe_dump(a, default_flow_style=False, sort_keys=True).rstrip("\n"),
            "toJson": lambda a: json.dumps(a, separators=(",", ":")),
            "indent": lambda n, a: "\n".join(" " * n + line for line in str(a).split("\n")),
            "nindent": lambda n, a: "\n" + "\n".join(" " * n + line for line in str(a).split("\n")),
            ".Files.Get": lambda path: (self.chart / path).read_text(),
        }
        if name in functions:
            return functions[name](*args)
        if len(words) == 1 and not piped:
            return self.term(name)
        raise ValueError(f"the test renderer does not know the function {name!r}")

    def pipeline(self, expr: str) -> Any:
        piped: list[Any] = []
        for stage in expr.split("|"):
            piped = [self.command(shlex.split(stage.strip(), posix=False), piped)]
        return piped[0]


def _emit(nodes: list[Any], context: _Context) -> str:
    out = []
    for node in nodes:
        if isinstance(node, str):
            out.append(node)
        elif isinstance(node, _If):
            out.append(_emit(node.then if context.pipeline(node.condition) else node.otherwise, context))
        else:
            value = context.pipeline(node[1])
            out.append("" if value is None else str(value).lower() if isinstance(value, bool) else str(value))
    return "".join(out)


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        merged[key] = _merge(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) \
            else value
    return merged


def render_chart(chart: Path, overrides: dict[str, Any] | None = None, namespace: str = "sluice",
                 name: str = "sluice") -> list[dict[str, Any]]:
    """Render every template of `chart` with values.yaml merged with `overrides`; return the documents."""
    values = _merge(yaml.safe_load((chart / "values.yaml").read_text()), overrides or {})
    context = _Context(chart, values, {"Namespace": namespace, "Name": name})
    documents: list[dict[str, Any]] = []
    for template in sorted((chart / "templates").glob("*.yaml")):
        text = _emit(_parse(_tokens(template.read_text())), context)
        try:
            documents += [doc for doc in yaml.safe_load_all(text) if doc]
        except yaml.YAMLError as exc:
            raise ValueError(f"{template.name} renders invalid YAML: {exc}\n{text}") from exc
    return documents
