"""YAML to plain Python data, remembering the line of every key and substituting ``${VAR}``.

``${VAR}`` and ``${VAR:-default}`` are replaced from the environment in every scalar (keys too).
An unquoted scalar is re-typed after substitution, so ``port: ${PORT}`` still becomes an int.
Duplicate keys, which YAML would silently collapse, are errors here.

Bounds: a file over ``MAX_POLICY_CHARS``, or one whose aliases expand to more than
``MAX_VALUES`` values (a 420-byte "billion laughs" expands to 10^9), is refused with one issue
before anything else reads it; so are bytes YAML does not allow (control characters), with
their line.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml
from yaml.constructor import ConstructorError, SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode
from yaml.resolver import Resolver

KeyPath = tuple[str | int, ...]

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


@dataclass(frozen=True)
class SourceIssue:
    path: KeyPath
    line: int | None
    message: str


@dataclass
class SourceDoc:
    data: Any
    lines: dict[KeyPath, int] = field(default_factory=dict)
    substituted: set[KeyPath] = field(default_factory=set)
    issues: list[SourceIssue] = field(default_factory=list)

    def line_of(self, path: KeyPath) -> int | None:
        """The line of ``path``, or of its nearest ancestor that has one."""
        for end in range(len(path), -1, -1):
            line = self.lines.get(path[:end])
            if line is not None:
                return line
        return None


MAX_POLICY_CHARS = 4 * 1024 * 1024
MAX_VALUES = 100_000  # keys, scalars and collections once aliases are expanded


class _TooManyValues(Exception):
    pass


class _Builder:
    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env
        self.values = 0
        self.constructor = SafeConstructor()
        self.resolver = Resolver()
        self.doc = SourceDoc(data=None)

    def build(self, node: Node, path: KeyPath) -> Any:
        self.values += 1
        if self.values > MAX_VALUES:
            raise _TooManyValues
        self.doc.lines.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, MappingNode):
            return self._mapping(node, path)
        if isinstance(node, SequenceNode):
            return [self.build(item, (*path, i)) for i, item in enumerate(node.value)]
        assert isinstance(node, ScalarNode)
        return self._scalar(node, path)

    def _mapping(self, node: MappingNode, path: KeyPath) -> dict[Any, Any]:
        self.constructor.flatten_mapping(node)
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = self.build(key_node, (*path, "<key>"))
            if not isinstance(key, str | int):
                self._issue(path, key_node, "mapping keys must be strings")
                continue
            if key in out:
                self._issue((*path, key), key_node, "duplicate key")
                continue
            child = (*path, key)
            self.doc.lines[child] = key_node.start_mark.line + 1
            out[key] = self.build(value_node, child)
        self.doc.lines.pop((*path, "<key>"), None)
        return out

    def _scalar(self, node: ScalarNode, path: KeyPath) -> Any:
        value = node.value
        if "${" not in value:
            return self.constructor.construct_object(node, deep=True)
        missing: list[str] = []

        def replace(m: re.Match[str]) -> str:
            name, default = m.group(1), m.group(2)
            if name in self.env and (self.env[name] != "" or default is None):
                return self.env[name]
            if default is not None:
                return default
            missing.append(name)
            return ""

        value = _VAR.sub(replace, value)
        for name in missing:
            self._issue(path, node, f"environment variable {name} is not set")
        self.doc.substituted.add(path)
        if node.style is None:  # plain scalar: let YAML type it again (ints, bools, null)
            tag = self.resolver.resolve(ScalarNode, value, (True, False))  # type: ignore[no-untyped-call]
            return self.constructor.construct_object(ScalarNode(tag, value), deep=True)
        return value

    def _issue(self, path: KeyPath, node: Node, message: str) -> None:
        self.doc.issues.append(SourceIssue(path, node.start_mark.line + 1, message))


def parse_yaml(text: str, env: Mapping[str, str] | None = None) -> SourceDoc:
    """Parse ``text``; syntax errors become issues with the line YAML reports."""
    if len(text) > MAX_POLICY_CHARS:
        message = f"the policy is over {MAX_POLICY_CHARS} characters"
        return SourceDoc(data=None, issues=[SourceIssue((), None, message)])
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else None
        return SourceDoc(data=None, issues=[SourceIssue((), line, f"invalid YAML: {exc.problem}")])
    except yaml.reader.ReaderError as exc:  # a character YAML does not allow
        line = text.count("\n", 0, exc.position) + 1
        char = exc.character
        code = char if isinstance(char, int) else ord(char)
        message = f"invalid YAML: character U+{code:04X} is not allowed (a control character)"
        return SourceDoc(data=None, issues=[SourceIssue((), line, message)])
    except RecursionError:
        return SourceDoc(
            data=None, issues=[SourceIssue((), None, "invalid YAML: nested too deeply")]
        )
    builder = _Builder(os.environ if env is None else env)
    if root is None:
        builder.doc.data = {}
        return builder.doc
    try:
        builder.doc.data = builder.build(root, ())
    except (_TooManyValues, RecursionError):
        message = (
            f"the policy expands to more than {MAX_VALUES} values or nests too deeply "
            "(YAML aliases that repeat each other?)"
        )
        builder.doc.data = None
        builder.doc.issues.append(SourceIssue((), None, message))
    except ConstructorError as exc:
        mark = exc.problem_mark
        line = mark.line + 1 if mark else None
        builder.doc.issues.append(SourceIssue((), line, f"invalid YAML value: {exc.problem}"))
    return builder.doc
