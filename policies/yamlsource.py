"""YAML to plain Python data, remembering the line of every key and substituting ``${VAR}``.

``${VAR}`` and ``${VAR:-default}`` are replaced from the environment in every scalar (keys too).
An unquoted scalar is re-typed after substitution, so ``port: ${PORT}`` still becomes an int.
A value that is one ``${VAR}`` (or ``${VAR:-}``) and nothing else is recorded as coming from the
environment (a key may be given only so); any other ``${`` is an error naming the key.
Duplicate keys, which YAML would silently collapse, are errors here; merge keys (``<<``) are
resolved here too, so that a key written next to ``<<`` overrides the merged one.

Bounds: a file over ``MAX_POLICY_CHARS``, or one whose aliases or merge keys expand to more than
``MAX_VALUES`` values (a 420-byte "billion laughs" expands to 10^9), is refused with one issue,
counted as it expands; so are bytes YAML does not allow (control characters) and line breaks
only YAML sees (U+2028, U+0085, a lone CR), with their line.
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
    substituted: set[KeyPath] = field(default_factory=set)  # any ${...} in the value
    from_env: set[KeyPath] = field(default_factory=set)  # the whole value one ${VAR} (or ${VAR:-})
    issues: list[SourceIssue] = field(default_factory=list)

    def line_of(self, path: KeyPath) -> int | None:
        """The line of ``path``, or of its nearest ancestor that has one."""
        for end in range(len(path), -1, -1):
            line = self.lines.get(path[:end])
            if line is not None:
                return line
        return None


MAX_POLICY_CHARS = 4 * 1024 * 1024
MAX_VALUES = 100_000  # keys, scalars and collections once aliases and merge keys are expanded

_MERGE_TAG = "tag:yaml.org,2002:merge"
# Characters YAML reads as a line break where editors (and `grep -n`) see none: a comment
# holding one ends early and the rest of it is parsed as YAML, with errors on the wrong line.
_BREAKS = {  # its name, and what to do instead
    "\u2028": ("line separator", 'remove it, or write "\\u2028" in a double-quoted string'),
    "\u2029": ("paragraph separator", 'remove it, or write "\\u2029" in a double-quoted string'),
    "\x85": ("next line, NEL", 'remove it, or write "\\x85" in a double-quoted string'),
    "\r": ("carriage return", "end every line with LF (or every line with CR LF)"),
}
_ODD_BREAK = re.compile("[\u2028\u2029\x85]|\r(?!\n)")


class _TooManyValues(Exception):
    pass


class _Builder:
    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env
        self.values = 0
        self.constructor = SafeConstructor()
        self.resolver = Resolver()
        self.doc = SourceDoc(data=None)
        self._collections: set[int] = set()  # ids of collection nodes built once
        self.aliased = False  # a collection node was built twice (an alias or a merge key)

    def count(self) -> None:
        self.values += 1
        if self.values > MAX_VALUES:
            raise _TooManyValues

    def build(self, node: Node, path: KeyPath) -> Any:
        self.count()
        self.doc.lines.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, MappingNode):
            self._seen(node)
            return self._mapping(node, path)
        if isinstance(node, SequenceNode):
            self._seen(node)
            return [self.build(item, (*path, i)) for i, item in enumerate(node.value)]
        assert isinstance(node, ScalarNode)
        return self._scalar(node, path)

    def _seen(self, node: Node) -> None:
        if id(node) in self._collections:
            self.aliased = True
        else:
            self._collections.add(id(node))

    def _mapping(self, node: MappingNode, path: KeyPath) -> dict[Any, Any]:
        out: dict[Any, Any] = {}
        merged: list[Node] = []
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                merged.append(value_node)
                continue
            key = self._key(key_node, path)
            if key is None:
                continue
            if key in out:
                self._issue((*path, key), key_node, "duplicate key")
                continue
            child = (*path, key)
            self.doc.lines[child] = key_node.start_mark.line + 1
            out[key] = self.build(value_node, child)
        if merged:
            self._merge(out, merged, path)
        self.doc.lines.pop((*path, "<key>"), None)
        return out

    def _merge(self, out: dict[Any, Any], merged: list[Node], path: KeyPath) -> None:
        """YAML's merge key (``<<: *defaults`` or ``<<: [*a, *b]``): a key written in the
        mapping wins over a merged one, and an earlier source over a later one. Every merged
        entry is counted against ``MAX_VALUES`` as it is visited (sources that merge each other
        ten times over expand exponentially: refused at once)."""
        sources: list[Node] = []
        for value in merged:
            sources += value.value if isinstance(value, SequenceNode) else [value]
        for source in sources:
            if not isinstance(source, MappingNode):
                self._issue(path, source, "a merge key (<<) takes a mapping or a list of mappings")
                continue
            self._seen(source)
            entries = self._entries(source, path)
            for key, (key_node, value_node) in entries.items():
                self.count()
                if key in out:
                    continue
                child = (*path, key)
                self.doc.lines[child] = key_node.start_mark.line + 1
                out[key] = self.build(value_node, child)

    def _entries(self, node: MappingNode, path: KeyPath) -> dict[Any, tuple[Node, Node]]:
        """A merged mapping's entries as nodes (its own merge keys resolved), unbuilt."""
        entries: dict[Any, tuple[Node, Node]] = {}
        merged: list[Node] = []
        for key_node, value_node in node.value:
            self.count()
            if key_node.tag == _MERGE_TAG:
                merged.append(value_node)
                continue
            key = self._key(key_node, path)
            if key is not None:
                entries.setdefault(key, (key_node, value_node))  # its duplicates: reported once
        for value in merged:
            for source in value.value if isinstance(value, SequenceNode) else [value]:
                if isinstance(source, MappingNode):
                    self._seen(source)
                    for key, pair in self._entries(source, path).items():
                        self.count()
                        entries.setdefault(key, pair)
        return entries

    def _key(self, key_node: Node, path: KeyPath) -> str | None:
        key = self.build(key_node, (*path, "<key>"))
        if isinstance(key, str):
            return key
        if isinstance(key_node, ScalarNode) and key_node.value and key is not None:
            what = "a boolean" if isinstance(key, bool) else "a number"
            message = (
                f"YAML reads the key {key_node.value} as {what}: quote it ('{key_node.value}')"
            )
        else:
            message = "mapping keys must be strings"
        self._issue(path, key_node, message)
        return None

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

        whole = _VAR.fullmatch(value)
        if whole is not None and not whole.group(2):  # ${VAR} or ${VAR:-}: all of it a secret
            self.doc.from_env.add(path)
        value = _VAR.sub(replace, value)
        if "${" in _VAR.sub("", node.value):
            self._issue(
                path,
                node,
                "unsupported or unclosed ${...}: write ${VAR} or ${VAR:-default} "
                "(a variable name of letters, digits and _)",
            )
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
    odd = _odd_break(text)
    if odd is not None:
        return SourceDoc(data=None, issues=[odd])
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else None
        problem = exc.problem
        if problem == "but found another document":
            problem = "one YAML document per file (a second one begins here)"
        return SourceDoc(data=None, issues=[SourceIssue((), line, f"invalid YAML: {problem}")])
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
    except _TooManyValues:
        message = f"the policy expands to more than {MAX_VALUES} values (keys, scalars and lists)"
        if builder.aliased:
            message += ": YAML aliases or merge keys (<<) that repeat each other"
        builder.doc.data = None
        builder.doc.issues = [SourceIssue((), None, message)]
    except RecursionError:
        builder.doc.data = None
        builder.doc.issues = [SourceIssue((), None, "invalid YAML: nested too deeply")]
    except ConstructorError as exc:
        mark = exc.problem_mark
        line = mark.line + 1 if mark else None
        builder.doc.issues.append(SourceIssue((), line, f"invalid YAML value: {exc.problem}"))
    return builder.doc


def _odd_break(text: str) -> SourceIssue | None:
    """A line break only YAML sees (U+2028, U+2029, U+0085, a CR without LF where lines end
    in LF), with the line an editor shows it on."""
    if text.isascii() and "\r" not in text:
        return None  # the common case, at C speed
    found = _ODD_BREAK.search(text)
    if found is None:
        return None
    char = found.group()
    if char == "\r" and "\n" not in text:
        return None  # a file whose every line ends in CR alone (old Mac): YAML and editors agree
    line = text.count("\n", 0, found.start()) + 1
    name, fix = _BREAKS[char]
    message = (
        f"the character U+{ord(char):04X} ({name}) is a line break to YAML but not to most "
        f"editors, so what follows it on this line would be read as YAML: {fix}"
    )
    return SourceIssue((), line, message)
