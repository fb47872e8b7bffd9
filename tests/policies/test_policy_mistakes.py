"""Policy files that slipped past the loader, or were reported badly: merge-key
bombs and overrides, secrets put where a variable's name belongs, plaintext keys through
``${...}``, numbers no timer can use, URLs serving refuses, misleading key paths, and line
breaks only YAML sees. Each is one clean ``file:line: key: message``, quickly."""

from __future__ import annotations

import time

import pytest

from policies.backends import VllmBackend
from policies.loader import MAX_ISSUES, PolicyError, parse_policy

BACKEND = 'backends:\n  up: {kind: vllm, replicas: ["http://127.0.0.1:9/v1"]}\n'
SECRET = "sk-live-0123456789abcdef"


def issues(text: str, env: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "p.yaml", env or {})
    return [str(i) for i in info.value.issues]


# --- merge keys (<<) --------------------------------------------------------------------------


def merge_bomb(levels: int) -> str:
    """Each anchor merges the previous one ten times: 10^levels entries once expanded."""
    text = "defs:\n  - &m0 {" + ", ".join(f"k{i}: {i}" for i in range(10)) + "}\n"
    for i in range(1, levels + 1):
        text += f"  - &m{i} {{<<: [" + ", ".join([f"*m{i - 1}"] * 10) + "]}\n"
    return text + f"<<: *m{levels}\n"


def test_a_merge_key_bomb_is_refused_at_once() -> None:
    bomb = merge_bomb(9)
    assert len(bomb) < 700
    started = time.perf_counter()
    found = issues(bomb)
    assert time.perf_counter() - started < 2
    assert found == [
        "p.yaml: the policy expands to more than 100000 values (keys, scalars and lists): "
        "YAML aliases or merge keys (<<) that repeat each other"
    ]


def test_a_key_written_next_to_a_merge_key_overrides_the_merged_one() -> None:
    text = (
        "backends:\n"
        "  up: &d\n"
        "    kind: vllm\n"
        '    replicas: ["http://127.0.0.1:9/v1"]\n'
        "    timeouts: {connect_s: 3}\n"
        "  other:\n"
        "    <<: *d\n"
        '    replicas: ["http://127.0.0.1:10/v1"]\n'
    )
    policy = parse_policy(text, "p.yaml", {})
    other = policy.backends["other"]
    assert isinstance(other, VllmBackend)
    assert other.replicas == ["http://127.0.0.1:10/v1"]
    assert other.timeouts.connect_s == 3
    # The first of several merged mappings wins; a key written twice is still a duplicate.
    text = "a: &a {x: 1}\nb: &b {x: 2, y: 2}\nc: {<<: [*a, *b], y: 3}\n"
    found = issues(BACKEND + text + "c2: {x: 1, x: 2}\n")
    assert "p.yaml:6: c2.x: duplicate key" in found


def test_many_duplicate_keys_are_listed_up_to_a_bound() -> None:
    text = BACKEND + "models:\n" + "".join("  m: {backend: up}\n" for _ in range(100))
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "p.yaml", {})
    assert len(info.value.issues) == 99  # every one counted (check's header says 99)
    shown = str(info.value).splitlines()
    assert len(shown) == MAX_ISSUES + 1
    assert shown[-1] == f"and {99 - MAX_ISSUES} more problem(s)"


# --- secrets ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "key"),
    [
        (
            "  oa: {kind: openai, base_url: 'https://api.x/v1', api_key_env: '${OPENAI_KEY}'}\n",
            "backends.oa.api_key_env",
        ),
        ("  cl: {kind: anthropic, api_key_env: '${OPENAI_KEY}'}\n", "backends.cl.api_key_env"),
        ("server: {admin_token_env: '${OPENAI_KEY}'}\n", "server.admin_token_env"),
        ("server: {metrics_token_env: '${OPENAI_KEY}'}\n", "server.metrics_token_env"),
    ],
)
def test_a_secret_where_a_variable_name_belongs_is_never_printed(text: str, key: str) -> None:
    found = issues(BACKEND + text, {"OPENAI_KEY": SECRET})
    assert any(key in i and "${...}" in i for i in found), found
    assert not any("0123456789abcdef" in i for i in found), found


def test_a_secret_that_looks_like_a_variable_name_is_not_printed_either() -> None:
    text = BACKEND + "  oa: {kind: openai, base_url: 'https://api.x/v1', api_key_env: '${K}'}\n"
    found = issues(text, {"K": "sk_live_0123456789abcdef"})
    assert found == [
        "p.yaml:3: backends.oa.api_key_env: "
        "the environment variable it names (through ${...}) is not set"
    ]


@pytest.mark.parametrize(
    "value",
    [
        "'${NOPE_UNSET:-sk-verysecretkey}'",  # a default is text in the file
        "'sk-verysecret${NOPE_UNSET:-}'",  # text around the reference
        "'sk-verysecretkey'",
    ],
)
def test_a_key_partly_written_in_the_file_is_plaintext(value: str) -> None:
    found = issues(BACKEND + f"tenants:\n  a: {{api_keys: [{value}]}}\n")
    assert any("tenants.a.api_keys[0]: plaintext API key" in i for i in found), found


def test_a_key_wholly_from_the_environment_is_accepted() -> None:
    env = {"KEY_A": "sk-key-a-0123456", "VLLM_KEY": "vllm-key-0123"}
    text = BACKEND + "tenants:\n  a: {api_keys: ['${KEY_A}']}\n"
    assert parse_policy(text, "p.yaml", env).tenants["a"].api_keys == ["sk-key-a-0123456"]
    text = 'backends:\n  up: {kind: vllm, replicas: ["http://h:1/v1"], api_key: "${VLLM_KEY:-}"}\n'
    assert parse_policy(text, "p.yaml", env)
    assert parse_policy(text, "p.yaml", {})  # unset, empty default: no key at all


def test_a_vllm_key_in_the_file_is_plaintext() -> None:
    text = 'backends:\n  up: {kind: vllm, replicas: ["http://h:1/v1"], api_key: sk-in-file}\n'
    assert issues(text) == [
        "p.yaml:2: backends.up.api_key: plaintext API key in the file: "
        "give it as ${ENV_VAR} alone (no default, no text around)"
    ]


@pytest.mark.parametrize("value", ["'${NOPE-x}'", '"${NOPE"', "'a${1X}'"])
def test_an_unsupported_variable_reference_is_an_error(value: str) -> None:
    found = issues(BACKEND + f"server: {{surface_header: {value}}}\n")
    assert any("server.surface_header: unsupported or unclosed ${...}" in i for i in found)


# --- numbers and URLs -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ("{actions: {hedge: {enabled: true, delay_ms: .nan}}}", "actions.hedge.delay_ms"),
        ("{actions: {hedge: {enabled: true, delay_ms: 1e300}}}", "actions.hedge.delay_ms"),
        ("{budget: {total_ms: .inf, itl_ms: 40}, actions: {cap_output: true}}", "budget.total_ms"),
        ("{budget: {ttft_ms: .nan}}", "budget.ttft_ms"),
        ("{budget: {percentile: .nan}}", "budget.percentile"),
    ],
)
def test_numbers_no_timer_can_use_are_refused(section: str, key: str) -> None:
    found = issues(BACKEND + f"surfaces:\n  s: {section}\n")
    assert len(found) == 1 and f"p.yaml:4: surfaces.s.{key}: " in found[0], found


def test_every_policy_float_is_finite() -> None:
    found = issues(BACKEND + "server: {header_timeout_s: .inf}\n")
    assert found == ["p.yaml:3: server.header_timeout_s: Input should be a finite number"]


def test_the_cache_stores_time_out_is_at_most_a_day() -> None:
    found = issues(BACKEND + "cache_store: {timeout_ms: 1e15}\n")
    assert found == [
        "p.yaml:3: cache_store.timeout_ms: Input should be less than or equal to 86400000"
    ], found


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://127.0.0.1:99999/v1", "Port out of range"),
        ("http://127.0.0.1:abc/v1", "port"),
        ("http://:8000/v1", "host"),
        ("http://[::1/v1", "IPv6"),
        ("http://127.0.0.1:0/v1", "1 to 65535"),
        ("http://h/v1?x=1", "no query"),
        ("http://h/v1#f", "no query"),
    ],
)
def test_replica_urls_serving_would_refuse_are_refused_at_their_key(url: str, why: str) -> None:
    text = f'backends:\n  up:\n    kind: vllm\n    replicas: ["{url}"]\n'
    found = issues(text)
    assert len(found) == 1 and found[0].startswith("p.yaml:4: backends.up.replicas[0]: "), found
    assert why in found[0]


# --- key paths and messages -------------------------------------------------------------------


@pytest.mark.parametrize(("name", "what"), [("yes", "a boolean"), ("123", "a number")])
def test_a_key_yaml_does_not_read_as_a_string_says_so(name: str, what: str) -> None:
    found = issues(BACKEND + f"tenants:\n  {name}: {{api_key_sha256: ['{'a' * 64}']}}\n")
    assert found == [f"p.yaml:4: tenants: YAML reads the key {name} as {what}: quote it ('{name}')"]


def test_messages_name_no_internal_class_and_no_union_tag() -> None:
    assert issues(BACKEND + "models:\n  m:\n") == [
        "p.yaml:4: models.m: is empty: give its settings (key: value)"
    ]
    text = (
        "backends:\n  up:\n    kind: vllm\n    replicas: ['http://h:1/v1']\n"
        "    routing: {chunk_chars: 64}\n"
    )
    assert issues(text) == ["p.yaml:5: backends.up.routing.chunk_chars: unknown key"]


def test_a_second_document_and_a_big_plain_list_say_what_is_wrong() -> None:
    found = issues(BACKEND + "---\n" + BACKEND)
    assert found == [
        "p.yaml:3: invalid YAML: one YAML document per file (a second one begins here)"
    ]
    big = BACKEND + "x: [" + "1," * 100_001 + "]\n"
    found = issues(big)
    assert found == [
        "p.yaml: the policy expands to more than 100000 values (keys, scalars and lists)"
    ]


@pytest.mark.parametrize(
    ("char", "name"),
    [("\u2028", "line separator"), ("\x85", "next line, NEL"), ("\r", "carriage return")],
)
def test_a_line_break_only_yaml_sees_is_named_on_the_editors_line(char: str, name: str) -> None:
    text = BACKEND + f"# a comment{char} pasted: [\nmodels: {{m: {{backend: up}}}}\n"
    found = issues(text)
    assert len(found) == 1
    assert found[0].startswith(f"p.yaml:3: the character U+{ord(char):04X} ({name})"), found


def test_line_ends_editors_agree_on_still_load() -> None:
    text = BACKEND + "models: {m: {backend: up}}\n"
    for ending in ("\r\n", "\r"):
        assert parse_policy(text.replace("\n", ending), "p.yaml", {}).models
