"""Load a policy file: YAML -> typed ``Policy``, every error naming file, line and key path."""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from policies.backends import AnthropicBackend, OpenAIBackend
from policies.models import ModelRoute, TieredModelConfig
from policies.routing import STRATEGIES
from policies.schema import Policy
from policies.surfaces import action_errors
from policies.yamlsource import MAX_POLICY_CHARS, KeyPath, SourceDoc, parse_yaml


@dataclass(frozen=True)
class PolicyIssue:
    file: str
    line: int | None
    path: KeyPath
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        key = format_path(self.path)
        return f"{where}: {key}: {self.message}" if key else f"{where}: {self.message}"


class PolicyError(Exception):
    """A policy that must not be used; ``issues`` lists every problem found."""

    def __init__(self, issues: list[PolicyIssue]) -> None:
        self.issues = issues
        super().__init__("\n".join(listed(issues)))


MAX_ISSUES = 20  # problems listed one by one; past it, one line counts the rest


def listed(issues: list[PolicyIssue]) -> list[str]:
    """The problems as listed: the first ``MAX_ISSUES``, then how many more there are."""
    lines = [str(i) for i in issues[:MAX_ISSUES]]
    if len(issues) > MAX_ISSUES:
        lines.append(f"and {len(issues) - MAX_ISSUES} more problem(s)")
    return lines


def format_path(path: KeyPath) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


@dataclass(frozen=True)
class PolicySource:
    """Where a policy came from, to name the file and line of problems found after loading."""

    file: str
    doc: SourceDoc | None = None

    def issue(self, path: KeyPath, message: str) -> PolicyIssue:
        return PolicyIssue(self.file, self.doc.line_of(path) if self.doc else None, path, message)


def load_policy(path: str | Path, env: Mapping[str, str] | None = None) -> Policy:
    """Read and validate ``path``; raises ``PolicyError`` (never a partial policy)."""
    return read_policy(path, env)[0]


def read_policy(
    path: str | Path, env: Mapping[str, str] | None = None
) -> tuple[Policy, PolicySource]:
    """``load_policy``, and the source that locates later problems in the file."""
    return parse_policy_source(read_policy_text(path), str(path), env)


def read_policy_text(path: str | Path) -> str:
    """The file's text: bounded in size and UTF-8, or a ``PolicyError`` naming the line."""
    file = str(path)
    try:
        size = Path(path).stat().st_size
        if size > MAX_POLICY_CHARS:
            raise PolicyError(
                [PolicyIssue(file, None, (), f"the file is over {MAX_POLICY_CHARS} bytes")]
            )
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise PolicyError([PolicyIssue(file, None, (), f"cannot read: {exc.strerror}")]) from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        issue = PolicyIssue(file, line, (), f"not UTF-8 (byte 0x{raw[exc.start]:02x})")
        raise PolicyError([issue]) from None
    return text


def parse_policy(text: str, file: str = "<policy>", env: Mapping[str, str] | None = None) -> Policy:
    return parse_policy_source(text, file, env)[0]


def parse_policy_source(
    text: str, file: str = "<policy>", env: Mapping[str, str] | None = None
) -> tuple[Policy, PolicySource]:
    policy, source, issues = validate_policy(text, file, env)
    if issues or policy is None:
        raise PolicyError(issues)
    return policy, source


def validate_policy(
    text: str, file: str = "<policy>", env: Mapping[str, str] | None = None
) -> tuple[Policy | None, PolicySource, list[PolicyIssue]]:
    """Every issue found (``listed`` shows the first ``MAX_ISSUES``, then their count), with
    the policy when its schema holds (so that checks which need it, the cross-section rules and
    ``prepare``, can still report theirs): ``llm-gateway check`` reports them all at once."""
    return _validate(text, file, env)


def _validate(
    text: str, file: str, env: Mapping[str, str] | None
) -> tuple[Policy | None, PolicySource, list[PolicyIssue]]:
    env = os.environ if env is None else env
    doc = parse_yaml(text, env)
    source = PolicySource(file, doc)
    issues = [PolicyIssue(file, i.line, i.path, i.message) for i in doc.issues]
    if doc.data is None and issues:
        return None, source, issues
    if not isinstance(doc.data, dict):
        return (
            None,
            source,
            [*issues, PolicyIssue(file, 1, (), "the policy must be a mapping of sections")],
        )
    try:
        policy = Policy.model_validate(doc.data)
    except ValidationError as exc:
        return None, source, [*issues, *_from_validation(exc, doc, file)]
    issues += [PolicyIssue(file, doc.line_of(p), p, m) for p, m in cross_check(policy, doc, env)]
    return policy, source, issues


def _from_validation(exc: ValidationError, doc: SourceDoc, file: str) -> list[PolicyIssue]:
    issues = []
    for err in exc.errors(include_url=False):
        path = _data_path(doc.data, err["loc"])
        message = err["msg"]
        if err["type"] == "extra_forbidden":
            message = "unknown key"
        elif err["type"] == "missing":
            message = "required key is missing"
        elif err["type"] == "union_tag_invalid":
            message = (
                f"unknown kind {err['input'].get('kind')!r} (expected vllm, openai or anthropic)"
            )
        elif err["type"] == "union_tag_not_found":
            message = "missing key 'kind' (vllm, openai or anthropic)"
        elif err["type"] in ("model_type", "model_attributes_type", "dict_type"):
            message = (
                "is empty: give its settings (key: value)"
                if err["input"] is None
                else "should be a mapping of settings (key: value)"
            )
        elif message.startswith("Value error, "):
            message = message[len("Value error, ") :]
        issues.append(PolicyIssue(file, doc.line_of(path), path, message))
    return issues


# The tags of the schema's unions (a backend's kind, a routing strategy, a model entry's form):
# pydantic puts them in an error's location, where the file has no such key.
_UNION_TAGS = frozenset({"vllm", "openai", "anthropic", "route", "tiered", *STRATEGIES})


def _data_path(data: Any, loc: tuple[int | str, ...]) -> KeyPath:
    """Map a pydantic error location onto the document, dropping union tags it inserts."""
    path: list[str | int] = []
    node = data
    for part in loc:
        if isinstance(node, dict) and part in node:
            node = node[part]
            path.append(part)
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
            path.append(part)
        elif (node is None or isinstance(node, dict)) and part in _UNION_TAGS:
            continue  # a union tag (kind: vllm, strategy: prefix, route) that pydantic puts in loc
        else:
            path.append(part)  # a missing or unknown key: name it
            node = None
    return tuple(path)


def cross_check(
    policy: Policy, doc: SourceDoc, env: Mapping[str, str]
) -> list[tuple[KeyPath, str]]:
    """Rules that span sections; each returns the key path it is about."""
    problems: list[tuple[KeyPath, str]] = []
    backends = policy.backends
    for alias, entry in policy.models.items():
        if isinstance(entry, TieredModelConfig):
            for i, tier in enumerate(entry.tiers):
                if tier.backend not in backends:
                    problems.append(
                        (("models", alias, "tiers", i), f"no backend named {tier.backend!r}")
                    )
            continue
        route = entry
        if route.backend not in backends:
            problems.append((("models", alias, "backend"), f"no backend named {route.backend!r}"))
        for i, target in enumerate(route.fallbacks):
            if target.backend not in backends:
                problems.append(
                    (("models", alias, "fallbacks", i), f"no backend named {target.backend!r}")
                )
    if not policy.models and not any(
        getattr(b, "discover_models", False) for b in backends.values()
    ):
        problems.append((("models",), "no models: declare one or set discover_models on a backend"))
    for name, backend in backends.items():
        if isinstance(backend, OpenAIBackend | AnthropicBackend):
            problems += _env_name_problems(
                ("backends", name, "api_key_env"), backend.api_key_env, doc, env
            )
        elif backend.api_key and ("backends", name, "api_key") not in doc.from_env:
            problems.append((("backends", name, "api_key"), _PLAINTEXT))
    for setting, token_env in (
        ("admin_token_env", policy.server.admin_token_env),
        ("metrics_token_env", policy.server.metrics_token_env),
    ):
        where: KeyPath = ("server", setting)
        found = _env_name_problems(where, token_env, doc, env)
        problems += found
        token = env.get(token_env) if token_env is not None and not found else None
        if token is not None and (len(token) < 16 or re.search(r"[\s\x00-\x1f\x7f]", token)):
            named = "its variable" if where in doc.substituted else str(token_env)
            problems.append(  # never the value
                (
                    where,
                    f"the token in {named} must have at least 16 characters and no spaces "
                    "or control characters (is the variable padded, or does it end in a newline? "
                    "HTTP strips a header's trailing whitespace, so such a token could never match)",
                )
            )
    seen_keys: dict[str, str] = {}  # sha256 digest -> tenant: one key, whichever way it is given
    for tenant, spec in policy.tenants.items():
        given: list[tuple[KeyPath, str]] = []
        for i, key in enumerate(spec.api_keys):
            path: KeyPath = ("tenants", tenant, "api_keys", i)
            if path not in doc.from_env:
                problems.append((path, f"{_PLAINTEXT}, or as api_key_sha256"))
            given.append((path, hashlib.sha256(key.encode("utf-8", "replace")).hexdigest()))
        given += [
            (("tenants", tenant, "api_key_sha256", i), d) for i, d in enumerate(spec.api_key_sha256)
        ]
        for path, digest in given:
            if digest in seen_keys and seen_keys[digest] != tenant:
                problems.append(
                    (path, f"the same key is also given to tenant {seen_keys[digest]!r}")
                )
            seen_keys[digest] = tenant
        if not spec.api_keys and not spec.api_key_sha256:
            problems.append((("tenants", tenant), "a tenant needs api_keys or api_key_sha256"))
    problems += _budget_problems(policy)
    headers: dict[str, str] = {}
    for name, surface in policy.surfaces.items():
        base: KeyPath = ("surfaces", name)
        for i, tenant in enumerate(surface.match.tenants):
            if tenant not in policy.tenants:
                problems.append(((*base, "match", "tenants", i), f"no tenant named {tenant!r}"))
        header = surface.match.header
        if header is not None:
            if header in headers:
                problems.append(
                    ((*base, "match", "header"), f"surface {headers[header]!r} matches it already")
                )
            headers[header] = name
        budget = surface.budget
        for message in action_errors(surface.actions, budget):
            problems.append(((*base, "actions"), message))
        if budget.total_ms is not None:
            if budget.ttft_ms is not None and budget.ttft_ms > budget.total_ms:
                problems.append(
                    (
                        (*base, "budget", "ttft_ms"),
                        f"ttft_ms ({budget.ttft_ms:g}) exceeds total_ms ({budget.total_ms:g})",
                    )
                )
            if budget.itl_ms is not None and budget.itl_ms > budget.total_ms:
                problems.append(
                    (
                        (*base, "budget", "itl_ms"),
                        f"itl_ms ({budget.itl_ms:g}) exceeds total_ms ({budget.total_ms:g})",
                    )
                )
    return problems


_PLAINTEXT = (
    "plaintext API key in the file: give it as ${ENV_VAR} alone (no default, no text around)"
)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _env_name_problems(
    path: KeyPath, name: str | None, doc: SourceDoc, env: Mapping[str, str]
) -> list[tuple[KeyPath, str]]:
    """An ``*_env`` setting names a variable; what it holds is never printed (a secret put
    where its name belongs, ``api_key_env: ${OPENAI_API_KEY}``, must not reach a log)."""
    if name is None:
        return []
    key = path[-1]
    if path in doc.substituted:
        if not _ENV_NAME.fullmatch(name):
            return [
                (
                    path,
                    f"{key} takes the NAME of an environment variable, but ${{...}} put a value "
                    f"there that is no variable name (not shown): write {key}: VAR_NAME, "
                    "without ${}",
                )
            ]
        if not env.get(name):
            return [(path, "the environment variable it names (through ${...}) is not set")]
        return []
    if not _ENV_NAME.fullmatch(name):
        return [(path, f"{key} takes the name of an environment variable (letters, digits, _)")]
    if not env.get(name):
        return [(path, f"environment variable {name} is not set")]
    return []


def _budget_problems(policy: Policy) -> list[tuple[KeyPath, str]]:
    """A budget can be spent only on priced models, and downgrades to a model that exists."""
    problems: list[tuple[KeyPath, str]] = []
    priced = any(_has_price(entry) for entry in policy.models.values())
    for tenant, spec in policy.tenants.items():
        budget = spec.budget
        if budget is None:
            continue
        path: KeyPath = ("tenants", tenant, "budget")
        if not priced:
            problems.append(
                (path, "no model has a price (models.<alias>.price): nothing spends it")
            )
        if budget.downgrade_to is not None and budget.downgrade_to not in policy.models:
            problems.append(
                ((*path, "downgrade_to"), f"no model alias named {budget.downgrade_to!r}")
            )
    return problems


def _has_price(entry: ModelRoute | TieredModelConfig) -> bool:
    if entry.price is not None:
        return True
    targets = entry.tiers if isinstance(entry, TieredModelConfig) else entry.fallbacks
    return any(t.price is not None for t in targets)
