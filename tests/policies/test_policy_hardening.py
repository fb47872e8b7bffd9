"""Policy files that are hostile or careless (issue 12, items 13 and 15): one key for two
tenants, padded keys, alias bombs, bytes that are not UTF-8, control characters, huge files.
Each is a clean ``file:line: key: message``, quickly."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest

from policies.loader import PolicyError, parse_policy, read_policy

BACKEND = 'backends:\n  up: {kind: vllm, replicas: ["http://127.0.0.1:9/v1"]}\n'
KEY = "sk-shared-key-123456"


def issues(text: str, env: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "p.yaml", env or {})
    return [str(i) for i in info.value.issues]


def test_one_key_given_to_two_tenants_in_either_form_is_refused() -> None:
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    text = BACKEND + (
        f'tenants:\n  a: {{api_keys: ["${{KEY_A}}"]}}\n  b: {{api_key_sha256: ["{digest}"]}}\n'
    )
    found = issues(text, {"KEY_A": KEY})
    assert any("tenants.b.api_key_sha256[0]" in i and "'a'" in i for i in found), found
    assert not any(KEY in i for i in found)  # the key itself is never printed


@pytest.mark.parametrize(
    "value",
    [" sk-padded-key-1234", "sk-padded-key-1234 ", "sk-key-with-newline\n", "sk-key\twith-tab"],
)
def test_keys_padded_or_holding_whitespace_are_refused(value: str) -> None:
    found = issues(BACKEND + 'tenants:\n  a: {api_keys: ["${KEY_A}"]}\n', {"KEY_A": value})
    assert any("tenants.a.api_keys" in i and "spaces or control" in i for i in found), found
    assert not any(value.strip() in i for i in found)


def test_alias_bomb_is_refused_quickly() -> None:
    lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi", strict=True):
        lines.append(f"{name}: &{name} [" + ", ".join(f"*{prev}" for _ in range(9)) + "]")
    bomb = "\n".join(lines) + "\n"
    assert len(bomb) < 500
    started = time.perf_counter()
    found = issues(bomb)
    assert time.perf_counter() - started < 5
    assert any("aliases" in i for i in found), found


def test_reasonable_anchors_still_work() -> None:
    text = 'backends:\n  up: &b {kind: vllm, replicas: ["http://127.0.0.1:9/v1"]}\n  up2: *b\n'
    policy = parse_policy(text, "p.yaml", {})
    assert set(policy.backends) == {"up", "up2"}


def test_non_utf8_and_control_characters_name_their_line(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_bytes(BACKEND.encode() + b"models:\n  m: {backend: up, model: caf\xe9}\n")
    with pytest.raises(PolicyError) as info:
        read_policy(path)
    assert str(info.value) == f"{path}:4: not UTF-8 (byte 0xe9)"
    path.write_bytes(BACKEND.encode() + b"models:\n  m: {backend: up, model: a\x07b}\n")
    with pytest.raises(PolicyError) as info:
        read_policy(path)
    assert str(info.value).startswith(f"{path}:4: invalid YAML: character U+0007")


def test_huge_policy_file_is_refused_before_parsing(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(BACKEND + "# " + "x" * (5 * 1024 * 1024) + "\n")
    with pytest.raises(PolicyError) as info:
        read_policy(path)
    assert "over" in str(info.value)


def test_admin_token_env_must_be_set() -> None:
    found = issues(BACKEND + "server: {admin_token_env: ADMIN_TOKEN}\n", {})
    assert found == [
        "p.yaml:3: server.admin_token_env: environment variable ADMIN_TOKEN is not set"
    ]


@pytest.mark.parametrize("token", ["admintok-123456789\n", "short-token", "admin token 123456789"])
def test_an_admin_token_that_could_never_match_is_refused(token: str) -> None:
    """A trailing newline (a token read from a file), a space, or a guessable length: HTTP
    strips a header's trailing whitespace, so the first could never be presented at all."""
    found = issues(BACKEND + "server: {admin_token_env: ADMIN_TOKEN}\n", {"ADMIN_TOKEN": token})
    assert len(found) == 1
    assert found[0].startswith("p.yaml:3: server.admin_token_env: the token in ADMIN_TOKEN")
    assert token.strip() not in found[0]
    good = {"ADMIN_TOKEN": "a-good-token-0123"}
    assert parse_policy(BACKEND + "server: {admin_token_env: ADMIN_TOKEN}\n", "p.yaml", good)
