"""kernels/word_delta.py: changed words and the word hash folded from them, on the torch path, the Triton kernels
(run by Triton's interpreter on the CPU, compiled on a GPU) and through the codec, history and held copy."""

from __future__ import annotations

import os
import subprocess
import sys

import msgspec
import pytest
import torch
from hypothesis import given, settings, strategies as st

from shardsync.delta import codec
from shardsync.delta.codec import Encoded
from shardsync.delta.history import DeltaHistory
from shardsync.errors import DeltaFormatError, DeltaMismatch
from shardsync.kernels import word_delta
from shardsync.kernels.word_hash import fold, word_hash, word_hash_many, word_hash_reference


def _pair(nbytes: int, changes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    new = old.clone()
    if nbytes and changes:
        at = torch.randint(0, nbytes, (changes,), generator=g)
        new[at] ^= torch.randint(1, 256, (changes,), dtype=torch.uint8, generator=g)
    return new, old


def _reference(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    return (new.view(torch.int16) != old.view(torch.int16)).nonzero().view(-1)


@settings(max_examples=60, deadline=None)
@given(words=st.integers(0, 3000), changes=st.integers(0, 400), seed=st.integers(0, 1 << 30))
def test_changes_and_the_folded_hash_are_the_definitions(words: int, changes: int, seed: int) -> None:
    new, old = _pair(8 * words, changes, seed)
    ch = word_delta.find_changes(new, old)
    ref = _reference(new, old)
    assert torch.equal(ch.idx, ref) and torch.equal(ch.vals, new.view(torch.int16)[ref])
    assert fold(word_hash(old), new.numel(), ch.hash_delta) == word_hash(new)
    before = old.clone()
    ok, change = word_delta.change_terms(old, ref.to(torch.int32), ch.vals)  # the pairs form's int32 indices
    assert ok and fold(word_hash(old), new.numel(), change) == word_hash(new)
    assert torch.equal(old, before)  # nothing written


def test_change_terms_refuses_indices_out_of_order_or_range() -> None:
    new, old = _pair(8 * 500, 60, 3)
    idx = _reference(new, old)
    assert idx.numel() > 3
    for bad in (idx.flip(0), torch.cat([idx[:2], idx[1:2], idx[2:]]), torch.cat([idx, torch.tensor([2000])]),
                torch.cat([torch.tensor([-1]), idx])):
        vals = torch.zeros(bad.numel(), dtype=torch.int16)
        assert word_delta.change_terms(old, bad, vals) == (False, 0)
    with pytest.raises(ValueError):
        word_delta.change_terms(new[1:9], idx[:1], idx[:1].to(torch.int16))  # an unaligned chunk is not for them
    with pytest.raises(ValueError):
        word_delta.change_terms(new, idx, idx[1:].to(torch.int16))  # a value per index
    with pytest.raises(ValueError):
        word_delta.find_changes(new[:12], old[:12])  # nor a partial 64-bit word


def _word_hashed(enc: Encoded, new: torch.Tensor) -> Encoded:
    """A header as a GPU producer writes it (the word hash of the new bytes)."""
    return Encoded(msgspec.structs.replace(enc.header, checksum=word_hash(new), hash=codec.WORD), enc.payload)


@pytest.mark.parametrize("changes", [0, 40, 2000])  # no change, pairs, bitmap
def test_apply_verified_folds_the_held_hash(changes: int) -> None:
    new, old = _pair(8 * 4096, changes, 9)
    enc = _word_hashed(codec.encode(new, old, base=4), new)
    held = old.clone()
    assert codec.apply_verified(held, enc, base=4, held_hash=word_hash(old)) == word_hash(new)
    assert torch.equal(held, new)
    held = old.clone()
    with pytest.raises(DeltaMismatch):  # the held hash is not the held bytes': the fold does not meet the checksum
        codec.apply_verified(held, enc, base=4, held_hash=word_hash(old) ^ 1)
    assert torch.equal(held, old)  # found before a byte was written
    if enc.header.kind == codec.PAIRS and enc.header.count > 1:
        k = enc.header.count
        forged = enc.payload.clone()
        forged[: 4 * k].view(torch.int32)[[0, 1]] = forged[: 4 * k].view(torch.int32)[[1, 0]]
        held = old.clone()
        with pytest.raises(DeltaFormatError) as e:
            codec.apply_verified(held, Encoded(enc.header, forged), base=4, held_hash=word_hash(old))
        assert e.value.field == "indices" and torch.equal(held, old)  # refused before a byte was written


def test_history_and_held_copy_fold_hashes_across_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the word hash (a GPU chunk's; forced here on the host), the producer's checksum of every delta after
    the first is folded from the stored base's, the consumer's check from its held hash; both stay the real hash
    across versions and a rollback."""
    monkeypatch.setattr(codec, "hash_for", lambda t: codec.WORD)
    full = []
    real_checksum_of = codec.checksum_of
    monkeypatch.setattr(codec, "checksum_of", lambda t, algo: full.append(algo) or real_checksum_of(t, algo))
    key = ("d", "g", 0)
    n = 8 * 2048
    hist = DeltaHistory({key: n}, budget_bytes=3 * n)
    g = torch.Generator().manual_seed(1)
    chunks = [_pair(n, 0, 1)[0]]
    for v in range(1, 6):  # each version a few bytes off the one before (version 3: only three)
        chunks.append(chunks[-1].clone())
        at = torch.randint(0, n, (3 if v == 2 else 30 * v,), generator=g)
        chunks[-1][at] ^= 5
    held = chunks[0].clone()
    hist.begin(1)
    hist.encode(key, chunks[0])
    hist.commit(1)
    held_hash = word_hash(held)
    for v in range(2, 6):
        hist.begin(v)
        enc = hist.encode(key, chunks[v - 1], checksum=True)
        assert enc.header.kind == codec.PAIRS and enc.header.hash == codec.WORD
        assert enc.header.checksum == word_hash(chunks[v - 1])
        held_hash = codec.apply_verified(held, enc, base=v - 1, held_hash=held_hash)
        assert torch.equal(held, chunks[v - 1]) and held_hash == word_hash(held)
        hist.commit(v)
        assert full == ([codec.WORD] if v == 2 else [])  # only version 2's checksum hashed the chunk: no base hash yet
        full.clear()
    hist.begin(6)
    hist.encode(key, chunks[0], checksum=True)
    hist.rollback()  # the base is version 5's bytes again, and so is the hash the next checksum folds from
    hist.begin(7)
    enc = hist.encode(key, chunks[2], checksum=True)
    assert enc.header.checksum == word_hash(chunks[2]) and enc.header.base == 5


_INTERPRETED = r"""
import torch
from shardsync.kernels import word_delta
from shardsync.kernels import word_hash as wh
from shardsync.kernels.word_hash import fold, word_hash
g = torch.Generator().manual_seed(0)
for n in (1, 5, wh._BLOCK, 3 * wh._BLOCK + 5):  # the word hash's own kernel (terms) against its torch path
    words = torch.randint(-(1 << 62), 1 << 62, (n,), dtype=torch.int64, generator=g)
    assert wh._words_triton(words) == (wh._words_torch(words) & wh._M), n
batch = []
for words in (0, 1, 1023, 1024, 1025, 3 * 1024 + 7):
    for changes in (0, 1, 37, 900):
        old = torch.randint(0, 256, (8 * words,), dtype=torch.uint8, generator=g)
        new = old.clone()
        if words and changes:
            new[torch.randint(0, 8 * words, (changes,), generator=g)] ^= 3
        batch.append((new, old))
        a, b = word_delta._changes_triton([(new, old)])[0], word_delta._changes_torch(new, old)
        assert torch.equal(a.idx, b.idx) and torch.equal(a.vals, b.vals) and a.hash_delta == b.hash_delta
        assert fold(word_hash(old), new.numel(), a.hash_delta) == word_hash(new)
        if words:
            want = word_delta._change_torch(old, a.idx, a.vals)
            assert want[0] and fold(word_hash(old), new.numel(), want[1]) == word_hash(new)
            assert word_delta._change_triton(old, a.idx, a.vals) == want
            assert word_delta._change_triton(old, a.idx.to(torch.int32), a.vals) == want
            if a.idx.numel() > 1:
                assert word_delta._change_triton(old, a.idx.flip(0), a.vals)[0] is False
for a, (new, old) in zip(word_delta._changes_triton(batch), batch):  # a group's chunks: one host sync for all
    b = word_delta._changes_torch(new, old)
    assert torch.equal(a.idx, b.idx) and torch.equal(a.vals, b.vals) and a.hash_delta == b.hash_delta
print("kernels agree")
"""


def test_the_triton_kernels_agree_with_torch_under_the_interpreter() -> None:
    """The kernels themselves (not the torch path), run by Triton's interpreter on CPU tensors."""
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "kernels agree" in r.stdout, r.stderr[-3000:]


def test_many_hashes_are_each_ones_hash() -> None:
    g = torch.Generator().manual_seed(3)
    data = torch.randint(0, 256, (70_000,), dtype=torch.uint8, generator=g)
    parts = [data, data[: 4096], data[8: 8 + 4096], data[3: 1003], data[: 5], data[:0]]
    assert word_hash_many(parts) == [word_hash(x) for x in parts] == [word_hash_reference(bytes(x.tolist()))
                                                                      for x in parts]
    assert word_hash_many([]) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_kernels_are_used_and_agree() -> None:
    """On a GPU the compiled kernels pass their probe and give the torch path's results on large chunks."""
    new, old = _pair(64 << 20, 300_000, 5)
    dn, do = new.cuda(), old.cuda()
    assert word_delta._use_triton(dn.device), word_delta.why_not
    a = word_delta.find_changes(dn, do)
    b = word_delta._changes_torch(new, old)
    assert torch.equal(a.idx.cpu(), b.idx) and torch.equal(a.vals.cpu(), b.vals) and a.hash_delta == b.hash_delta
    assert fold(word_hash(do), dn.numel(), a.hash_delta) == word_hash(dn)
    enc = codec.encode(dn, do, base=1, checksum=True, base_hash=word_hash(do))
    assert enc.header.hash == codec.WORD and enc.header.checksum == word_hash(dn)
    held = do.clone()
    assert codec.apply_verified(held, enc, base=1, held_hash=word_hash(do)) == enc.header.checksum
    assert torch.equal(held, dn)
    parts = [dn, do[: 8 << 20], dn[8: (8 << 20) + 8], dn[3: 4099], do[: 6]]  # whole, aligned, unaligned, tails
    assert word_hash_many(parts) == [word_hash(x) for x in parts]
