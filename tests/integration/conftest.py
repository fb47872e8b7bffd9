"""Real services for integration tests: a pool of real vLLM replicas on CPU.

The pool is started once per session (about a minute on two shared cores) and torn down at the
end; tests that use it are marked `vllm`. A missing vLLM environment fails the run with the way
to create it: skipping would let CI pass without ever talking to vLLM.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from deploy.local.localpool import LocalPoolError, LocalVllmPool

VLLM_POOL_SIZE = 2

_pool_report = pytest.StashKey[str]()


@pytest.fixture(scope="session")
def vllm_pool(pytestconfig: pytest.Config) -> Iterator[LocalVllmPool]:
    # KV events on: the precise router subscribes to them; the other tests ignore them.
    pool = LocalVllmPool(VLLM_POOL_SIZE, kv_events=True)
    try:
        pool.start()
    except LocalPoolError as exc:
        pytest.fail(f"cannot start the local vLLM pool: {exc}", pytrace=False)
    memory_gib = [round(b / 2**30, 2) for b in pool.memory_bytes()]
    pytestconfig.stash[_pool_report] = (
        f"vLLM pool: {pool.count} replicas healthy in {pool.startup_seconds:.1f} s, "
        f"memory (PSS, GiB) {memory_gib}, logs in {pool.log_dir}"
    )
    try:
        yield pool
    finally:
        pool.stop()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    report = terminalreporter.config.stash.get(_pool_report, None)
    if report is not None:
        terminalreporter.write_line(report)
