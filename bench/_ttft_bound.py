"""The lowest TTFT any router could give each request of a run: the floor under every strategy.

A request's first token needs, at least, the engine's request overhead, one step, and the
prefill of every prompt token the replica cannot have cached. The most a replica can have
cached is what the request shares, in whole blocks, with the previous request of its prefix
group (the conversation's previous turn with its reply, the tenant's previous question), all
of it held on the replica the request goes to. So the floor assumes, for every request at once:
an unbounded KV cache, a router that always picks the replica holding the group's context, and
no queueing and no other request in its steps. It ignores the wait for a running step to end
and the attention of later prefill chunks over earlier ones.
Each of those only lowers the figure, so no router on this pool and workload can reach a TTFT
percentile below the same percentile of these floors: a target below it is out of any
router's reach, whatever the strategy.
"""

from __future__ import annotations

from collections.abc import Iterable

from bench._routing_des import Job
from bench.sim.params import SimParams


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def ttft_floors(jobs: Iterable[Job], params: SimParams) -> dict[int, float]:
    """Seconds, keyed by ``id(job)``: each request's TTFT floor (module docstring)."""
    bs = params.block_size
    last: dict[str, Job] = {}
    floors: dict[int, float] = {}
    for job in sorted(jobs, key=lambda j: j.arrival):
        prev = last.get(job.group) if job.group else None
        cached = 0
        if prev is not None:
            shared = _common_prefix(prev.tokens + prev.output, job.tokens)
            # vLLM computes at least the prompt's last token, and caches whole blocks only
            cached = min(shared, len(job.tokens) - 1) // bs * bs
        computed = len(job.tokens) - cached
        step_ms = params.step_ms(
            prefill_tokens=computed,
            prefill_context_tokens=cached,
            decode_seqs=0,
            decode_context_tokens=0,
        )
        # a prompt longer than one step's token budget is prefilled in chunks, a step each
        chunks = -(-computed // params.max_num_batched_tokens)
        step_ms += (chunks - 1) * params.step_base_ms
        floors[id(job)] = (params.request_overhead_ms + step_ms) / 1000
        if job.group:
            last[job.group] = job
    return floors
