"""Commands of the tier router: ``train-router``, ``calibrate``, ``router-eval``.

Heavy imports (the embedding model) happen inside the commands, never at import time.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, cast

from routing.difficulty import DEFAULT_ARTIFACT, read_artifact
from routing.training.curves import parse_target

if TYPE_CHECKING:
    from routing.training.router_eval import ScoredRows


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "train-router",
        help="train the difficulty estimator and cascade verifier on labelled JSONL files",
    )
    p.add_argument(
        "--data", nargs="+", required=True, type=Path, help="JSONL files, one domain each"
    )
    p.add_argument("--out", required=True, type=Path, help="artifact to write (JSON)")
    p.add_argument("--folds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2, help="repeats of k-fold model selection")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--description", default="", help="where the data comes from (recorded)")
    _embedding_options(p)
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("calibrate", help="turn a routing target into a threshold on labelled data")
    p.add_argument(
        "--target", required=True, help="max_large_fraction=F or min_quality_recovered=P"
    )
    p.add_argument("--data", required=True, type=Path, help="labelled JSONL file")
    p.add_argument("--mode", choices=("route", "cascade"), default="route")
    _common_options(p)
    p.set_defaults(func=_cmd_calibrate)

    p = sub.add_parser("router-eval", help="APGR/CPT of the tier router against a random one")
    p.add_argument("--data", required=True, type=Path, help="labelled JSONL file")
    p.add_argument("--mode", choices=("route", "cascade"), default="route")
    p.add_argument(
        "--threshold", type=float, default=None, help="decision threshold (default: the artifact's)"
    )
    _common_options(p)
    p.set_defaults(func=_cmd_eval)


def _embedding_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--embedding-cache",
        type=Path,
        default=None,
        help="directory for cached prompt embeddings "
        "(default: $LLM_GATEWAY_EMBEDDING_CACHE or <tmp>/llm-gateway-emb)",
    )
    p.add_argument("--threads", type=int, default=1, help="embedding threads")


def _common_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--artifact", type=Path, default=DEFAULT_ARTIFACT)
    p.add_argument(
        "--no-cv", action="store_true", help="score training files in-sample (default: out-of-fold)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _embedding_options(p)


def _cmd_train(args: argparse.Namespace) -> int:
    from routing.training.router_data import cached_embedder, load_data
    from routing.training.train_router import train, write_artifact

    files = [load_data(path) for path in args.data]
    command = "llm-gateway train-router " + shlex.join(
        [
            "--data",
            *map(str, args.data),
            "--out",
            str(args.out),
            "--folds",
            str(args.folds),
            "--repeats",
            str(args.repeats),
            "--seed",
            str(args.seed),
        ]
        + (["--description", args.description] if args.description else [])
    )
    artifact = train(
        files,
        cached_embedder(args.embedding_cache, args.threads),
        folds=args.folds,
        repeats=args.repeats,
        seed=args.seed,
        command=command,
        description=args.description,
        log=lambda line: print(line, file=sys.stderr),
    )
    write_artifact(artifact, args.out)
    size = args.out.stat().st_size
    print(f"wrote {args.out} ({size / 1024:.1f} KiB)")
    for domain in artifact["route"]["domains"]:
        print(f"  route {domain['name']}: out-of-fold {domain['info']['cv']['out_of_fold']}")
    if artifact["cascade"]:
        print(f"  cascade: out-of-fold {artifact['cascade']['info']['cv']['out_of_fold']}")
    return 0


def _scored(args: argparse.Namespace, threshold: float | None = None) -> ScoredRows:
    from routing.training.router_data import cached_embedder, load_data
    from routing.training.router_eval import Mode, score_rows

    artifact = read_artifact(args.artifact)
    data = load_data(args.data)
    return score_rows(
        artifact,
        data,
        cached_embedder(args.embedding_cache, args.threads),
        mode=cast(Mode, args.mode),
        threshold=threshold,
        cross_validate=not args.no_cv,
    )


def _cmd_eval(args: argparse.Namespace) -> int:
    from routing.training.router_eval import dumps, evaluation, render

    try:
        result = evaluation(_scored(args, args.threshold), args.mode, str(args.data))
    except ValueError as exc:
        print(f"router-eval: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(dumps(result))
    else:
        print(render(result))
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from routing.training.router_eval import calibration_result, dumps

    try:
        target = parse_target(args.target)
        result = calibration_result(_scored(args), target, str(args.data))
    except ValueError as exc:
        print(f"calibrate: {exc}", file=sys.stderr)
        return 2
    result["mode"] = args.mode
    if args.json:
        print(dumps(result))
        return 0
    how = "out-of-fold scores" if result["cross_validated"] else "the artifact's scores"
    print(f"{result['target']} on {args.data} ({result['rows']} rows, {args.mode} mode, {how}):")
    print(f"  threshold: {result['threshold']!r}")
    print(
        f"  large-tier fraction {result['large_fraction']:.3f}, quality {result['quality']:.3f}, "
        f"PGR {result['pgr']}"
    )
    print(f"  policy: mode: {args.mode}, threshold: {result['threshold']!r}")
    return 0
