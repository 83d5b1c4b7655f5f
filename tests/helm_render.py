"""A test-only renderer for the subset of Helm's template language deploy/helm/sluice uses.

No `helm` binary is packaged where this project installs from, so the chart's structural tests render it
here, quickly and without a native library; tests/unit/test_helm_sdk.py proves that Helm's own engine (its Go
SDK, from the helm-python-sdk wheel) renders exactly the same documents for every tested set of values.
This is not Helm: it understands only what the chart's templates use, and refuses anything else loudly, so
a template that uses more fails the tests instead of rendering wrongly:

    {{ .Values.a.b }}  {{ .Release.Namespace }}  {{ .Release.Name }}  {{ .Chart.AppVersion }}  {{ .key }}
    {{ .Files.Get "path" }}  "string"  123   pipelines with |   (sub-expressions)   {{- and -}} trimming
    functions: eq A B, not A, quote A, toYaml A, toJson A, indent N A, nindent N A, default D V,
               dict "k" V ..., include "name" DOT, fail "message"
    {{- if COND }} ... {{- else }} ... {{- end }}     {{- define "name" }} ... {{- end }} (at the top level)

`.` is the whole release (.Values, .Release, .Chart) except inside a `define`, where it is what `include` passed
(the chart passes a `dict` holding .Values and .Release, so the same paths work there). Every template under
templates/ contributes its defines; files named `_*` render nothing themselves, as in Helm.
A missing value is an error here (Helm would print `<no value>`), so a misspelt key fails the tests; `fail`
raises `RenderFailed` with its message (Helm stops rendering with it too).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = ["RenderFailed", "render_chart"]

ACTION = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.DOTALL)
WORD = re.compile(r'"(?:[^"\\]|\\.)*"|[()|]|[^\s()|]+')


class RenderFailed(ValueError):
    """A template called `fail`: the chart refuses these values (the message says why)."""


@dataclass
class _If:
    condition: str
    then: list[Any] = field(default_factory=list)
    otherwise: list[Any] = field(default_factory=list)


@dataclass
class _Define:
    name: str
    body: list[Any] = field(default_factory=list)


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
    """A tree of text, actions, _If and _Define nodes; raises ValueError on unbalanced or unknown control words."""
    root: list[Any] = []
    stack: list[tuple[_If | _Define, list[Any]]] = []
    body = root
    for kind, value in tokens:
        if kind == "text":
            body.append(value)
        elif value.startswith("if "):
            condition = _If(value[3:].strip())
            body.append(condition)
            stack.append((condition, body))
            body = condition.then
        elif value.startswith("define "):
            if stack:
                raise ValueError(f"{{{{ {value} }}}} inside another block")
            define = _Define(json.loads(value[7:].strip()))
            body.append(define)
            stack.append((define, body))
            body = define.body
        elif value == "else":
            top = stack[-1][0] if stack else None
            if not isinstance(top, _If):
                raise ValueError("an {{ else }} outside an {{ if }}")
            body = top.otherwise
        elif value == "end":
            body = stack.pop()[1]
        elif value.split(" ", 1)[0] in ("range", "with", "template", "block", "else"):
            raise ValueError(f"the test renderer does not support {{{{ {value} }}}}")
        else:
            body.append(("action", value))
    if stack:
        raise ValueError("an {{ if }} or {{ define }} has no {{ end }}")
    return root


def _words(expr: str) -> list[str]:
    """The words of an expression: quoted strings, parentheses, pipes and everything between."""
    return WORD.findall(expr)


class _Context:
    def __init__(self, chart: Path, dot: Any, defines: dict[str, list[Any]]) -> None:
        self.chart, self.dot, self.defines = chart, dot, defines

    def within(self, dot: Any) -> _Context:
        """The same chart and defines with another `.` (inside an included define)."""
        return _Context(self.chart, dot, self.defines)

    def term(self, word: str) -> Any:
        if word.startswith('"'):
            return json.loads(word)
        if re.fullmatch(r"-?\d+", word):
            return int(word)
        if word == ".":
            return self.dot
        if word.startswith("."):
            value: Any = self.dot
            for part in word.split(".")[1:]:
                if not isinstance(value, dict) or part not in value:
                    raise KeyError(f"{word}: no such value")
                value = value[part]
            return value
        raise ValueError(f"the test renderer does not know {word!r}")

    def include(self, name: str, dot: Any) -> str:
        if name not in self.defines:
            raise KeyError(f"include {name!r}: no such define")
        return _emit(self.defines[name], self.within(dot))

    def fail(self, message: Any) -> None:
        raise RenderFailed(str(message))

    def command(self, name: str, args: list[Any]) -> Any:
        functions: dict[str, Callable[..., Any]] = {
            "eq": lambda a, b: a == b, "not": lambda a: not a, "quote": lambda a: json.dumps(str(a)),
            "toYaml": lambda a: yaml.safe_dump(a, default_flow_style=False, sort_keys=True).rstrip("\n"),
            "toJson": lambda a: json.dumps(a, separators=(",", ":")),
            "indent": lambda n, a: "\n".join(" " * n + line for line in str(a).split("\n")),
            "nindent": lambda n, a: "\n" + "\n".join(" " * n + line for line in str(a).split("\n")),
            "default": lambda fallback, a: a if a else fallback,
            "dict": lambda *pairs: dict(zip(pairs[::2], pairs[1::2], strict=True)),
            "include": self.include, "fail": self.fail,
            ".Files.Get": lambda path: (self.chart / path).read_text(),
        }
        if name not in functions:
            raise ValueError(f"the test renderer does not know the function {name!r}")
        return functions[name](*args)

    def pipeline(self, words: list[str]) -> Any:
        """Evaluate a pipeline (its words, parentheses balanced): each stage's result is the next one's last argument."""
        stages: list[list[Any]] = [[]]
        depth, start = 0, 0
        for position, word in enumerate(words):
            if word == "(":
                depth, start = depth + 1, position if depth == 0 else start
            elif word == ")":
                depth -= 1
                if depth == 0:
                    stages[-1].append(("value", self.pipeline(words[start + 1:position])))
            elif depth == 0 and word == "|":
                stages.append([])
            elif depth == 0:
                stages[-1].append(("word", word))
        if depth:
            raise ValueError(f"unbalanced parentheses in {' '.join(words)!r}")
        piped: list[Any] = []
        for stage in stages:
            piped = [self._stage(stage, piped)]
        return piped[0]

    def _stage(self, stage: list[tuple[str, Any]], piped: list[Any]) -> Any:
        """One command of a pipeline: a function and its arguments (the piped value last), or a lone value."""
        kind, first = stage[0]
        args = [value if k == "value" else self.term(value) for k, value in stage[1:]] + piped
        if kind == "value" or (first != ".Files.Get" and re.match(r'[".\d-]', first)):
            if args:
                raise ValueError(f"the test renderer cannot call {first!r} with arguments")
            return first if kind == "value" else self.term(first)
        return self.command(first, args)


def _emit(nodes: list[Any], context: _Context) -> str:
    out = []
    for node in nodes:
        if isinstance(node, str):
            out.append(node)
        elif isinstance(node, _Define):
            continue  # collected before rendering; a define renders nothing where it stands
        elif isinstance(node, _If):
            out.append(_emit(node.then if context.pipeline(_words(node.condition)) else node.otherwise, context))
        else:
            value = context.pipeline(_words(node[1]))
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
    """Render every template of `chart` with values.yaml merged with `overrides`; return the documents.

    Raises RenderFailed when a template calls `fail`, ValueError or KeyError when the chart uses what this
    renderer does not understand or a value that does not exist."""
    values = _merge(yaml.safe_load((chart / "values.yaml").read_text()), overrides or {})
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    templates = {path: _parse(_tokens(path.read_text())) for path in sorted((chart / "templates").iterdir())
                 if path.suffix in (".yaml", ".tpl")}
    defines = {node.name: node.body for tree in templates.values() for node in tree if isinstance(node, _Define)}
    release = {"Values": values, "Release": {"Namespace": namespace, "Name": name},
               "Chart": {"AppVersion": meta["appVersion"]}}
    context = _Context(chart, release, defines)
    documents: list[dict[str, Any]] = []
    for template, tree in templates.items():
        if template.name.startswith("_"):
            continue
        text = _emit(tree, context)
        try:
            documents += [doc for doc in yaml.safe_load_all(text) if doc]
        except yaml.YAMLError as exc:
            raise ValueError(f"{template.name} renders invalid YAML: {exc}\n{text}") from exc
    return documents
