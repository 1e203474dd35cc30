"""The CUDA decode GEMMs (megatron_fp4/kernels/cuda_decode.py, megatron_fp4/kernels/csrc/w4_decode.cu and w4_wgmma.cu).

CPU: the decode layout, read back with a PyTorch emulation of the kernel's bit operations, gives the reference
quantizer's dequantized weight bit for bit (HiF4 and MXFP4, NaN units/blocks, MXFP4 wide scales, ragged N and K).
GPU (``gpu``): both kernels (mma.sync and wgmma, several tiles each), bit-exact on one-hot activations (each output
is one weight value) and equal to the fp64 product of the same operands within fp32 summation error; the rollout
dispatch path.
"""

import dataclasses
import os
import re
import subprocess

import pytest
import torch

from megatron_fp4.kernels import _nvcc
from megatron_fp4.kernels.cuda_decode import decode_layout_dequantize, to_decode_layout
from megatron_fp4.formats import get_format


def _weight(N, K, name, seed=0, specials=True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * torch.exp(torch.randn(N, K, generator=g) * 2)
    if specials:
        w[1, : min(K, 70)] = float("nan")
        w[2] = 0.0
        w[min(4, N - 1), 5] = float("inf")
        if name != "hif4":
            w[min(6, N - 1), 10] = 3e5  # an MXFP4 block scale above 2^1: the two-factor path
    return w


def _same(a, b):
    return torch.equal(torch.nan_to_num(a, nan=0.123), torch.nan_to_num(b, nan=0.123)) and torch.equal(
        torch.isnan(a), torch.isnan(b))


def _reference(qt, dw):
    """The dequantized weight with every row holding a NaN all NaN (a NaN weight times any activation is NaN: what
    the decode GEMMs give; the layout records those rows in ``nan_rows``)."""
    ref = qt.dequantize().float()
    rows = ref.isnan().any(dim=1)
    got = torch.zeros_like(rows) if dw.nan_rows is None else torch.zeros_like(rows).index_fill_(0, dw.nan_rows, True)
    assert torch.equal(got, rows)
    ref[rows] = float("nan")
    return ref


def _wide(qt):
    return qt.fmt.name != "hif4" and bool((qt.scales.reshape(-1) > 128).any())


@pytest.mark.parametrize("name", ["hif4", "mxfp4", "mxfp4_rceil"])
@pytest.mark.parametrize("N,K", [(16, 64), (40, 192), (33, 96), (8, 32)])
def test_decode_layout_reads_back_the_reference(name, N, K):
    qt = get_format(name).quantize(_weight(N, K, name).to(torch.bfloat16), dim=-1)
    dw = to_decode_layout(qt, _wide(qt))
    assert dw.codes.shape[0] % 4 == 0 and dw.codes.shape[2:] == (32, 4)
    assert _same(decode_layout_dequantize(dw), _reference(qt, dw))
    assert (dw.nan_rows is not None) == (N > 1)  # _weight's NaN block lies in row 1


@pytest.mark.parametrize("name", ["hif4", "mxfp4", "mxfp4_rceil"])
@pytest.mark.parametrize("N,K", [(16, 64), (40, 192), (33, 96), (8, 32)])
def test_natural_decode_layout_reads_back_the_reference(name, N, K):
    from megatron_fp4.kernels.cuda_decode import _HIF4_OFFSET, _mx_natural_position

    # MXFP4's natural words: the 4 bits of the 8 codes take each of the 32 bit positions once
    assert sorted(_mx_natural_position(j, h, b) for j in range(4) for h in range(2) for b in range(4)) == list(range(32))
    # HiF4's: offset binary, 8 + the sign-magnitude code's value (-0 is +0)
    assert [o - 8 for o in _HIF4_OFFSET] == [(-1) ** (c >> 3) * (c & 7) for c in range(16)]
    qt = get_format(name).quantize(_weight(N, K, name).to(torch.bfloat16), dim=-1)
    dw = to_decode_layout(qt, _wide(qt), natural=True)
    assert dw.natural and not torch.equal(dw.codes, to_decode_layout(qt, _wide(qt)).codes)
    assert dw.meta.shape[-1] == (80 if name == "hif4" else 32)  # HiF4: 16 words (one per lane pair) and 8 codes
    assert _same(decode_layout_dequantize(dw), _reference(qt, dw))
    assert not dw.subnormal  # (_weight's values reach ~1e4: HiF4's factors too large for the subnormal codes)


@pytest.mark.parametrize("N,K", [(16, 64), (40, 192), (33, 96), (8, 32)])
def test_hif4_subnormal_decode_layout_reads_back_the_reference(N, K, monkeypatch):
    """HiF4's subnormal layout (sign and magnitude, one multiply per pair): the four rotations' bits take each
    position of the word once; where the weight's factors fit (small values, NaN units included) it is the natural
    layout's default and reads back the reference bit for bit; MEGATRON_FP4_DECODE_HIF4_SUBNORMAL=0 keeps offset
    binary; subnormal=True on a weight that does not fit, or on another layout or format, is refused."""
    from megatron_fp4.kernels.cuda_decode import HIF4_SUBNORMAL_SWITCH, _hif4_subnormal_position, hif4_subnormal_fits

    positions = [_hif4_subnormal_position(j, h, b) for j in range(4) for h in range(2) for b in range(4)]
    assert sorted(positions) == list(range(32))
    qt = get_format("hif4").quantize((_weight(N, K, "hif4") * 1e-5).to(torch.bfloat16), dim=-1)
    assert hif4_subnormal_fits(qt)
    dw = to_decode_layout(qt, False, natural=True)
    assert dw.subnormal and _same(decode_layout_dequantize(dw), _reference(qt, dw))
    offset = to_decode_layout(qt, False, natural=True, subnormal=False)
    assert not offset.subnormal and not torch.equal(offset.codes, dw.codes)
    assert _same(decode_layout_dequantize(offset), _reference(qt, dw))
    monkeypatch.setenv(HIF4_SUBNORMAL_SWITCH, "0")
    assert not to_decode_layout(qt, False, natural=True).subnormal
    big = get_format("hif4").quantize(_weight(N, K, "hif4").to(torch.bfloat16), dim=-1)
    mx = get_format("mxfp4").quantize(_weight(N, K, "mxfp4") * 1e-5, dim=-1)
    for q, natural in ((big, True), (qt, False), (mx, True)):
        with pytest.raises(ValueError, match="subnormal=True takes a HiF4 weight in natural order"):
            to_decode_layout(q, False, natural=natural, subnormal=True)
    assert not to_decode_layout(mx, False, natural=True).subnormal


def test_hif4_subnormal_fits_at_the_edge():
    """hif4_subnormal_fits: E6M2 exponent bits c plus a group's exponent sum e at most 48 in every unit; NaN units
    (code 255) aside. Units well below the edge need no exponent sums; those at c = 47, 48 are checked group by group."""
    from megatron_fp4.kernels.cuda_decode import hif4_subnormal_fits

    qt = get_format("hif4").quantize(torch.randn(4, 128) * 0.01, dim=-1)
    assert hif4_subnormal_fits(qt)

    def fits(code, e8=0, e16=0, nan_unit=False):
        sc = qt.scales.clone()
        sc[1, 1] = torch.tensor([code, e8, e16 & 255, e16 >> 8], dtype=torch.uint8)
        if nan_unit:
            sc[2, 0, 0] = 255
        return hif4_subnormal_fits(dataclasses.replace(qt, scales=sc))

    assert fits(48 << 2 | 3) and not fits(48 << 2, e16=1 << 15) and not fits(49 << 2)
    assert fits(47 << 2, e8=1 << 7) and not fits(47 << 2, e8=1 << 7, e16=1 << 15)  # e = 1 fits, e = 2 not
    assert fits(46 << 2 | 3, e8=255, e16=65535) and fits(40 << 2, nan_unit=True)


def test_hif4_subnormal_factor_is_exact_up_to_its_bound():
    """The subnormal layout's arithmetic for every E6M2 code, exponent sum e and signed magnitude: the bf16 subnormal
    k x 2^-129 times E6M2 x 2^(e + 127) is (+-k / 4) x 2^e x E6M2 exactly while the exponent bits of E6M2 plus e are
    at most 48 (hif4_subnormal_fits' bound), and the factor is not finite at 49 (inf or NaN): the bound is tight."""
    from megatron_fp4.kernels.cuda_decode import _bf, _bits, _hif4_base_bits

    code = torch.arange(255, dtype=torch.int64).view(-1, 1, 1)  # (255: NaN)
    e = torch.arange(3, dtype=torch.int64).view(1, -1, 1)
    c = torch.arange(16, dtype=torch.int64).view(1, 1, -1)  # sign-magnitude codes
    sub = ((c & 8) << 12) | ((c & 7) << 4)  # bf16 bits: sign at 15, magnitude at 4..6, exponent field 0
    factor = _hif4_base_bits(code) + (129 << 7) + (e << 7)
    ok = (code >> 2) + e <= 48
    e6m2 = _bf(_hif4_base_bits(code)) * 4
    want = torch.where(c >= 8, -1.0, 1.0) * (c & 7) / 4 * 2.0 ** e * e6m2
    got = _bf(_bits(_bf(sub) * _bf(factor)))
    assert torch.equal(got[ok.expand_as(got)], want[ok.expand_as(want)])
    assert not bool(torch.isfinite(_bf(factor[((code >> 2) + e == 49).expand_as(factor)])).any())


def test_hif4_negated_factor_by_exponent_add():
    """The natural HiF4 kernel's -136 F (w4_device.h's dequant): -136 x base once per chunk, then e added to the
    exponent field of each half, is bit for bit -136 x (base x 2^e) rounded (every E6M2 code, every exponent sum)."""
    from megatron_fp4.kernels.cuda_decode import _bf, _bits, _hif4_base_bits

    e = torch.arange(4, dtype=torch.int64)
    base = _hif4_base_bits(torch.arange(256, dtype=torch.int64).unsqueeze(-1))
    before = _bits(_bf(base + (e << 7)) * -136.0)
    after = _bits(_bf(base) * -136.0) + (e << 7)
    assert torch.equal(after, before) and bool((after < 2 ** 16).all())
    assert torch.equal(_bf(after), -136.0 * _bf(base) * 2.0 ** e)  # exact: no rounding anywhere


@pytest.mark.parametrize("name,scale", [("hif4", 1.0), ("hif4", 1e-5), ("mxfp4", 1.0)])
@pytest.mark.parametrize("natural", [False, True])
def test_decode_layout_in_row_blocks(name, scale, natural, monkeypatch):
    """A weight laid out in blocks of LAYOUT_ROWS rows (what bounds the layout's int64 temporaries) is the layout of
    the whole at once: codes, meta, NaN rows (in the second block too), padding of the last block's slabs (HiF4's
    small weight: the subnormal layout in natural order)."""
    from megatron_fp4.kernels import cuda_decode as cd

    w = (_weight(200, 128, name) * scale).to(torch.bfloat16)
    w[130, 5] = float("nan")  # a NaN block in the third 64-row block
    qt = get_format(name).quantize(w, dim=-1)
    whole = to_decode_layout(qt, False, natural=natural)
    assert whole.subnormal == (natural and scale < 1)
    monkeypatch.setattr(cd, "LAYOUT_ROWS", 64)
    blocks = to_decode_layout(qt, False, natural=natural)
    assert blocks.subnormal == whole.subnormal
    assert torch.equal(blocks.codes, whole.codes) and torch.equal(blocks.meta, whole.meta)
    assert torch.equal(blocks.nan_rows, whole.nan_rows) and 130 in whole.nan_rows.tolist()
    assert blocks.slabs == whole.slabs == 16  # 13 slabs of 16 rows, padded to a multiple of 4


def test_natural_layout_is_the_default(monkeypatch):
    from megatron_fp4.kernels.cuda_decode import natural_layout
    from megatron_fp4.kernels.dispatch import PreparedWeight, decode_kernel_max_m

    monkeypatch.delenv("MEGATRON_FP4_DECODE_LAYOUT", raising=False)
    assert natural_layout()
    monkeypatch.setenv("MEGATRON_FP4_DECODE_LAYOUT", "permuted")
    assert not natural_layout()
    monkeypatch.setenv("MEGATRON_FP4_DECODE_LAYOUT", "swizzled")
    with pytest.raises(ValueError, match="MEGATRON_FP4_DECODE_LAYOUT='swizzled' is not valid; allowed values: "
                                         "'permuted', 'natural'"):
        natural_layout()
    # the decode kernel serves up to 64 tokens on natural-order weights, else up to 32 (cuBLAS above)
    def max_m(n, k, natural):
        qt = get_format("mxfp4").quantize(torch.randn(n, k) * 0.1, dim=-1)
        dw = to_decode_layout(qt, False, natural=natural) if natural is not None else None
        return decode_kernel_max_m(PreparedWeight(qt, None, qt.fmt, "exact", False, decode=dw))

    assert max_m(8960, 4096, True) == max_m(1536, 1536, True) == 64
    assert max_m(8960, 4096, False) == max_m(8960, 4096, None) == 32


def test_natural_tile_override_names_the_variable_and_keys():
    from megatron_fp4.kernels.cuda_decode import natural_tile_override

    assert natural_tile_override('{"CLUSTER": 1, "SPLIT": 4}') == {"CLUSTER": 1, "SPLIT": 4}
    for bad in ('{"CLUSTR": 1}', '{"PINA": 1}', '[1]', '{"CLUSTER": "1"}', '{"XST": -1}'):
        with pytest.raises(ValueError, match="MEGATRON_FP4_DECODE_NATURAL_TILE=.*keys among WGS, DEPTH, XST"):
            natural_tile_override(bad)
    with pytest.raises(ValueError, match="MEGATRON_FP4_DECODE_NATURAL_TILE must be a JSON object"):
        natural_tile_override("CLUSTER=1")
    # a cluster is at most 8 blocks: the balanced split is capped there
    from megatron_fp4.kernels.cuda_decode import _balanced_split

    assert _balanced_split(28, 296, 132, 2, 0, 2) == 9 and _balanced_split(28, 296, 132, 2, 8, 2) == 8


def test_natural_tile_per_token_bucket(monkeypatch):
    """64 tokens take NATURAL_TILE_AT_64's keys (both formats) over NATURAL_TILE's; the environment's keys
    (MEGATRON_FP4_DECODE_NATURAL_TILE) go over both, a call's config over all."""
    from megatron_fp4.kernels import cuda_decode as cd

    monkeypatch.setattr(cd, "_NATURAL_ENV", {})
    for m in (8, 16, 32):
        assert cd.natural_tile(None, m) == {**cd.NATURAL_TILE, "NATURAL": 1}
    assert cd.natural_tile(None, 64) == {**cd.NATURAL_TILE, **cd.NATURAL_TILE_AT_64, "NATURAL": 1}
    assert cd.natural_tile(None, 64)["WGS"] == 1 and cd.natural_tile(None, 64)["XST"] == 7
    assert cd.natural_tile({"WGS": 2, "MINB": 2}, 64)["WGS"] == 2
    monkeypatch.setattr(cd, "_NATURAL_ENV", {"WGS": 2, "CLUSTER": 1})
    assert cd.natural_tile(None, 64)["WGS"] == 2 and cd.natural_tile(None, 16)["CLUSTER"] == 1
    assert cd.natural_tile({"WGS": 4}, 64)["WGS"] == 4
    # the split follows the tile: 64-row blocks, three per SM (132 SMs), a 7B gate or up weight (3584x18944), 64 tokens
    assert cd._balanced_split(18944 // 64, 56, 132, 3, 56, cd._split_tail(64)) == 1


def test_sweep_tiles_run_over_each_token_buckets_default(monkeypatch):
    """bench_kernels --sweep-tiles' objects go over the default tile of each token count, as the engine runs it: a
    forced split at 64 tokens times the one-warpgroup, seven-stage tile (session 54's first 64-token split sweep timed
    the 16-token tile there, since the objects went over NATURAL_TILE alone); a bad object is a parser error naming
    the option."""
    import argparse

    from benchmarks.bench_kernels import _sweep_tiles
    from megatron_fp4.kernels import cuda_decode as cd

    monkeypatch.setattr(cd, "_NATURAL_ENV", {})
    p = argparse.ArgumentParser()
    (tile,) = _sweep_tiles(p, '[{"SPLIT": 3}]')
    assert cd.natural_tile(tile, 64) == {**cd.NATURAL_TILE, **cd.NATURAL_TILE_AT_64, "SPLIT": 3, "NATURAL": 1}
    assert cd.natural_tile(tile, 16) == {**cd.NATURAL_TILE, "SPLIT": 3, "NATURAL": 1}
    with pytest.raises(SystemExit):
        _sweep_tiles(p, '[{"SPLT": 3}]')


def _ring_block_bytes(fmt_id: int, ntok: int, tile: dict) -> int:
    """Shared memory one block of a natural tile takes on the SM, as w4_wgmma.cu lays its ring out: XST stages of
    activations (NTOK x 64 bf16) and of the slabs' weights (512 bytes of codes + META_BYTES each, 128-byte aligned),
    the 896-byte slack that aligns the ring to 1 KB, 128 bytes of static mbarriers, the 1 KB the driver reserves."""
    slabs, meta = 4 * tile["WGS"], (80, 32)[fmt_id]
    wstage = -(-slabs * (512 + meta) // 128) * 128
    return tile["XST"] * (ntok * 128 + wstage) + 896 + 128 + 1024


def test_natural_default_tiles_fit_their_blocks_per_sm():
    """Every token bucket's default tile fits MINB blocks in an H100 / H200 SM's 233,472 bytes of shared memory (a
    tile that does not runs fewer blocks, and slower: HiF4's three blocks of seven stages at 64 tokens with its
    144-byte metadata of session 51 needed 234,624 bytes and ran 10-25% slower than six stages on an H100; MXFP4's,
    223,872 bytes, ran 6.6% faster)."""
    from megatron_fp4.kernels import cuda_decode as cd

    for f in (0, 1):
        for m in (8, 16, 32, 64):
            tile = cd.natural_tile(None, m)
            assert tile["MINB"] * _ring_block_bytes(f, m, tile) <= 233472, (f, m, tile)
    assert 3 * _ring_block_bytes(1, 64, dict(WGS=1, XST=7)) == 223872  # MXFP4: measured to fit three
    assert 3 * _ring_block_bytes(0, 64, dict(WGS=1, XST=7)) == 229248  # HiF4 with its 80-byte metadata: fits


def test_prebuild_jobs(monkeypatch):
    """prebuild compiles each distinct set of nvcc defines once: natural tiles (given without KERNEL, as
    h200_checks.sh's prebuild_tests passes the GPU tests' NATURAL_GPU_TILES) resolve over NATURAL_TILE, per token
    bucket; a tile differing only in SPLIT compiles nothing new."""
    from megatron_fp4.kernels import cuda_decode as cd

    built = []
    monkeypatch.setattr(cd._nvcc, "compile_library", lambda source, defines: built.append((source, defines)))
    monkeypatch.setattr(cd, "_NATURAL_ENV", {})
    base = cd.prebuild(workers=1)
    assert base == len(built) == len({(s, tuple(sorted(d.items()))) for s, d in built})
    built.clear()
    tiles = [dict(t, NATURAL=1) for t in NATURAL_GPU_TILES if t] + [t for t in GPU_TILES if t]
    assert cd.prebuild(tiles, ntoks=(8, 16, 64), workers=1) == len(built) > base
    wgs4 = [d for s, d in built if d.get("NATURAL") and d["WGS"] == 4 and d["MINB"] == 1 and d["WTMA"] == 1]
    # (natural HiF4 in both of its layouts: offset binary and subnormal)
    assert sorted((d["FMT"], d["NTOK"], d["SUBN"]) for d in wgs4) == sorted(
        [(0, m, sub) for m in (8, 16, 64) for sub in (0, 1)] + [(1, m, 0) for m in (8, 16, 64)])
    assert all(s == "w4_wgmma.cu" for s, d in built if "NATURAL" in d)
    built.clear()
    assert cd.prebuild([dict(SPLIT=3, NATURAL=1)], ntoks=(16,), workers=1) == base


def test_decode_layout_mxfp4_without_wide_scales():
    qt = get_format("mxfp4").quantize(_weight(24, 128, "mxfp4", specials=False) * 1e-3, dim=-1)
    assert not _wide(qt)
    assert _same(decode_layout_dequantize(to_decode_layout(qt, False)), qt.dequantize().float())


def test_decode_layout_rejects_other_formats():
    with pytest.raises(ValueError, match="HiF4/MXFP4"):
        to_decode_layout(get_format("nvfp4").quantize(torch.randn(16, 64), dim=-1))


def test_decode_kernel_choice_and_split():
    from megatron_fp4.kernels import cuda_decode as cd

    # the measured split: 7B MLP weights take mma.sync, the 1.5B ones (and 7B attention) wgmma
    assert cd.default_kernel(18944, 3584) == cd.default_kernel(3584, 18944) == "mma"
    assert {cd.default_kernel(n, k) for n, k in ((8960, 1536), (1536, 8960), (2048, 1536), (3584, 3584))} == {"wgmma"}
    # ... except at 9-16 tokens, where the large weights take the wgmma kernel's producer-warp tile
    assert cd._choose(18944, 3584, 16, None, 1) == ("wgmma", cd.LARGE_M16_TILES[1])
    assert cd._choose(18944, 3584, 16, None, 0) == ("wgmma", cd.LARGE_M16_TILES[0]) and cd.LARGE_M16_TILES[0]["LEAN"]
    assert cd._choose(18944, 3584, 64, None, 0) == ("mma", None) and cd._choose(8960, 1536, 16, None, 0) == ("wgmma", None)
    assert cd._choose(18944, 3584, 16, {"KERNEL": "mma"}, 0) == ("mma", {"KERNEL": "mma"})
    # whole waves: 148 row blocks x 56 chunks on 132 SMs of 2 blocks: not 2 splits (296 blocks, a second wave of 32)
    assert cd._balanced_split(148, 56, 132, 2, tail=2) == 7
    assert cd._balanced_split(28, 296, 132, 2, tail=2) == 9  # one wave of 252 blocks
    assert cd._balanced_split(300, 4, 300, 2, tail=2) == 2 and cd._balanced_split(4, 1, 132, 2) == 1
    # a longer epilogue (more tokens' outputs added atomically per block): fewer splits
    assert cd._balanced_split(148, 56, 132, 2, tail=8) == 3
    # a wave of fewer than SPLIT_OVERLAP blocks per SM is not faster: 296 blocks on 132 SMs of three (session 54)
    # take one split, not 4 splits' three waves of 1,184 short blocks
    assert cd._balanced_split(296, 56, 132, 3, tail=16) == 1 and cd._balanced_split(296, 56, 132, 2, tail=16) == 2
    # the tail as w4_decode passes it and the splits it gives the engine's weights (row blocks, chunks) at 16, 32 and
    # 64 tokens with the default tiles (two warpgroups, then one at 64; three, two, three blocks per SM): session 54's
    # measured best split on an H100 of each (benchmarks/results/decode_h100_s54_split_*.json), except qkv at 32
    # (6 measured, 7 not) and 1.5B fc2 at 64 (9 and 12 measured within 2%, 11 not), the model's own
    assert [cd._split_tail(n) for n in (8, 16, 32, 64)] == [8, 16, 32, 64]
    picks = {}
    for ntok, resident, wgs in ((16, 3, 2), (32, 2, 2), (64, 3, 1)):
        for name, (n, k) in dict(qkv=(4608, 3584), proj=(3584, 3584), fc1_7b=(37888, 3584), fc2_7b=(3584, 18944),
                                 fc1_15b=(17920, 1536), fc2_15b=(1536, 8960)).items():
            row_blocks, chunks = -(-n // (64 * wgs)), k // 64
            split = cd._balanced_split(row_blocks, chunks, 132, resident, tail=cd._split_tail(ntok))
            picks.setdefault(name, []).append(-(-chunks // -(-chunks // split)))  # as w4_decode rounds it
    assert picks == dict(qkv=[7, 7, 3], proj=[8, 8, 4], fc1_7b=[1, 1, 1], fc2_7b=[14, 9, 7], fc1_15b=[2, 1, 1],
                         fc2_15b=[20, 20, 11])
    qt = get_format("hif4").quantize(torch.randn(16, 64), dim=-1)
    with pytest.raises(ValueError, match="allowed values: 'mma', 'wgmma'"):
        cd.w4_decode(torch.zeros(2, 64, dtype=torch.bfloat16), to_decode_layout(qt), config={"KERNEL": "tma"})


def _ptxas_report(defines: dict, path: str) -> str:
    r = subprocess.run(_nvcc.command("w4_wgmma.cu", defines, path, "90a", "-cubin", "-Xptxas", "-v"),
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout + r.stderr


@pytest.mark.skipif(_nvcc.nvcc() is None, reason="needs nvcc (no GPU: a compile for sm_90a)")
def test_wgmma_tiles_compile_without_spills_or_serialized_wgmmas(tmp_path):
    """ptxas's report for the wgmma kernel's default tiles (every token bucket, both formats, wide MXFP4) and the
    producer-warp tiles the decode sweep times at M = 16 (and at M = 64 its LEAN tile without producer, its
    four-warpgroup tiles and its NATURAL tiles for M = 64; WJIT at 16 and 64): no register spills, and no
    "wgmma.mma_async instructions are serialized" note (ptxas's answer to a wgmma under thread-dependent control
    flow, or to too few registers to keep the wgmmas in flight: they then run one at a time)."""
    from megatron_fp4.kernels import cuda_decode as cd
    from benchmarks.bench_kernels import _NAT, SWEEP_TILES

    if not os.environ.get("MEGATRON_FP4_DECODE_NATURAL_TILE"):
        assert _NAT == cd.NATURAL_TILE  # the sweep's baseline is the default tile
    configs = [(f, w, m, None) for (f, m) in cd.WGMMA_TILES for w in ((0,) if f == 0 else (0, 1))]
    configs += [(f, 0, 16, t) for t in SWEEP_TILES if t.get("PRODUCER") for f in (0, 1)]
    configs += [(f, 0, 64, t) for t in SWEEP_TILES if t.get("LEAN") and not t.get("PRODUCER") for f in (0, 1)]
    configs += [(f, 0, 64, t) for t in SWEEP_TILES if t.get("WGS") == 4 or t.get("NATURAL") and t["MINB"] < 3
                for f in (0, 1)]
    configs += [(f, w, 16, cd.LARGE_M16_TILES[f]) for f, w in ((0, 0), (1, 0), (1, 1))]
    configs += [(f, w, m, cd.natural_tile(None, m)) for f, w in ((0, 0), (1, 0), (1, 1)) for m in (8, 16, 32, 64)]
    configs += [(0, 0, m, dict(cd.natural_tile(None, m), SUBN=1)) for m in (8, 16, 32, 64)]  # HiF4's subnormal codes
    configs += [(f, 0, m, cd.natural_tile(dict(WJIT=1), m)) for f in (0, 1) for m in (16, 64)]  # words just in time
    builds = {tuple(sorted(cd._defines("wgmma", f, bool(w), m, cd._tile("wgmma", f, m, tile)).items()))
              for f, w, m, tile in configs}  # (a SPLIT override compiles nothing new)
    for defines in map(dict, sorted(builds)):
        report = _ptxas_report(defines, str(tmp_path / "k.cubin"))
        assert " 0 bytes spill stores" in report and "serialized" not in report, (defines, report[-1500:])
        if defines["WRING"]:  # the static mbarriers as _ring_block_bytes counts them (XST <= 16 of 8 bytes)
            assert " 128 bytes smem" in report, (defines, report[-1500:])


@pytest.mark.skipif(_nvcc.nvcc() is None, reason="needs nvcc (no GPU: a compile for sm_90a)")
def test_launchers_take_the_bf16_output_flag_and_refuse_it_with_atomic_split_k():
    """Both launchers' 16 arguments (ctypes) reach the library: a bf16 output with an atomic split-K is refused
    before any CUDA call (cudaErrorInvalidValue = 1); any other launch, PDL or not, fails here only for want of a
    GPU."""
    from megatron_fp4.kernels import cuda_decode as cd

    for kernel, tile in (("mma", None), ("wgmma", cd.NATURAL_TILE), ("wgmma", dict(cd.NATURAL_TILE, CLUSTER=1)),
                         ("wgmma", dict(cd.NATURAL_TILE, WTMA=0))):
        fn = cd.build(kernel, 1, False, 16, cd._tile(kernel, 1, 16, tile))
        args = [None] * 4 + [16, 64, 4, 2, 64, 64]  # M, N, S, C, ldx, ldo
        for partial in (0, 1):  # (per-split partial sums are fp32 too)
            refused = fn(*args, 2, 1, 1, partial, 0, None) == 1  # split 2, cps 1, bf16 output
            assert refused == (not (tile or {}).get("CLUSTER")), (kernel, tile)
        for pdl in (0, 1):  # no GPU here: some other CUDA error, not the refusal
            assert fn(*args, 1, 2, 1, 0, pdl, None) not in (0, 1)


@pytest.mark.skipif(_nvcc.nvcc() is None, reason="needs nvcc (no GPU: a compile for sm_90a)")
def test_decode_kernels_start_by_waiting_for_the_kernel_before(tmp_path):
    """Programmatic dependent launch (MEGATRON_FP4_PDL=1): both kernels begin with griddepcontrol.wait (SASS
    ACQBULK), then griddepcontrol.launch_dependents (PREEXIT), ahead of any global or shared-memory access (read by
    instruction address in nvdisasm's listing), so a kernel launched early reads nothing the kernel before it still
    writes and lets the next one launch only once the one before has finished."""
    import triton

    from megatron_fp4.kernels import cuda_decode as cd

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    if not os.path.exists(nvdisasm):
        pytest.skip("this Triton has no nvdisasm")
    for kernel, tile in (("mma", None), ("wgmma", cd.NATURAL_TILE)):
        defines = cd._defines(kernel, 1, False, 16, cd._tile(kernel, 1, 16, tile))
        path = str(tmp_path / f"{kernel}.cubin")
        cmd = [a for a in _nvcc.command(cd._SOURCES[kernel], defines, path, "90a", "-cubin")
               if a not in ("-shared", "-Xcompiler", "-fPIC")]
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
        sass = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True, check=True).stdout
        words = [line.split("*/", 1)[1].split() for line in sass.splitlines()
                 if re.match(r"\s*/\*[0-9a-f]{4,}\*/", line)]  # the instruction lines, by their addresses
        ops = [w[1] if w[0].startswith("@") else w[0].rstrip(";") for w in words]  # (past a predicate)
        first_memory = min(i for i, op in enumerate(ops) if op.startswith(("LDG", "STG", "RED", "ATOM", "UTMALDG",
                                                                           "UBLKCP", "LDS", "STS", "SYNCS")))
        assert ops.count("ACQBULK") == 1 and ops.index("ACQBULK") < ops.index("PREEXIT") < first_memory, \
            ops[:first_memory + 1]


# ---------------------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------------------
def _cuda_ready():
    from megatron_fp4.kernels import cuda_decode

    if not cuda_decode.available():
        pytest.skip("CUDA decode kernel not available (needs sm_90 and nvcc)")
    return cuda_decode


#: Tiles of both kernels: the defaults (None: per token bucket), and others that change the loop structure.
GPU_TILES = [None, dict(KERNEL="mma", SPW=2, DEPTH=2, WARPS=4, PER_SM=2), dict(KERNEL="mma", SPW=1, DEPTH=8, WARPS=8,
                                                                                PER_SM=4),
             dict(KERNEL="wgmma"), dict(KERNEL="wgmma", WGS=2, DEPTH=2, XST=3, MINB=2),
             dict(KERNEL="wgmma", WGS=1, DEPTH=4, XST=4, MINB=4),
             dict(KERNEL="wgmma", PRODUCER=1, WGS=1, DEPTH=4, XST=4, MINB=3),
             dict(KERNEL="wgmma", PRODUCER=1, WGS=2, DEPTH=2, XST=3, MINB=2),
             dict(KERNEL="wgmma", PRODUCER=1, WGS=2, DEPTH=2, XST=4, MINB=3),  # LARGE_M16_TILES[1]
             dict(KERNEL="wgmma", PRODUCER=1, WGS=2, DEPTH=2, XST=4, MINB=3, LEAN=1),
             dict(KERNEL="wgmma", WGS=2, DEPTH=2, XST=4, MINB=2, LEAN=1),
             dict(KERNEL="wgmma", PRODUCER=1, WGS=2, DEPTH=2, XST=4, MINB=3, LEAN=1, XPAIR=1),
             dict(KERNEL="wgmma", WGS=4, DEPTH=2, XST=4, MINB=1, XPAIR=1),
             dict(KERNEL="wgmma", PRODUCER=1, WGS=4, DEPTH=2, XST=4, MINB=1, XPAIR=1, LEAN=1),
             dict(KERNEL="wgmma", PRODUCER=1, WGS=2, DEPTH=2, XST=4, MINB=3, LEAN=1, WRING=1),
             dict(KERNEL="wgmma", PRODUCER=1, WGS=4, DEPTH=2, XST=6, MINB=1, XPAIR=1, LEAN=1, WRING=1)]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["hif4", "mxfp4"])
@pytest.mark.parametrize("tile", GPU_TILES)
def test_gpu_decode_bit_exact_one_hot(name, tile):
    _assert_one_hot_reads_back(_cuda_ready(), name, tile, natural=False)


def _assert_one_hot_reads_back(cd, name, tile, natural, scale=1.0):
    """One-hot activation columns read the weight back exactly at M = 64, 16, 5 (K = 320, not a multiple of 64)."""
    N, K = 72, 320
    qt = get_format(name).quantize((_weight(N, K, name) * scale).to(torch.bfloat16).cuda(), dim=-1)
    dw = to_decode_layout(qt, _wide(qt), natural=natural)
    ref = _reference(qt, dw)  # a NaN weight times the zero activations: NaN outputs
    for M in (64, 16, 5):
        got = torch.empty_like(ref)
        for k0 in range(0, K, M):
            ks = torch.arange(k0, min(K, k0 + M), device="cuda")
            x = torch.zeros(len(ks), dw.chunks * 64, dtype=torch.bfloat16, device="cuda")
            x[torch.arange(len(ks)), ks] = 1.0
            got[:, ks] = cd.w4_decode(x, dw, config=tile).t()
        assert _same(got, ref), (name, M)


#: The natural-K-order tiles (weights from to_decode_layout(natural=True); activations by TMA).
NATURAL_GPU_TILES = [None, dict(WGS=4, XST=6, MINB=1), dict(XST=4, MINB=3), dict(SPLIT=1), dict(LEAN=0),
                     dict(CLUSTER=1), dict(CLUSTER=1, SPLIT=3), dict(WTMA=0), dict(WTMA=0, CLUSTER=1),
                     dict(WTMA=0, WGS=4, XST=6, MINB=1), dict(WGS=1, XST=7, MINB=3), dict(WTMA=0, XST=7), dict(XST=10),
                     dict(XST=14), dict(WJIT=1), dict(WJIT=1, XST=3)]


def _tile_id(tile) -> str:
    """A natural tile's test id by its keys (the default tile's is "None": issue20-rows selects it so)."""
    return "None" if tile is None else "-".join(f"{k}{v}" for k, v in tile.items())


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["hif4", "mxfp4", "mxfp4_rceil"])
@pytest.mark.parametrize("tile", NATURAL_GPU_TILES, ids=_tile_id)
def test_gpu_natural_layout_bit_exact(name, tile):
    """One-hot columns read back the reference weight exactly (M = 64, 16, 5, K not a multiple of 64: the TMA's
    zero rows and columns), and random activations match the fp64 product (M = 1 .. 64, ragged slabs); HiF4 in both
    of its natural layouts (offset binary for _weight's large values, subnormal for small ones)."""
    cd = _cuda_ready()
    _assert_one_hot_reads_back(cd, name, tile, natural=True)
    if name == "hif4":
        _assert_one_hot_reads_back(cd, name, tile, natural=True, scale=1e-5)
    N, K = 1000, 1056
    qt = get_format(name).quantize((torch.randn(N, K, device="cuda") * 0.05).to(torch.bfloat16), dim=-1)
    layouts = [to_decode_layout(qt, _wide(qt), natural=True)]
    assert layouts[0].subnormal == (name == "hif4")
    if name == "hif4":
        layouts.append(to_decode_layout(qt, False, natural=True, subnormal=False))
    for dw in layouts:
        for M in (1, 7, 16, 33, 64):
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            ref = x.double() @ qt.dequantize().double().t()
            got = cd.w4_decode(x, dw, config=tile).double()
            assert ((got - ref).norm() / ref.norm()).item() < 1e-5, (name, dw.subnormal, M)
    with pytest.raises(ValueError, match="wgmma"):
        cd.w4_decode(x, dw, config={"KERNEL": "mma"})


@pytest.mark.gpu
def test_gpu_default_tiles_blocks_per_sm():
    """The occupancy API on the built kernels: every token bucket's default tile runs at least its MINB blocks per SM
    (what its registers were budgeted for and the split-K counted before session 54), and at 8-16 tokens three,
    where its 66 registers and 42.7 KB ring leave room (the split-K counts them now)."""
    cd = _cuda_ready()
    for f, w in ((0, False), (1, False), (1, True)):
        for m in (8, 16, 32, 64):
            cfg = cd._tile("wgmma", f, m, dict(cd.natural_tile(None, m), SUBN=int(f == 0)))
            blocks = cd.blocks_per_sm(f, w, m, cfg)
            assert blocks >= cfg["MINB"], (f, w, m, blocks)
            if m <= 16:
                assert blocks == 3, (f, w, m, blocks)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["hif4", "mxfp4"])
def test_gpu_cluster_split_k_is_deterministic(name):
    """CLUSTER=1: the same bits on every run (the split blocks sum in rank order, no atomics), where the atomic
    split-K of the same tile differs in the last bits between runs."""
    cd = _cuda_ready()
    N, K = 3584, 18944  # a 7B MLP weight (down_proj): a split-K at 64 tokens (7 of the cluster's 8 at most)
    qt = get_format(name).quantize((torch.randn(N, K, device="cuda") * 0.02).to(torch.bfloat16), dim=-1)
    dw = to_decode_layout(qt, _wide(qt), natural=True)
    x = torch.randn(64, K, device="cuda").to(torch.bfloat16)
    runs = [cd.w4_decode(x, dw, config=dict(CLUSTER=1)) for _ in range(5)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    # the kernel's own bf16 stores: the fp32 sums rounded to nearest even, as torch rounds them
    assert torch.equal(cd.w4_decode(x, dw, config=dict(CLUSTER=1), out_dtype=torch.bfloat16), runs[0].bfloat16())
    ref = x.double() @ qt.dequantize().double().t()
    assert ((runs[0].double() - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [None, dict(WTMA=0), dict(KERNEL="mma"), dict(CLUSTER=1)])
def test_gpu_out_dtype_none_stores_each_splits_partial_sums(tile):
    """out_dtype None: [splits, M, N], each split's fp32 partial sums stored (no atomics, no zero-filled output):
    their sum in split order is the product, the same bits on every run; one split (SPLIT 1, or a cluster's own
    reduction) is [1, M, N]."""
    cd = _cuda_ready()
    from megatron_fp4.kernels.decode_ops import sum_splits

    N, K = 1000, 4096
    qt = get_format("mxfp4").quantize((torch.randn(N, K, device="cuda") * 0.05).to(torch.bfloat16), dim=-1)
    natural = (tile or {}).get("KERNEL") != "mma"
    dw = to_decode_layout(qt, _wide(qt), natural=natural)
    for M in (64, 5):
        x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        ref = x.double() @ qt.dequantize().double().t()
        cfg = dict(tile or {}, SPLIT=4)
        parts = cd.w4_decode(x, dw, config=cfg, out_dtype=None)
        want = 1 if (tile or {}).get("CLUSTER") else 4
        assert parts.shape == (want, M, N) and parts.dtype == torch.float32, (tile, parts.shape)
        total = sum_splits(parts, torch.float32, 2)
        assert ((total.double() - ref).norm() / ref.norm()).item() < 1e-5
        assert all(torch.equal(parts, cd.w4_decode(x, dw, config=cfg, out_dtype=None)) for _ in range(3))
        one = cd.w4_decode(x, dw, config=dict(tile or {}, SPLIT=1), out_dtype=None)
        assert one.shape == (1, M, N) and torch.equal(one[0], cd.w4_decode(x, dw, config=dict(tile or {}, SPLIT=1)))


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [None, dict(KERNEL="mma")])
def test_gpu_rounded_split_k_is_the_split_sums_rounded_once(tile):
    """A split-K with a bf16 output stores its partial sums and one split_sum kernel adds them in order and rounds
    once: exactly sum_splits of the stored splits, the same bits on every run (no atomics); one split: the kernel's
    own bf16 store, the same numbers; and dispatch.linear's bias rides on the same kernel."""
    cd = _cuda_ready()
    from megatron_fp4.kernels import dispatch
    from megatron_fp4.kernels.decode_ops import split_sum, sum_splits

    N, K = 1000, 4096
    qt = get_format("hif4").quantize((torch.randn(N, K, device="cuda") * 0.05).to(torch.bfloat16), dim=-1)
    dw = to_decode_layout(qt, _wide(qt), natural=(tile or {}).get("KERNEL") != "mma")
    bias = torch.randn(N, device="cuda").to(torch.bfloat16)
    for M, split in ((64, 4), (5, 3), (16, 1)):
        x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        cfg = dict(tile or {}, SPLIT=split)
        parts = cd.w4_decode(x, dw, config=cfg, out_dtype=None)
        got = cd.w4_decode(x, dw, config=cfg, out_dtype=torch.bfloat16)
        assert got.shape == (M, N) and got.dtype == torch.bfloat16
        assert torch.equal(got, sum_splits(parts, torch.bfloat16, 2)), (M, split)
        assert torch.equal(got, cd.w4_decode(x, dw, config=cfg, out_dtype=torch.bfloat16))
        assert torch.equal(split_sum(parts, torch.bfloat16, bias), sum_splits(parts, torch.bfloat16, 2, bias))
    w = dispatch.prepare_weight(qt.dequantize().float(), "hif4")
    for M in (16, 64):  # the decode kernel (split sums as stored) up to 64 tokens on a natural-order weight
        x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        sums = dispatch.linear(x, w, activations="bf16", out_dtype=None)
        got = dispatch.linear(x, w, activations="bf16", out_dtype=torch.bfloat16, bias=bias)
        assert torch.equal(got, sum_splits(sums, torch.bfloat16, 2, bias)), M


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["hif4", "mxfp4", "mxfp4_rceil"])
@pytest.mark.parametrize("M", [1, 7, 16, 33, 64])
def test_gpu_decode_matches_fp64_product(name, M):
    cd = _cuda_ready()
    N, K = 1000, 1056  # ragged slabs; K a multiple of 32, not of 64
    w = (torch.randn(N, K, device="cuda") * 0.05).to(torch.bfloat16)
    qt = get_format(name).quantize(w, dim=-1)
    dw = to_decode_layout(qt, _wide(qt))
    x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    ref = x.double() @ qt.dequantize().double().t()
    for tile in (*GPU_TILES, dict(KERNEL="mma", SPLIT=1), dict(KERNEL="wgmma", SPLIT=1),
                 dict(KERNEL="wgmma", SPLIT=3),
                 dict(KERNEL="wgmma", PRODUCER=1, WGS=2, DEPTH=4, XST=4, MINB=1, SPLIT=1)):
        got = cd.w4_decode(x, dw, config=tile)
        assert got.shape == (M, N) and got.dtype == torch.float32
        assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-5
        if (tile or {}).get("SPLIT") == 1:  # one store per output: the kernel's bf16 is torch's rounding of its fp32
            assert torch.equal(cd.w4_decode(x, dw, config=tile, out_dtype=torch.bfloat16), got.bfloat16()), tile


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["hif4", "mxfp4"])
def test_gpu_dispatch_decode_uses_cuda_kernel(name):
    _cuda_ready()
    from megatron_fp4.kernels import dispatch
    from megatron_fp4.resq import resq_activation

    f = get_format(name)
    w = (torch.randn(512, 768, device="cuda") * 0.05).to(torch.bfloat16)
    pw = dispatch.prepare_weight(w, name)
    assert pw.decode is not None
    wq = f.fake_quantize(w.float(), dim=-1).double()
    for M in (8, 24, 48, 64):  # the decode kernel up to decode_kernel_max_m, cuBLAS on the expansions above
        x = torch.randn(M, 768, device="cuda").to(torch.bfloat16)
        cases = [(dict(activations="bf16"), x.double()),
                 (dict(activations="fp4"), f.fake_quantize(x.float(), dim=-1).double()),
                 (dict(resq="2:4", resq_combine="bf16"),
                  resq_activation(x, name, "2:4", out_dtype=torch.bfloat16).double())]
        for kw, a in cases:
            ref = a @ wq.t()
            got = dispatch.linear(x, pw, **kw).double()
            assert ((got - ref).norm() / ref.norm()).item() < 1e-5, (M, kw)
