"""The running policy: one ``Runtime`` reference, and the reload that swaps it.

A reload reads and validates the whole file and builds the new runtime (``build_runtime``:
files loaded, new pools and resources started) before anything is swapped; any problem raises
``PolicyError`` and the running runtime stays, untouched. A worker of a group never reads the
file: its reload applies the text its supervisor read and accepted (``gateway.group_policy``),
so every worker of the group runs the same policy whatever happens to the file meanwhile. After the swap, what the old runtime
held and the new one does not is closed in the background (pools once their answers in
flight have ended). Requests keep the runtime they started with.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from gateway.build import Clock, build_failure, build_runtime, refuse_unshared_limits, retire
from gateway.group_policy import GroupPolicy
from gateway.observability.slo import SloTracker
from gateway.observability.tracing import Telemetry
from gateway.runtime import Runtime
from policies.loader import PolicyError, PolicySource, parse_policy_source, read_policy
from policies.schema import Policy
from policies.surfaces import Budget

log = logging.getLogger("llm_gateway")


def budgets(policy: Policy) -> dict[str, Budget]:
    return {name: surface.budget for name, surface in policy.surfaces.items()}


class LivePolicy:
    def __init__(
        self,
        runtime: Runtime,
        path: Path | None,
        slo: SloTracker,
        telemetry: Telemetry | None = None,
        clock: Clock | None = None,
        on_reload: Callable[[Policy], None] | None = None,
        workers: int = 1,
        group: tuple[Path, GroupPolicy] | None = None,
    ) -> None:
        self.current = runtime
        self._workers = workers  # of this process's group: a reload obeys the group's rules
        self._clock = clock  # a caller's (tests): limits read it instead of the store's clock
        self._on_reload = on_reload  # what lives outside the runtime follows the new policy
        self.path = path  # None: nothing to reload from (a policy built in memory)
        self.slo = slo
        self._telemetry = telemetry  # a caller's (tests): kept across reloads
        self._lock = asyncio.Lock()
        self._retiring: dict[asyncio.Task[None], Runtime] = {}
        self.reloads = 0  # finished, accepted or rejected (a worker group waits on it)
        self.rejected = 0
        # A worker's: its group's run directory, where the supervisor's record lies, and the
        # record at the fork (the generation this worker starts on).
        self._group_dir: Path | None = group[0] if group else None
        started = group[1] if group else GroupPolicy()
        self._generation = started.generation
        # The last reload's, None if it was accepted. A worker forked after its group rejected a
        # reload starts with the supervisor's rejection: it runs the accepted policy, as its
        # siblings do, and the group's ``/admin/workers`` and ``llm_gateway_policy_reload_failing``
        # must say so (its counters start at zero: the worker it replaced counted that reload,
        # and the group keeps a replaced worker's counts).
        rejection = started.rejection()
        self.reload_error: str | None = None if rejection is None else str(rejection)

    async def reload(self) -> Runtime:
        """Load the policy file again (a worker: its group's policy); raises ``PolicyError`` and
        keeps the running one if bad."""
        if self.path is None:
            raise PolicyError([])
        async with self._lock:
            try:
                if self._group_dir is None:
                    runtime = await self._reload(self.path)
                else:
                    runtime = await self._apply_group_policy(self._group_dir, self.path)
            except PolicyError as exc:
                self.reload_error = str(exc)
                self.rejected += 1
                raise
            except Exception as exc:  # never a 500 or a lost task: a rejection that says why
                error = build_failure(PolicySource(str(self.path)), exc)
                self.reload_error = str(error)
                self.rejected += 1
                raise error from exc
            finally:
                self.reloads += 1
            self.reload_error = None
            return runtime

    def reload_counts(self) -> tuple[int, int, bool]:
        """For the metrics: reloads accepted, rejected, and whether the last was rejected."""
        return self.reloads - self.rejected, self.rejected, self.reload_error is not None

    async def _reload(self, path: Path) -> Runtime:
        policy, source = await asyncio.to_thread(read_policy, path)
        refuse_unshared_limits(policy, source, self._workers)
        return await self._swap(policy, source)

    async def _apply_group_policy(self, run_dir: Path, path: Path) -> Runtime:
        """The text the supervisor accepted, built only if this worker does not run it yet;
        then the supervisor's rejection of the last reload, if it rejected it."""
        record = await asyncio.to_thread(GroupPolicy.read, run_dir)
        if record.text is not None and record.generation != self._generation:
            policy, source = await asyncio.to_thread(parse_policy_source, record.text, str(path))
            await self._swap(policy, source)
            self._generation = record.generation
        rejection = record.rejection()
        if rejection is not None:
            raise rejection
        return self.current

    async def _swap(self, policy: Policy, source: PolicySource) -> Runtime:
        old = self.current
        new = await build_runtime(policy, source, old, telemetry=self._telemetry, clock=self._clock)
        self.current = new
        self.slo.configure(budgets(policy))
        if self._on_reload is not None:
            self._on_reload(policy)
        task = asyncio.create_task(retire(old, new, drain=True), name="retire-runtime")
        self._retiring[task] = old
        task.add_done_callback(lambda t: self._retiring.pop(t, None))
        log.info("policy reloaded from %s", source.file)
        return new

    async def close(self) -> None:
        """Close everything at once: retirements still draining stop waiting."""
        pending = dict(self._retiring)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for old in pending.values():
            await retire(old, self.current, drain=False)
        await retire(self.current, None, drain=False)
