"""Command line: ``shardsync demo | verify | bench | simulate``.

    shardsync demo --kill-engine-at 8    # GRPO on an FSDP2 policy, synced into 2 real vLLM engines every step
    shardsync verify MODEL_DIR --tp 2    # will my model work? synced engine vs a fresh engine, bytes compared
    shardsync bench                      # shardsync vs broadcast baseline vs link SoL, this machine
    shardsync bench --mode all           # Megatron trainer export v1..v4 (gather everywhere .. PP-parallel)
    shardsync bench --delta --json       # an RL-rate trainer into vLLM: delta vs dense sync, bytes and seconds
    shardsync simulate --preset kimi-k2-48n   # cluster-scale SoL and predicted sync time
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from .verify.output import json_mode

    args = _parser().parse_args(argv)
    if getattr(args, "json", False):  # stdout carries only the JSON: vLLM's logs (engines, workers) go to stderr
        import os

        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if args.cmd == "verify":  # its human summary goes to stderr itself; its JSON line to stdout
        from .verify.program import run_verify

        return run_verify(args.model_dir, tp=args.tp, expert_parallel=args.expert_parallel, as_json=args.json,
                          validate=not args.no_validate, corrupt=args.self_test_corrupt, reference=args.reference,
                          quantization=args.quantization, direct=not args.no_direct)
    with json_mode(getattr(args, "json", False)):
        return _run(args)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="shardsync", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="an RL loop: an FSDP2 policy trained by GRPO, synced into real vLLM engines every step")
    d.add_argument("--steps", type=int, default=20)
    d.add_argument("--prompts", type=int, default=8, help="prompts per step")
    d.add_argument("--samples", type=int, default=8, help="sampled answers per prompt (the GRPO group)")
    d.add_argument("--replicas", type=int, default=2, help="vLLM engines (TP1 each)")
    d.add_argument("--lr", type=float, default=1e-2)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--kill-engine-at", type=int, default=None, metavar="STEP",
                   help="kill one engine after that step's rollouts; it is restarted and rejoins at the next sync")
    d.add_argument("--ray", action="store_true", help="trainer ranks and engines as Ray actors (local Ray instance)")
    d.add_argument("--delta", action="store_true",
                   help="delta sync: only the changed words cross the wire (bytes read per engine are reported)")
    d.add_argument("--out", default="shardsync-demo", help="where report.json and demo.png go")
    d.add_argument("--sync-only", action="store_true",
                   help="the earlier demo: producers sync perturbed checkpoints into vLLM replicas (no training)")
    d.add_argument("--consumers", choices=["vllm", "zoo"], default="vllm",
                   help="--sync-only: vllm: real vLLM replicas through the transfer engine; zoo: in-process loopback")
    d.add_argument("--tp", type=int, default=2, help="--sync-only: TP of each replica")
    d.add_argument("--producers", type=int, default=2, help="--sync-only")
    d.add_argument("--transport", default="tcp", help="--sync-only")
    d.add_argument("--syncs", type=int, default=3, help="--sync-only")
    d.add_argument("--json", action="store_true")
    v = sub.add_parser("verify", help="start real vLLM on MODEL_DIR, sync perturbed weights, compare bytes")
    v.add_argument("model_dir")
    v.add_argument("--tp", type=int, default=1)
    v.add_argument("--expert-parallel", action="store_true")
    v.add_argument("--json", action="store_true")
    v.add_argument("--reference", choices=["fresh", "none"], default="fresh",
                   help="fresh: compare with a second engine started on the new weights (default); none: sync only")
    v.add_argument("--no-validate", action="store_true", help="skip the init-time checks (loaders, processing)")
    v.add_argument("--no-direct", action="store_true",
                   help="every module on the general path (layerwise buffers + first-load processing), none written "
                        "straight into its live tensors")
    v.add_argument("--quantization", default=None, help="vLLM's online quantisation of both engines (e.g. fp8)")
    v.add_argument("--self-test-corrupt", action="store_true", help=argparse.SUPPRESS)
    b = sub.add_parser("bench", help="shardsync vs broadcast baseline (and link SoL), side by side, on this machine")
    b.add_argument("--model", default="qwen3-moe-bench")
    b.add_argument("--consumers", choices=["zoo", "vllm"], default="zoo",
                   help="zoo: loader-zoo consumer processes (vLLM loader semantics); vllm: real vLLM replicas "
                        "(tiny checkpoint) against full tensors through update_weights")
    b.add_argument("--producers", type=int, default=2)
    b.add_argument("--paths", choices=["both", "direct", "general"], default="both",
                   help="--consumers vllm: both (even replicas write directly where the init check allows, odd ones "
                        "take the general path, timed in the same rounds), direct or general")
    b.add_argument("--replicas", type=int, default=None, help="default 2 (--delta: 1)")
    b.add_argument("--tp", type=int, default=None, help="default 2 (--delta: 1)")
    b.add_argument("--transport", default="tcp", choices=["tcp", "nixl"])
    b.add_argument("--syncs", type=int, default=3)
    b.add_argument("--mode", choices=["v1", "v2", "v3", "v4", "all"], default=None,
                   help="the trainer-side export step by step on a Megatron TP2·PP2·EP2 trainer -> TP2 replica: "
                        "v1 gather everything everywhere, v2 PP/EP-local gathers, v3 + pipelined, v4 + PP stages "
                        "in parallel (absent: shardsync vs baseline)")
    b.add_argument("--ray", action="store_true",
                   help="trainer and engines as Ray actors on a local Ray instance, per transport: tcp, nixl and "
                        "Ray Direct Transport (rdt) side by side")
    b.add_argument("--delta", action="store_true",
                   help="the reference RL-rate trainer (fp32 master, AdamW, bf16 served) into real vLLM engines: "
                        "delta sync against dense sync, every sync checked against a fresh load")
    b.add_argument("--params", type=float, default=None, help="--delta: policy size (e.g. 300e6; default tiny)")
    b.add_argument("--lr", type=float, default=1e-6, help="--delta: the trainer's learning rate")
    b.add_argument("--json", action="store_true")
    c = sub.add_parser("chaos", help="random real faults (kill -9, SIGSTOP, producer death, forged plans, bad frames) "
                                     "while syncs go on; every sync checked byte for byte")
    c.add_argument("--kills", type=int, default=20, help="number of faults (one before each sync)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--lease", type=float, default=2.0, help="lease seconds (the detection bound)")
    c.add_argument("--kinds", default="", help="comma-separated fault kinds (default: all)")
    c.add_argument("--vllm", action="store_true",
                   help="the configuration with real vLLM engines (each killed as a whole process group)")
    c.add_argument("--json", action="store_true")
    sm = sub.add_parser("simulate", help="the real planner/router at cluster scale on meta tensors: SoL and predicted time")
    sm.add_argument("--preset", choices=["kimi-k2-48n", "qwen3-235b-4n"])
    sm.add_argument("--config", help="HF config.json of the model")
    sm.add_argument("--trainer", help="trainer layout, e.g. tp8,pp8,ep32,etp1")
    sm.add_argument("--inference", help="inference layout, e.g. tp32,ep32 (or dp16,ep16)")
    sm.add_argument("--replicas", type=int, default=None)
    sm.add_argument("--trainer-nodes", type=int, default=None)
    sm.add_argument("--gpus-per-node", type=int, default=8)
    sm.add_argument("--nic-gbps", type=float, default=400, help="NIC per GPU, Gbit/s")
    sm.add_argument("--nvlink-gbps", type=float, default=450, help="NVLink per GPU per direction, GB/s")
    sm.add_argument("--record", choices=["full", "template"], default="full",
                    help="full: record every consumer's plan; template: record distinct plan shapes once")
    sm.add_argument("--colocate", action="store_true", help="consumers on the trainer nodes")
    sm.add_argument("--changed-fraction", metavar="F[,F...]", default=None,
                    help="delta sync: predict bytes and time at these changed fractions (0.01 or 1%%; '' for none; "
                         "kimi-k2-48n defaults to 1%%,2%%,5%%)")
    sm.add_argument("--encode-gbps", type=float, default=500.0, help="delta encode rate, GB/s of dense chunk bytes")
    sm.add_argument("--decode-gbps", type=float, default=2000.0, help="delta decode rate, GB/s of dense chunk bytes")
    sm.add_argument("--json", action="store_true")
    return ap


def _run(args: argparse.Namespace) -> int:
    import importlib.util

    if importlib.util.find_spec("shardsync.programs") is None:  # an installed wheel: the product and verify only
        print(f"shardsync {args.cmd} runs from a source checkout (git clone ...; make demo): the wheel holds the "
              "library and `shardsync verify`", file=sys.stderr)
        return 2
    if args.cmd == "demo":
        from .programs.demo import run

        return run(args)
    if args.cmd == "bench":
        from .programs.bench import run

        return run(args)
    if args.cmd == "chaos":
        from .programs.chaos import run

        return run(args)
    if args.cmd == "simulate":
        from .programs.simulate import run

        return run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
