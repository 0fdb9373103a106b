"""Delta codec speed (``shardsync.delta.codec``): encode and decode GB/s of dense chunk bytes at 0.1 / 1 / 5 % of
the 16-bit words changed, beside a plain copy of the same bytes on the same device. CUDA when available, else CPU.

    python benchmarks/delta_codec.py --json                      # CPU: 4 chunks of 64 MiB
    python benchmarks/delta_codec.py --chunks 16 --json          # on the GPU machine: 1 GiB in 64 MiB chunks

A codec micro-benchmark (no engine, no transport), two ways per fraction, every result checked byte for byte:

- ``encode_gbps`` / ``decode_gbps``: what a sync runs — the producer's ``DeltaHistory.encode_many`` of the chunks as
  one group against the stored bases (find the changed words, build the payloads, update the bases with their undo
  journal, checksum the new bytes: on a GPU folded from the base's word hash, ``kernels/word_delta.py``; one host
  sync for the group) and the consumer's ``codec.apply_verified_many`` on its held copy (validate, apply, check:
  folded from the held hash on a GPU); ``per_chunk``: the same, one call (and host sync) per chunk;
- ``stateless``: ``encode(new, old, checksum=True)`` and ``decode_`` + ``verify`` with no stored hashes (a full
  hash of each chunk on each side: xxh3 on the host, the word hash on a GPU).
GB/s = dense chunk bytes / seconds (encode reads twice that: the new and the old chunk). Prints a table, or one JSON
line with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402

from shardsync.delta import codec  # noqa: E402
from shardsync.delta.history import DeltaHistory  # noqa: E402


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed(fn, dev: torch.device, reps: int) -> float:
    """Median seconds of ``reps`` runs of ``fn`` (after one warm-up)."""
    fn()
    out = []
    for _ in range(reps):
        _sync(dev)
        t = time.perf_counter()
        fn()
        _sync(dev)
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def _product(news: list, olds: list, dev: torch.device, reps: int, *, grouped: bool) -> tuple[float, float, bool, list]:
    """Median seconds of the producer's history encode and the consumer's verified apply of every chunk, each rep a
    new version: the stored base and the held copy alternate between the old and the new bytes (so every version
    changes the same words), their hashes known from the version before as in a run of syncs. ``grouped``: the
    chunks as one group, as a sync runs them (``encode_many`` / ``apply_verified_many``: one host sync for all);
    else one call per chunk."""
    keys = [("bench", "g", i) for i in range(len(olds))]
    hist = DeltaHistory(dict(zip(keys, (o.numel() for o in olds))), budget_bytes=2 * sum(o.numel() + 64 for o in olds),
                        device=dev)
    held = [o.clone() for o in olds]
    hashes: list = [None] * len(olds)
    hist.begin(1)
    for k, o in zip(keys, olds):
        hist.encode(k, o, checksum=True)
    hist.commit(1)
    enc_t, dec_t, exact, encs = [], [], True, []
    for v in range(2, reps + 4):
        target = news if v % 2 == 0 else olds
        hist.begin(v)
        _sync(dev)
        t = time.perf_counter()
        if grouped:
            encs = [e for e, _ in hist.encode_many([(k, c, True) for k, c in zip(keys, target)])]
        else:
            encs = [hist.encode(k, c, checksum=True) for k, c in zip(keys, target)]
        _sync(dev)
        enc_t.append(time.perf_counter() - t)
        hist.commit(v)
        t = time.perf_counter()
        if grouped:
            hashes = codec.apply_verified_many([(h, e, v - 1, hashes[i], "")
                                                for i, (h, e) in enumerate(zip(held, encs))])
            assert not any(isinstance(x, Exception) for x in hashes), hashes
        else:
            for i, (h, e) in enumerate(zip(held, encs)):
                hashes[i] = codec.apply_verified(h, e, base=v - 1, held_hash=hashes[i])
        _sync(dev)
        dec_t.append(time.perf_counter() - t)
        exact = exact and all(torch.equal(h, c) for h, c in zip(held, target))
    return statistics.median(enc_t[2:]), statistics.median(dec_t[2:]), exact, encs


def run(*, chunks: int, chunk_mib: int, fractions: list[float], reps: int, device: str) -> dict:
    dev = torch.device(device)
    nbytes = chunk_mib << 20
    g = torch.Generator(device="cpu").manual_seed(0)
    olds = [(torch.randn(nbytes // 2, generator=g) * 0.02).to(torch.bfloat16).view(torch.uint8).to(dev)
            for _ in range(chunks)]
    held = [o.clone() for o in olds]
    total = chunks * nbytes
    copy_s = _timed(lambda: [h.copy_(o) for h, o in zip(held, olds)], dev, reps)
    out: dict = {"device": str(dev), "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                 "threads": torch.get_num_threads(), "torch": torch.__version__, "chunks": chunks,
                 "chunk_bytes": nbytes, "total_bytes": total, "copy_gbps": round(total / copy_s / 1e9, 2),
                 "fractions": {}}
    for f in fractions:
        news = []
        for o in olds:
            w = o.view(torch.int16).clone()
            m = (torch.rand(w.numel(), generator=g) < f).to(dev)
            w[m] ^= 1  # one ulp of a bf16: what a small optimizer step does to a changed element
            news.append(w.view(torch.uint8))
        encs: list = []
        hist_enc_s, hist_dec_s, hist_exact, hist_encs = _product(news, olds, dev, reps, grouped=True)
        one_enc_s, one_dec_s, one_exact, _ = _product(news, olds, dev, reps, grouped=False)
        enc_s = _timed(lambda: encs.__setitem__(slice(None), [codec.encode(n, o, base=0, checksum=True)
                                                               for n, o in zip(news, olds)]), dev, reps)

        def dec() -> None:
            for h, o in zip(held, olds):
                h.copy_(o)  # back to the old bytes (timed apart below)
            _sync(dev)

        dec_times = []
        for _ in range(reps + 1):
            dec()
            t = time.perf_counter()
            for h, e in zip(held, encs):
                codec.decode_(h, e, base=0)
                codec.verify(h, e.header)  # the held bytes against the producer's checksum, as a consumer does
            _sync(dev)
            dec_times.append(time.perf_counter() - t)
        exact = all(torch.equal(h, n) for h, n in zip(held, news))
        wire = sum(e.wire_nbytes for e in encs)
        changed = sum(e.changed or 0 for e in encs) / (total // 2)
        dec_s = statistics.median(dec_times[1:])
        out["fractions"][f"{f:g}"] = {
            "changed_fraction": round(changed, 5), "kinds": sorted({e.header.kind for e in hist_encs}),
            "encode_gbps": round(total / hist_enc_s / 1e9, 3), "decode_gbps": round(total / hist_dec_s / 1e9, 3),
            "encode_decode_gbps": round(total / (hist_enc_s + hist_dec_s) / 1e9, 3),
            "encode_ms_per_chunk": round(hist_enc_s / chunks * 1e3, 3),
            "decode_ms_per_chunk": round(hist_dec_s / chunks * 1e3, 3),
            "wire_bytes": wire, "bytes_ratio": round(total / wire, 2), "exact": exact and hist_exact and one_exact,
            "per_chunk": {"encode_gbps": round(total / one_enc_s / 1e9, 3),
                          "decode_gbps": round(total / one_dec_s / 1e9, 3)},
            "stateless": {"encode_gbps": round(total / enc_s / 1e9, 3), "decode_gbps": round(total / dec_s / 1e9, 3),
                          "encode_decode_gbps": round(total / (enc_s + dec_s) / 1e9, 3)}}
    hash_s = _timed(lambda: [codec.checksum_of(o, codec.hash_for(o)) for o in olds], dev, reps)
    out["checksum"] = {"hash": "word" if codec.hash_for(olds[0]) == codec.WORD else "xxh3",
                       "gbps": round(total / hash_s / 1e9, 2)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--chunk-mib", type=int, default=64)
    ap.add_argument("--fractions", default="0.001,0.01,0.05")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    r = run(chunks=a.chunks, chunk_mib=a.chunk_mib, fractions=[float(x) for x in a.fractions.split(",")],
            reps=a.reps, device=a.device)
    print(f"{r['device_name']} ({r['device']}, {r['threads']} threads): {r['chunks']} x {a.chunk_mib} MiB, "
          f"plain copy {r['copy_gbps']} GB/s", file=sys.stderr)
    for f, x in r["fractions"].items():
        print(f"  {float(f):>6.1%} changed: encode {x['encode_gbps']:>8} GB/s  decode {x['decode_gbps']:>8} GB/s  "
              f"both {x['encode_decode_gbps']:>8} GB/s (per chunk: {x['per_chunk']['encode_gbps']} / "
              f"{x['per_chunk']['decode_gbps']}; stateless: {x['stateless']['encode_gbps']} / "
              f"{x['stateless']['decode_gbps']})  {x['bytes_ratio']:>6}x fewer bytes ({'/'.join(x['kinds'])})  "
              f"exact={x['exact']}", file=sys.stderr)
    if a.json:
        print(json.dumps(r))
    return 0 if all(x["exact"] for x in r["fractions"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
