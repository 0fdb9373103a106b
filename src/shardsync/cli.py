"""Command line: ``shardsync demo | verify | bench``.

    shardsync demo                       # in-process sync of a tiny Qwen3-MoE into TP2 zoo consumers
    shardsync verify MODEL_DIR --tp 2    # will my model work? real vLLM, bit-exact check
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="shardsync", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="producers sync a tiny Qwen3-MoE into real vLLM replicas; every byte checked")
    d.add_argument("--consumers", choices=["vllm", "zoo"], default="vllm",
                   help="vllm: real vLLM replicas through the transfer engine; zoo: in-process loopback")
    d.add_argument("--tp", type=int, default=2)
    d.add_argument("--replicas", type=int, default=2)
    d.add_argument("--producers", type=int, default=2)
    d.add_argument("--transport", default="tcp")
    d.add_argument("--syncs", type=int, default=3)
    d.add_argument("--json", action="store_true")
    v = sub.add_parser("verify", help="start real vLLM on MODEL_DIR, sync perturbed weights, compare bytes")
    v.add_argument("model_dir")
    v.add_argument("--tp", type=int, default=1)
    v.add_argument("--expert-parallel", action="store_true")
    v.add_argument("--json", action="store_true")
    v.add_argument("--no-validate", action="store_true", help="skip the init-time check against real loaders")
    v.add_argument("--self-test-corrupt", action="store_true", help=argparse.SUPPRESS)
    b = sub.add_parser("bench", help="shardsync vs broadcast baseline (and link SoL), side by side, on this machine")
    b.add_argument("--model", default="qwen3-moe-bench")
    b.add_argument("--consumers", choices=["zoo"], default="zoo",
                   help="zoo: loader-zoo consumer processes (vLLM loader semantics)")
    b.add_argument("--producers", type=int, default=2)
    b.add_argument("--replicas", type=int, default=2)
    b.add_argument("--tp", type=int, default=2)
    b.add_argument("--transport", default="tcp", choices=["tcp", "nixl"])
    b.add_argument("--syncs", type=int, default=3)
    b.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.cmd == "demo":
        if args.consumers == "zoo":
            from .demo import run_zoo_demo

            return 0 if run_zoo_demo(tp=args.tp, syncs=args.syncs, as_json=args.json) else 1
        from .integrations.vllm.demo import run_vllm_demo

        return 0 if run_vllm_demo(producers=args.producers, replicas=args.replicas, tp=args.tp, syncs=args.syncs,
                                  transport=args.transport, as_json=args.json) else 1
    if args.cmd == "bench":
        from .bench import run_bench

        r = run_bench(model=args.model, producers=args.producers, replicas=args.replicas, tp=args.tp,
                      transport=args.transport, syncs=args.syncs, as_json=args.json)
        return 0 if r["exact"] else 1
    if args.cmd == "verify":
        from .integrations.vllm.verify import run_verify

        return run_verify(args.model_dir, tp=args.tp, expert_parallel=args.expert_parallel, as_json=args.json,
                          validate=not args.no_validate, corrupt=args.self_test_corrupt)
    return 2


if __name__ == "__main__":
    sys.exit(main())
