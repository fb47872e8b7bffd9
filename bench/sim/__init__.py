"""A vLLM-faithful simulator of many replicas for routing studies (see docs/simulator.md)."""

from bench.sim.cluster import ReplicaInfo, SimCluster
from bench.sim.engine import ReplicaEngine, RequestOutput, RequestRejected, StepResult
from bench.sim.hashing import block_hash_chain, prefix_block_hashes
from bench.sim.metrics import ReplicaCounters
from bench.sim.params import SimParams, list_profiles, load_profile
from bench.sim.replica import SimReplica
from bench.sim.server import create_replica_app
from bench.sim.tokenizer import render_chat, tokenize, tokenize_chat

__all__ = [
    "ReplicaCounters",
    "ReplicaEngine",
    "ReplicaInfo",
    "RequestOutput",
    "RequestRejected",
    "SimCluster",
    "SimParams",
    "SimReplica",
    "StepResult",
    "block_hash_chain",
    "create_replica_app",
    "list_profiles",
    "load_profile",
    "prefix_block_hashes",
    "render_chat",
    "tokenize",
    "tokenize_chat",
]
