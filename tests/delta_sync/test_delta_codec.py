"""Delta codec (``shardsync.delta.codec``): every form round-trips to exactly the new bytes; the choice rule picks the
smallest and never exceeds dense; hostile headers and payloads are refused with typed errors naming the field,
before anything is written."""

from __future__ import annotations

import msgspec
import pytest
import torch
from hypothesis import given, settings, strategies as st

from shardsync.delta import codec
from shardsync.delta.codec import BITMAP, DENSE, PAIRS, DeltaHeader, Encoded
from shardsync.engine.protocol.wire import chunk_checksum
from shardsync.errors import DeltaError, DeltaFormatError, DeltaMismatch, SyncError


def _pair(n: int, frac: float, seed: int, *, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = torch.randint(0, 256, (n + offset,), dtype=torch.uint8, generator=g)[offset:]
    new = old.clone()
    m = torch.rand(n, generator=g) < frac
    new[m] = new[m] ^ torch.randint(1, 256, (int(m.sum()),), dtype=torch.uint8, generator=g)  # really changed
    return new, old


def _roundtrip(new: torch.Tensor, old: torch.Tensor, base: int = 3) -> Encoded:
    enc = codec.encode(new, old, base=base, checksum=True)
    n = new.numel()
    assert enc.payload.numel() <= n and enc.wire_nbytes <= n + codec.HEADER_MAX  # bounded by dense + header
    assert enc.payload.numel() == codec.payload_nbytes(enc.header.kind, n, enc.header.count)
    h = codec.read_header(codec.header_bytes(enc.header), nbytes=n, base=base)
    held = old.clone()
    codec.decode_(held, Encoded(h, enc.payload.clone()), base=base)
    assert torch.equal(held, new)
    codec.verify(held, h)
    slot = torch.full((n,), 7, dtype=torch.uint8)  # a receive slot with someone else's bytes
    codec.decode_into(slot, old, enc, base=base)
    assert torch.equal(slot, new)
    return enc


@settings(max_examples=150, deadline=None)
@given(n=st.integers(0, 3000), frac=st.sampled_from([0.0, 0.001, 0.01, 0.03, 0.1, 0.5, 0.95, 1.0]) | st.floats(0, 1),
       seed=st.integers(0, 2**31), offset=st.sampled_from([0, 0, 2, 8, 3]))
def test_encode_decode_round_trips_exactly(n: int, frac: float, seed: int, offset: int) -> None:
    new, old = _pair(n, frac, seed, offset=offset)  # odd offsets / lengths exercise the unaligned word paths
    enc = _roundtrip(new, old)
    k = enc.changed
    words = n // codec.word_size(n)
    differs = (new != old) if n % 2 else (new.clone().view(torch.int16) != old.clone().view(torch.int16))
    assert k == int(differs.sum())
    assert enc.header.kind == codec.choose(n, k)
    sizes = {kind: codec.payload_nbytes(kind, n, words if kind == DENSE else k) for kind in codec.KINDS}
    assert enc.payload.numel() == min(sizes.values())


@pytest.mark.parametrize("n", [1, 2, 63, 64, 4096, 4097, 65536])
def test_none_changed_and_all_changed(n: int) -> None:
    new, old = _pair(n, 0.0, 1)
    e = _roundtrip(new, old)
    assert (e.header.kind, e.header.count, e.payload.numel(), e.changed) == (PAIRS, 0, 0, 0)
    new, old = _pair(n, 1.0, 2)
    e = _roundtrip(new, old)
    assert e.header.kind == DENSE and e.payload.numel() == n


def test_the_choice_rule_by_fraction() -> None:
    n = 1 << 20  # bytes: 2**19 bf16 words
    words = n // 2
    assert codec.choose(n, 0) == PAIRS
    assert codec.choose(n, words // 100) == PAIRS          # 1 %: 6 bytes per change
    assert codec.choose(n, words // 32 + 1) == BITMAP      # above 1/32: bitmap + values
    assert codec.choose(n, words * 15 // 16 - 1) == BITMAP
    assert codec.choose(n, words * 15 // 16 + 1) == DENSE
    assert codec.choose(n, words) == DENSE


def test_no_base_is_dense_and_the_checksum_is_the_wire_checksum() -> None:
    new, _ = _pair(1000, 0.5, 3)
    e = codec.encode(new, None, checksum=True)
    assert e.header.kind == DENSE and e.header.base is None and e.payload.data_ptr() == new.data_ptr()
    assert e.header.checksum == codec.checksum(new) == chunk_checksum(new)
    out = torch.empty(2000, dtype=torch.uint8)
    e2 = codec.encode(new, None, out=out)
    assert e2.payload.data_ptr() == out.data_ptr() and torch.equal(e2.payload, new)


def test_encoding_is_deterministic() -> None:
    new, old = _pair(10_000, 0.05, 4)
    a, b = codec.encode(new, old, base=1), codec.encode(new, old, base=1)
    assert a.header == b.header and torch.equal(a.payload, b.payload)


# ------------------------------------------------------------------------------------------- hostile input
def _good(kind: str) -> tuple[Encoded, torch.Tensor]:
    frac = {DENSE: 1.0, PAIRS: 0.005, BITMAP: 0.2}[kind]
    new, old = _pair(4096, frac, 5)
    e = codec.encode(new, old, base=9)
    assert e.header.kind == kind
    return e, old


@pytest.mark.parametrize("changes, field", [
    (dict(kind="zip"), "kind"),
    (dict(nbytes=8192), "nbytes"),
    (dict(nbytes=-1), "nbytes"),
    (dict(count=-1), "count"),
    (dict(count=10**12), "count"),
    (dict(count=2049), "count"),          # more words than the chunk has
    (dict(kind=PAIRS, count=1000), "count"),  # a pairs payload larger than dense
    (dict(kind=DENSE, count=5), "count"),
    (dict(base=None), "base"),
    (dict(base=-4), "base"),
    (dict(checksum=1 << 64), "checksum"),
    (dict(count=True), "count"),
])
def test_hostile_headers_are_refused_naming_the_field(changes: dict, field: str) -> None:
    e, old = _good(PAIRS)
    h = msgspec.structs.replace(e.header, **changes)
    with pytest.raises(DeltaFormatError) as ei:
        codec.check_header(h, nbytes=4096, where="plan ab group g chunk 0")
    assert ei.value.field == field and "plan ab group g chunk 0" in str(ei.value)
    held = old.clone()
    with pytest.raises(DeltaFormatError):
        codec.decode_(held, Encoded(h, e.payload))
    assert torch.equal(held, old)  # nothing written


def test_header_bytes_from_a_peer_are_bounded_and_typed() -> None:
    e, _ = _good(BITMAP)
    wire = codec.header_bytes(e.header)
    assert len(wire) <= codec.HEADER_MAX
    for bad in (b"", b"\xc1", wire[:-1], b"\x95" + b"\xa3zip" * 5, wire + b"\x00" * codec.HEADER_MAX,
                msgspec.msgpack.encode(["pairs", "4096", 1, None, None])):
        with pytest.raises(DeltaFormatError):
            codec.read_header(bad, nbytes=4096)
    with pytest.raises(DeltaMismatch):  # a delta against another version than the one held
        codec.read_header(wire, nbytes=4096, base=8)
    assert issubclass(DeltaFormatError, DeltaError) and issubclass(DeltaError, SyncError)


def _tampered(kind: str, fn) -> tuple[Encoded, torch.Tensor]:
    e, old = _good(kind)
    p = e.payload.clone()
    fn(p, e.header)
    return Encoded(e.header, p), old


@pytest.mark.parametrize("kind, tamper, field", [
    (PAIRS, lambda p, h: p[:4].view(torch.int32).fill_(-1), "indices"),
    (PAIRS, lambda p, h: p[4 * (h.count - 1): 4 * h.count].view(torch.int32).fill_(2048), "indices"),  # past the end
    (PAIRS, lambda p, h: p[4:8].copy_(p[:4]), "indices"),                                   # a duplicate index
    (PAIRS, lambda p, h: p[:8].view(torch.int32).copy_(p[:8].view(torch.int32).flip(0)), "indices"),  # unsorted
    (BITMAP, lambda p, h: p[:4].view(torch.int32).bitwise_xor_(1 << 3), "count"),             # population != count
])
def test_hostile_payloads_are_refused_before_writing(kind: str, tamper, field: str) -> None:
    e, old = _tampered(kind, tamper)
    held = old.clone()
    with pytest.raises(DeltaFormatError) as ei:
        codec.decode_(held, e, base=9, where="chunk 3")
    assert ei.value.field == field, str(ei.value)
    assert torch.equal(held, old)


def test_bitmap_bits_past_the_last_word_are_refused() -> None:
    new, old = _pair(4000, 0.2, 8)  # 2000 words: the bitmap's last uint32 has 16 padding bits
    e = codec.encode(new, old, base=0)
    assert e.header.kind == BITMAP
    p = e.payload.clone()
    first = int(p[:250].nonzero()[0])
    p[first] &= p[first] - 1  # move one set bit (the population stays right) ...
    p[251] |= 0x80            # ... to word 2015
    held = old.clone()
    with pytest.raises(DeltaFormatError) as ei:
        codec.decode_(held, Encoded(e.header, p), base=0)
    assert ei.value.field == "bitmap" and torch.equal(held, old)


def test_wrong_payload_length_or_destination_is_refused() -> None:
    e, old = _good(PAIRS)
    for p in (e.payload[:-1], torch.cat([e.payload, e.payload[:2]]), e.payload.view(torch.int16)):
        with pytest.raises(DeltaFormatError):
            codec.decode_(old.clone(), Encoded(e.header, p))
    with pytest.raises(DeltaFormatError) as ei:
        codec.decode_(old[:-2].clone(), e)
    assert ei.value.field == "nbytes"
    with pytest.raises(DeltaFormatError):
        codec.decode_(old.clone().view(torch.int16), e)


def test_a_corrupted_result_fails_the_checksum() -> None:
    new, old = _pair(4096, 0.01, 6)
    e = codec.encode(new, old, base=1, checksum=True)
    held = old.clone()
    held[5] ^= 1  # the consumer did not hold exactly version 1
    codec.decode_(held, e, base=1)
    with pytest.raises(DeltaMismatch):
        codec.verify(held, e.header, where="chunk 0")


def test_unaligned_payloads_are_read() -> None:
    new, old = _pair(4096, 0.005, 7)
    e = codec.encode(new, old, base=0)
    raw = torch.empty(e.payload.numel() + 1, dtype=torch.uint8)
    raw[1:].copy_(e.payload)  # the payload sits at an odd address of a receive buffer
    held = old.clone()
    codec.decode_(held, Encoded(e.header, raw[1:]), base=0)
    assert torch.equal(held, new)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("frac", [0.0, 0.01, 0.2, 1.0])
def test_cuda_round_trip_and_history(frac: float) -> None:
    """The same plain-torch code on the device: the same forms and payloads as on the CPU, applied exactly."""
    from shardsync.delta.history import DeltaHistory
    from shardsync.kernels.word_hash import word_hash

    new, old = _pair((4 << 20) + 6, frac, 11)
    cpu = codec.encode(new, old, base=2)
    dn, do = new.cuda(), old.cuda()
    dev = codec.encode(dn, do, base=2)
    assert dev.header == cpu.header and torch.equal(dev.payload.cpu(), cpu.payload)
    held = do.clone()
    codec.decode_(held, dev, base=2)
    assert torch.equal(held, dn)
    key = ("d", "g", 0)
    for where in ("cuda", "cpu"):  # the history on the device, or on the host with device chunks
        h = DeltaHistory({key: new.numel()}, budget_bytes=2 * new.numel() + 64, device=where, pin_memory=True)
        h.begin(1)
        h.encode(key, do)
        h.commit(1)
        h.begin(2)
        e = h.encode(key, dn, checksum=True)  # a device chunk: the word hash, computed there
        based = None if cpu.header.kind == DENSE else 1  # a dense chunk names no base
        assert e.header == msgspec.structs.replace(cpu.header, base=based, checksum=word_hash(new), hash=codec.WORD)
        assert word_hash(dn) == word_hash(new)  # the fused kernel (or torch ops) on the device: the same value
        h.rollback()
        assert torch.equal(h.held(key).cpu(), old) and h.version(key) == 1


def test_a_checksum_the_caller_computed_is_used_as_given() -> None:
    """A producer that checksums each chunk anyway passes that xxh3 (an int) instead of hashing again."""
    g = torch.Generator().manual_seed(5)
    old = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=g)
    new = old.clone()
    new[100:104] ^= 1
    real = codec.checksum(new)
    assert codec.encode(new, old, base=1, checksum=True).header.checksum == real
    assert codec.encode(new, old, base=1, checksum=real).header.checksum == real
    assert codec.encode(new, old, base=1, checksum=False).header.checksum is None
    assert codec.dense(new, checksum=real).header.checksum == real
    wrong = codec.encode(new, old, base=1, checksum=real ^ 1)  # a wrong one is caught where the bytes are checked
    with pytest.raises(codec.DeltaMismatch):
        codec.verify(new, wrong.header)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 64, 1000, 4099])
def test_word_hash_is_its_definition_at_every_length_and_address(n: int) -> None:
    """The torch path equals the plain-Python definition, whatever the length (a zero-padded tail) and the address
    (an unaligned view is hashed as its bytes)."""
    from shardsync.kernels.word_hash import word_hash, word_hash_reference

    t = torch.randint(0, 256, (n + 1,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    assert word_hash(t[:n]) == word_hash_reference(bytes(t[:n].tolist()))
    assert word_hash(t[1:]) == word_hash_reference(bytes(t[1:].tolist()))
    assert 0 <= word_hash(t) < 1 << 64


def test_word_hash_sees_one_changed_bit_a_moved_word_and_the_length() -> None:
    from shardsync.kernels.word_hash import word_hash

    t = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    h = word_hash(t)
    seen = {h}
    for byte, bit in ((0, 0), (7, 7), (40000, 3), ((1 << 16) - 1, 7)):  # each single flip, the top bits among them
        u = t.clone()
        u[byte] ^= 1 << bit
        seen.add(word_hash(u))
    w = t.clone().view(torch.int64)
    w[[3, 9]] = w[[9, 3]]  # two words swapped
    seen.add(word_hash(w.view(torch.uint8)))
    u = t.clone()
    u.view(torch.int64)[[5, 6]] ^= 1 << 63  # the same top bit flipped in two words
    seen.add(word_hash(u))
    seen.add(word_hash(torch.cat([t, torch.zeros(1, dtype=torch.uint8)])))  # a zero byte appended
    assert len(seen) == 8


def test_a_word_hash_header_is_verified_by_that_hash_and_an_unknown_hash_refused() -> None:
    from shardsync.kernels.word_hash import word_hash

    new, old = _pair(4096, 0.01, 3)
    e = codec.encode(new, old, base=1, checksum=True)
    assert e.header.hash == codec.XXH3 and e.header.checksum == codec.checksum(new)  # a host chunk: xxh3
    h = msgspec.structs.replace(e.header, checksum=word_hash(new), hash=codec.WORD)
    h2 = codec.read_header(codec.header_bytes(h), nbytes=4096, base=1)
    held = old.clone()
    codec.decode_(held, Encoded(h2, e.payload), base=1)
    codec.verify(held, h2)  # by the word hash it names
    with pytest.raises(DeltaMismatch):
        codec.verify(held, msgspec.structs.replace(h2, hash=codec.XXH3))
    with pytest.raises(DeltaFormatError, match="hash"):
        codec.check_header(msgspec.structs.replace(h2, hash=7), nbytes=4096)
