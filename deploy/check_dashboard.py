"""Check the Grafana dashboard against the series the gateway really exports.

Starts the gateway in this process in front of the deterministic fake upstream (loopback,
ephemeral ports), sends a few plain and streamed requests (one on a budgeted surface; from a
tenant with limits and a budget, so refusals, a budget alert, a downgrade, a provider's 429 and
its usage and cost are counted), scrapes its ``/metrics`` and checks every PromQL expression
of the dashboard:

* every ``llm_gateway_*`` name must be exported (a histogram's ``_bucket``/``_sum``/``_count``
  and a counter's ``_total`` count; families without samples yet count by their ``# TYPE``);
* labels in selectors, ``by (...)`` and legends must exist on the series (checked where the
  series has samples in this run);
* ``vllm:*`` names are checked against the fake upstream's ``/metrics`` and against each
  ``--vllm-metrics URL`` given (a real vLLM replica); names that no source shows are listed as
  unchecked, or as errors when a real replica was given;
* with ``--prometheus URL``, every expression is also evaluated by that Prometheus (template
  variables replaced by ``.*``) and must parse.

    python deploy/check_dashboard.py [--dashboard PATH] [--vllm-metrics URL] [--prometheus URL]

Exit status 0 when the dashboard is consistent, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import re
import sys
import tempfile
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DASHBOARD = REPO / "deploy/grafana/dashboards/llm-gateway.json"

_NAME = re.compile(r"(?<![\w:])(llm_gateway_[A-Za-z0-9_]+|vllm:[A-Za-z0-9_:]+)")
_SELECTOR = re.compile(r"(?<![\w:])(llm_gateway_[A-Za-z0-9_]+|vllm:[A-Za-z0-9_:]+)\{([^}]*)\}")
_MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
_BY = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
_LEGEND = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
_LABELS_ADDED_BY_PROMETHEUS = {"instance", "job"}
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(where, expr, legendFormat) for every panel target and templating query."""
    out: list[tuple[str, str, str]] = []

    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for p in items:
            yield p
            yield from panels(p.get("panels", []))

    for panel in panels(dashboard.get("panels", [])):
        for target in panel.get("targets", []):
            expr = target.get("expr")
            if expr:
                where = f"panel {panel.get('title')!r} {target.get('refId', '')}"
                out.append((where, expr, target.get("legendFormat", "")))
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var.get("query")
            text = query.get("query", "") if isinstance(query, dict) else str(query or "")
            out.append((f"variable {var.get('name')!r}", text, ""))
    return out


def exposed(text: str) -> dict[str, set[str] | None]:
    """Series name -> label names seen on its samples (None: declared, no sample yet)."""
    series: dict[str, set[str] | None] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            names = [name + s for s in _HISTOGRAM_SUFFIXES] if kind == "histogram" else [name]
            for n in names:
                series.setdefault(n, None)
        elif line and not line.startswith("#"):
            match = re.match(r"([A-Za-z_:][A-Za-z0-9_:]*)(\{([^}]*)\})?", line)
            if match is None:
                continue
            labels = set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=\"", match.group(3) or ""))
            known = series.get(match.group(1))
            series[match.group(1)] = labels | (known or set())
    return series


async def scrape_gateway() -> tuple[str, str]:
    """Run gateway + fake upstream on loopback, send traffic, return both /metrics texts."""
    sys.path.insert(0, str(REPO))
    import aiohttp
    from aiohttp import web

    from bench.fake_upstream import FakeSettings, FakeUpstream, site_port, start_fake
    from gateway.app import create_app
    from gateway.keys import LIVE
    from policies.loader import load_policy

    fake = FakeUpstream(settings=FakeSettings(chunks=6, chunk_interval_ms=2.0), record=False)
    fake_runner, fake_url = await start_fake(fake)
    key = "sk-dashboard-check"
    digest = hashlib.sha256(key.encode()).hexdigest()
    policy_text = f"""
version: 1
backends:
  local:
    kind: vllm
    replicas: ["{fake_url}"]
    discover_models: true
    health: {{interval_s: 0.5}}
models:
  default: {{backend: local, price: {{input_per_mtok: 1000, output_per_mtok: 2000}}}}
  lite: {{backend: local, price: {{input_per_mtok: 1, output_per_mtok: 2}}}}
tenants:
  team-a:
    api_key_sha256: [{digest}]
    limits: {{requests_per_minute: 1000}}
    budget: {{usd: 0.05, window: day, alert_at: [0.5], on_exhausted: downgrade,
              downgrade_to: lite}}
surfaces:
  chat:
    match: {{header: chat}}
    priority: interactive
    budget: {{ttft_ms: 500, itl_ms: 50, total_ms: 30000, percentile: p95}}
    actions: {{deadline: true, hedge: {{enabled: true}}}}
    limits: {{requests_per_minute: 3}}
"""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "policy.yaml"
        path.write_text(policy_text, encoding="utf-8")
        app = create_app(load_policy(path), str(path), path)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        base = f"http://127.0.0.1:{site_port(site)}"
        try:
            async with aiohttp.ClientSession() as http:
                for _ in range(100):
                    async with http.get(f"{base}/readyz") as r:
                        if r.status == 200:
                            break
                    await asyncio.sleep(0.1)
                fake.queue("ratelimit:0.01")  # a provider's 429 (relayed: no fallback)
                plan = [(False, None), (True, None), (True, "chat"), (False, "chat")]
                plan += [(False, "chat")] * 2  # past the surface's 3 a minute: refused
                plan += [(False, None)] * 4  # 0.017 USD each: the alert, then downgrades
                for i, (stream, surface) in enumerate(plan):
                    body = {
                        "model": "default",
                        "max_tokens": 8,
                        "stream": stream,
                        "messages": [{"role": "user", "content": f"hello {i}"}],
                    }
                    headers = {"Authorization": f"Bearer {key}"}
                    if surface:
                        headers["X-Surface"] = surface
                    url = f"{base}/v1/chat/completions"
                    async with http.post(url, json=body, headers=headers) as r:
                        await r.read()
                    await app[LIVE].current.limiter.drain()  # settled before the next one
                async with http.get(f"{base}/metrics") as r:
                    gateway_text = await r.text()
                async with http.get(fake_url.removesuffix("/v1") + "/metrics") as r:
                    fake_text = await r.text()
        finally:
            await runner.cleanup()
            await fake_runner.cleanup()
    return gateway_text, fake_text


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        text: str = r.read().decode()
        return text


def _instantiate(expr: str) -> str:
    expr = expr.replace("$__rate_interval", "1m").replace("$__interval", "1m")
    return re.sub(r"\$\{?[A-Za-z_]+\}?", ".*", expr)


def _prometheus_errors(base: str, expr: str) -> str | None:
    if expr.startswith("label_values("):
        return None  # a Grafana function, not PromQL
    query = urllib.parse.urlencode({"query": _instantiate(expr)})
    try:
        body = json.loads(_fetch(f"{base.rstrip('/')}/api/v1/query?{query}"))
    except Exception as exc:
        return f"query failed: {exc}"
    if body.get("status") != "success":
        return str(body.get("error"))
    return None


def check(
    dashboard_path: Path,
    gateway_text: str,
    upstream_texts: list[str],
    *,
    real_vllm: bool = False,
    prometheus: str | None = None,
) -> tuple[list[str], list[str]]:
    """(errors, notes) for the dashboard against the scraped texts."""
    dashboard = json.loads(dashboard_path.read_text(encoding="utf-8"))
    gateway = exposed(gateway_text)
    upstream: dict[str, set[str] | None] = {}
    for text in upstream_texts:
        for name, labels in exposed(text).items():
            upstream[name] = (upstream.get(name) or set()) | (labels or set()) or None
    known = {**upstream, **gateway}
    errors: list[str] = []
    notes: list[str] = []
    unchecked: set[str] = set()
    no_samples: set[str] = set()
    used: set[str] = set()
    for where, expr, legend in dashboard_queries(dashboard):
        names = set(_NAME.findall(expr))
        used |= names
        for name in sorted(names):
            if name in known:
                continue
            if name.startswith("vllm:") and not real_vllm:
                unchecked.add(name)
            else:
                errors.append(f"{where}: {name} is not exported")
        for name, matchers in _SELECTOR.findall(expr):
            labels = known.get(name)
            if labels is None:
                continue
            for label in _MATCHER.findall(matchers):
                if label not in labels | _LABELS_ADDED_BY_PROMETHEUS:
                    errors.append(f"{where}: {name} has no label {label!r}")
        grouped = {x.strip() for group in _BY.findall(expr) for x in group.split(",") if x.strip()}
        grouped |= set(_LEGEND.findall(legend))
        label_sets = [known.get(n) for n in names if n in known]
        if not label_sets or any(s is None for s in label_sets):
            no_samples |= {n for n in names if n in known and known[n] is None}
        else:
            union = set().union(*(s for s in label_sets if s is not None))
            for label in sorted(grouped - union - _LABELS_ADDED_BY_PROMETHEUS - {"le"}):
                errors.append(f"{where}: no series in the expression has label {label!r}")
        if prometheus is not None:
            problem = _prometheus_errors(prometheus, expr)
            if problem is not None:
                errors.append(f"{where}: Prometheus rejected the query: {problem}")
    ours = sorted(n for n in used if n.startswith("llm_gateway_"))
    notes.append(f"{len(ours)} llm_gateway_* series used, all checked against /metrics")
    if no_samples:
        notes.append(
            "labels not checked (no samples in this run): " + ", ".join(sorted(no_samples))
        )
    if unchecked:
        notes.append(
            "vLLM series not checked (pass --vllm-metrics URL of a replica): "
            + ", ".join(sorted(unchecked))
        )
    unused = sorted(
        n
        for n in gateway
        if n.startswith("llm_gateway_")
        and not n.endswith(("_created", "_sum", "_count"))
        and n not in used
        and n.removesuffix("_bucket") + "_bucket" not in used
    )
    if unused:
        notes.append("exported but not on the dashboard: " + ", ".join(unused))
    return errors, notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--dashboard", type=Path, default=DEFAULT_DASHBOARD)
    parser.add_argument(
        "--vllm-metrics", action="append", default=[], help="a vLLM replica's /metrics URL"
    )
    parser.add_argument("--prometheus", help="a Prometheus base URL to evaluate the queries")
    args = parser.parse_args(argv)
    gateway_text, fake_text = asyncio.run(scrape_gateway())
    upstream = [fake_text, *(_fetch(url) for url in args.vllm_metrics)]
    errors, notes = check(
        args.dashboard,
        gateway_text,
        upstream,
        real_vllm=bool(args.vllm_metrics),
        prometheus=args.prometheus,
    )
    for note in notes:
        print(f"note: {note}")
    for error in errors:
        print(f"ERROR: {error}")
    print(f"{args.dashboard}: {'OK' if not errors else f'{len(errors)} problem(s)'}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
