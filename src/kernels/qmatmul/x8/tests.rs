use super::super::tests::random_blocks;
use super::super::{quantize_rows, QActs};
use super::driver::{decode, decode_pair, group, pair, portable_group, quad};
use super::*;
use crate::kernels::quant::{iq4_indices_at, tq1_0_codes, BLOCK_FORMATS, TQ2_0_BYTES};
use crate::kernels::ternary::tq2_0_block;
use crate::kernels::testing::random_vec;

/// One interleaved group of random `dtype` rows of `k` values (seed `seed`), and `rows`
/// random activation rows quantized for it (seed `seed + 1`).
fn one_group(dtype: GgmlType, k: usize, rows: usize, seed: u64) -> (Buf<u8>, QActs) {
    let data = interleave(dtype, &random_blocks(dtype, GROUP * k / dtype.block().0, seed), k);
    let mut xq = QActs::default();
    quantize_rows(&random_vec(rows * k, seed + 1), rows, k, act_scales(dtype), &mut xq);
    (data, xq)
}

/// When the CPU has AVX2: for every interleaved format, one group of rows of
/// `k = width · max(block, 64)` values with [`TILE`] activation rows ([`one_group`]),
/// handed to `check(dtype, k, blocks per row, data, activations)`.
#[cfg(target_arch = "x86_64")]
fn each_format_on_avx2(width: usize, seed: u64, check: impl Fn(GgmlType, usize, usize, &[u8], &QActs)) {
    if !crate::kernels::matmul::avx2::available() {
        return;
    }
    for dtype in BLOCK_FORMATS {
        let per = dtype.block().0;
        let k = width * per.max(64);
        let (data, xq) = one_group(dtype, k, TILE, seed);
        check(dtype, k, k / per, &data, &xq);
    }
}

/// A group's records, with no values decoded ahead.
#[cfg(target_arch = "x86_64")]
fn records(data: &[u8]) -> avx2::Src {
    avx2::Src { rec: data.as_ptr(), vals: std::ptr::null() }
}

/// Eight rows of one 256-value `block` against [`TILE`] rows of `x`, through the AVX2
/// kernel: the group, its activations and the results.
#[cfg(target_arch = "x86_64")]
fn one_block_avx2(dtype: GgmlType, block: &[u8], x: f32) -> (Buf<u8>, QActs, [[f32; GROUP]; TILE]) {
    let k = 256;
    let data = interleave(dtype, &block.repeat(GROUP), k);
    let mut xq = QActs::default();
    quantize_rows(&vec![x; TILE * k], TILE, k, act_scales(dtype), &mut xq);
    let mut out = [[0f32; GROUP]; TILE];
    // SAFETY: the callers checked for AVX2; `data` is one group's records.
    unsafe { avx2::group(avx2::vnni(), dtype, records(&data), &xq, 0, TILE, 1, &mut out) };
    (data, xq, out)
}

/// `block` in each of a group's rows against activations all `x`: the AVX2 kernel's full
/// tile, and each row alone (the one-row kernels) on both instruction sets, give the
/// portable kernel's bits (`case` names the inputs). The records, activations and results.
#[cfg(target_arch = "x86_64")]
fn tiles_and_rows_agree(dtype: GgmlType, block: &[u8], x: f32, case: &str) -> (Buf<u8>, QActs, [[f32; GROUP]; TILE]) {
    let (data, xq, b) = one_block_avx2(dtype, block, x);
    let mut a = [[0f32; GROUP]; TILE];
    portable_group(dtype, &data, &xq, 0, TILE, 256, &mut a);
    assert_eq!(a, b, "{dtype:?}: {case}");
    for (vnni, t) in [false, avx2::vnni()].into_iter().flat_map(|v| (0..TILE).map(move |t| (v, t))) {
        let mut one = [[0f32; GROUP]; TILE];
        // SAFETY: the callers checked for AVX2 (VNNI where asked for); `data` is one group's records.
        unsafe { avx2::group(vnni, dtype, records(&data), &xq, t, 1, 1, &mut one) };
        assert_eq!(one[0], a[t], "{dtype:?} row {t} alone, VNNI {vnni}: {case}");
    }
    (data, xq, a)
}

/// Q6_K's 16-bit sums at their extremes (every value 0 or 63, every activation ±127,
/// scales ±127): the AVX2 kernel matches the portable one, nothing wraps.
#[cfg(target_arch = "x86_64")]
#[test]
fn q6_k_extremes_stay_in_range() {
    if !crate::kernels::matmul::avx2::available() {
        return;
    }
    let k = 256;
    for (q, x, sc) in [(0u8, 1.0f32, 127i8), (0, -1.0, -127), (0xFF, 1.0, 127), (0xFF, -1.0, -128)] {
        let mut block = [q; 210];
        block[192..208].fill(sc as u8);
        block[208..210].copy_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
        let case = format!("values {q:#x}, activations {x}, scales {sc}");
        let (data, xq, a) = tiles_and_rows_agree(GgmlType::Q6K, &block, x, &case);
        // The paired kernel, over decoded values (its 16 sums with VNNI, from the pair's
        // values side by side).
        let mut vals = vec![0u8; 2 * DECODED];
        if decodes_in_pairs(GgmlType::Q6K) {
            decode_pair(GgmlType::Q6K, [&data, &data], 1, &mut vals);
        } else {
            decode(GgmlType::Q6K, &data, 1, &mut vals[..DECODED]);
        }
        let src = avx2::Src { rec: data.as_ptr(), vals: vals.as_ptr() };
        let mut paired = [[[0f32; GROUP]; TILE]; 2];
        // SAFETY: AVX2 is present; `data` is one group's records and `vals` their values.
        unsafe { avx2::pair(avx2::vnni(), GgmlType::Q6K, [src; 2], &xq, 0, TILE, 1, &mut paired, avx2::Ahead::NONE) };
        assert_eq!(paired, [a; 2], "paired: values {q:#x}, activations {x}, scales {sc}");
        let want = 0.5 * sc as f32 * if q == 0 { -32.0 } else { 31.0 } * x * k as f32;
        assert!((a[0][0] - want).abs() <= 1e-3 * want.abs(), "{} vs {want}", a[0][0]);
    }
}

/// Q2_K's and Q3_K's sums at their extremes (every value at its largest or smallest,
/// every activation ±127, scales and mins at their largest or smallest): each row alone
/// (the one-row kernels, straight from the records) and the full tile, on both
/// instruction sets, give the portable kernel's bits and the exact sum.
#[cfg(target_arch = "x86_64")]
#[test]
fn q2_k_and_q3_k_extremes_stay_in_range() {
    if !crate::kernels::matmul::avx2::available() {
        return;
    }
    let (k, d) = (256, half::f16::from_f32(0.5).to_le_bytes());
    // (format, value bytes, scale bytes, the value of each weight)
    let cases = [
        // Q2_K: 2-bit values 3 under scale 15, min 15 (`dmin` 0.5), or 0 under scale and min 0.
        (GgmlType::Q2K, 0xFF, 0xFF, 0.5 * 15.0 * 3.0 - 0.5 * 15.0),
        (GgmlType::Q2K, 0x00, 0x00, 0.0),
        // Q3_K: values 3 (high bits set) under scale 31, or −4 under −32.
        (GgmlType::Q3K, 0xFF, 0xFF, 0.5 * 31.0 * 3.0),
        (GgmlType::Q3K, 0x00, 0x00, 0.5 * -32.0 * -4.0),
    ];
    for (dtype, q, sc, weight) in cases {
        let mut block = vec![q; dtype.block().1];
        match dtype {
            GgmlType::Q2K => {
                block[..16].fill(sc);
                block[80..82].copy_from_slice(&d);
                block[82..84].copy_from_slice(&d);
            }
            _ => {
                block[96..108].fill(sc);
                block[108..110].copy_from_slice(&d);
            }
        }
        for x in [1.0f32, -1.0] {
            let (_, _, a) =
                tiles_and_rows_agree(dtype, &block, x, &format!("values {q:#x}, activations {x}, scales {sc:#x}"));
            let want = weight * x * k as f32;
            assert!((a[0][0] - want).abs() <= 1e-3 * want.abs().max(1.0), "{dtype:?}: {} vs {want}", a[0][0]);
        }
    }
}

/// Q4_K's and Q5_K's 16-bit sums at their extremes (every value at its largest, every
/// activation ±127, scales 63): the AVX2 kernels match the exact sum, nothing wraps.
#[cfg(target_arch = "x86_64")]
#[test]
fn k_quant_extremes_stay_in_range() {
    if !crate::kernels::matmul::avx2::available() {
        return;
    }
    for (dtype, top) in [(GgmlType::Q4K, 15.0), (GgmlType::Q5K, 31.0)] {
        for x in [1.0f32, -1.0] {
            // All bits set: every value `top`, every 6-bit scale and min 63; then
            // d = 0.5 and dmin = 0, so the sum is exact in f32.
            let mut block = vec![0xFFu8; dtype.block().1];
            block[..2].copy_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
            block[2..4].fill(0);
            let (data, xq, got) = one_block_avx2(dtype, &block, x);
            let want = 0.5 * 63.0 * top * x * 256.0;
            assert!(got.iter().flatten().all(|&v| v == want), "{dtype:?} {x}: {:?} vs {want}", got[0]);
            // The paired VNNI kernels: Q4_K's from the records (its sums run 16 times the
            // value), Q5_K's from decoded values.
            if avx2::vnni() {
                let mut vals = vec![0u8; DECODED];
                decode(dtype, &data, 1, &mut vals);
                let src = if dtype == GgmlType::Q5K {
                    avx2::Src { rec: data.as_ptr(), vals: vals.as_ptr() }
                } else {
                    records(&data)
                };
                let mut paired = [[[0f32; GROUP]; TILE]; 2];
                // SAFETY: VNNI is present; `data` is one group's records (and `vals` their
                // values), paired with itself.
                unsafe { avx2::pair(true, dtype, [src; 2], &xq, 0, TILE, 1, &mut paired, avx2::Ahead::NONE) };
                assert!(paired.iter().flatten().flatten().all(|&v| v == want), "paired {x}: {:?}", paired[0][0]);
            }
        }
    }
}

/// The nibble formats' 16-bit sums at their extremes (every value at its largest, with
/// Q5's fifth bits; every activation ±127): the AVX2 kernels, and the VNNI ones where
/// the CPU has them, match the exact sum, nothing wraps.
#[cfg(target_arch = "x86_64")]
#[test]
fn nibble_extremes_stay_in_range() {
    if !crate::kernels::matmul::avx2::available() {
        return;
    }
    let k = 256;
    for (dtype, top) in [(GgmlType::Q4_0, 7.0), (GgmlType::Q4_1, 15.0), (GgmlType::Q5_0, 15.0), (GgmlType::Q5_1, 31.0)]
    {
        // All bits set, then d = 0.5 and (Q4_1, Q5_1) m = 0.
        let mut block = vec![0xFFu8; dtype.block().1];
        block[..2].copy_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
        if matches!(dtype, GgmlType::Q4_1 | GgmlType::Q5_1) {
            block[2..4].fill(0);
        }
        let data = interleave(dtype, &block.repeat(GROUP * k / 32), k);
        for x in [1.0f32, -1.0] {
            let mut xq = QActs::default();
            quantize_rows(&vec![x; TILE * k], TILE, k, act_scales(dtype), &mut xq);
            let want = 0.5 * top * x * k as f32;
            for vnni in [false, avx2::vnni()] {
                let mut got = [[0f32; GROUP]; TILE];
                // SAFETY: AVX2 is present, and VNNI when asked for; `data` is one group.
                unsafe { avx2::group(vnni, dtype, records(&data), &xq, 0, TILE, k / 32, &mut got) };
                let near = |v: f32| (v - want).abs() <= 1e-5 * want.abs();
                assert!(got.iter().flatten().all(|&v| near(v)), "{dtype:?} {x} vnni {vnni}: {:?}", got[0]);
            }
        }
    }
}

/// The ternary formats' sums at their extremes (every weight +1 or every −1, every
/// activation ±127): the AVX2 kernels and the VNNI ones (TQ2_0's top field is 128 times
/// its code), from the records and from TQ1_0's decoded codes, match the exact sum at
/// every tile height.
#[cfg(target_arch = "x86_64")]
#[test]
fn ternary_extremes_stay_in_range() {
    if !crate::kernels::matmul::avx2::available() {
        return;
    }
    let k = 512;
    let half = half::f16::from_f32(0.5);
    let forms =
        [GgmlType::Tq2_0, GgmlType::Tq1_0].into_iter().flat_map(|dtype| [(dtype, 2u8, 1.0f32), (dtype, 0, -1.0)]);
    for (dtype, code, t) in forms {
        let block = match dtype {
            GgmlType::Tq2_0 => crate::kernels::ternary::tq2_0_block(&[code; 256], half).to_vec(),
            _ => crate::kernels::ternary::tq1_0_block(&[code; 256], half).to_vec(),
        };
        let data = interleave(dtype, &block.repeat(GROUP * k / 256), k);
        let mut vals = vec![0u8; k / 256 * decoded_bytes(dtype)];
        let mut srcs = vec![records(&data)];
        if decodable(dtype) {
            decode(dtype, &data, k / 256, &mut vals);
            srcs.push(avx2::Src { rec: data.as_ptr(), vals: vals.as_ptr() });
        }
        for (x, src) in [1.0f32, -1.0].into_iter().flat_map(|x| srcs.iter().map(move |s| (x, *s))) {
            let mut xq = QActs::default();
            quantize_rows(&vec![x; TILE * k], TILE, k, act_scales(dtype), &mut xq);
            let want = 0.5 * t * x * k as f32;
            for (vnni, tile) in [false, avx2::vnni()].into_iter().flat_map(|v| (1..=TILE).map(move |t| (v, t))) {
                let mut got = [[0f32; GROUP]; TILE];
                // SAFETY: AVX2 is present, and VNNI when asked for; `data` is one group.
                unsafe { avx2::group(vnni, dtype, src, &xq, 0, tile, k / 256, &mut got) };
                let near = |v: f32| (v - want).abs() <= 1e-5 * want.abs();
                assert!(
                    got[..tile].iter().flatten().all(|&v| near(v)),
                    "{dtype} {t} · {x}, vnni {vnni}, tile {tile}, decoded {}: {:?}",
                    !src.vals.is_null(),
                    got[0]
                );
            }
        }
    }
}

/// TQ1_0 computes exactly what the same codes give as TQ2_0, on every instruction set and
/// tile height, from its records and from its codes decoded ahead.
#[cfg(target_arch = "x86_64")]
#[test]
fn tq1_0_computes_what_tq2_0_does() {
    use crate::kernels::ternary::tq1_0_block;
    if !crate::kernels::matmul::avx2::available() {
        return;
    }
    let k = 3 * 256;
    let blocks = k / 256;
    let noise = random_vec(GROUP * k, 41);
    let (mut one, mut two) = (Vec::new(), Vec::new());
    for (i, codes) in noise.chunks_exact(256).enumerate() {
        let codes: [u8; 256] = std::array::from_fn(|j| ((codes[j] + 1.0) * 1.5).min(2.0) as u8);
        let d = half::f16::from_f32(0.01 + 0.002 * (i % 5) as f32);
        one.extend(tq1_0_block(&codes, d));
        two.extend(tq2_0_block(&codes, d));
    }
    let (one, two) = (interleave(GgmlType::Tq1_0, &one, k), interleave(GgmlType::Tq2_0, &two, k));
    let mut xq = QActs::default();
    quantize_rows(&random_vec(TILE * k, 42), TILE, k, act_scales(GgmlType::Tq1_0), &mut xq);
    let mut vals = vec![0u8; blocks * decoded_bytes(GgmlType::Tq1_0)];
    decode(GgmlType::Tq1_0, &one, blocks, &mut vals);
    let decoded = avx2::Src { rec: one.as_ptr(), vals: vals.as_ptr() };
    for vnni in [false, avx2::vnni()] {
        for tile in 1..=TILE {
            let mut want = [[0f32; GROUP]; TILE];
            // SAFETY: AVX2 is present, and VNNI when asked for; each is one group's records
            // (and the decoded codes of TQ1_0's).
            unsafe { avx2::group(vnni, GgmlType::Tq2_0, records(&two), &xq, 0, tile, blocks, &mut want) };
            for src in [records(&one), decoded] {
                let mut got = [[0f32; GROUP]; TILE];
                // SAFETY: as above.
                unsafe { avx2::group(vnni, GgmlType::Tq1_0, src, &xq, 0, tile, blocks, &mut got) };
                assert_eq!(got, want, "vnni {vnni}, tile {tile}, decoded {}", !src.vals.is_null());
            }
        }
    }
}

/// The portable fallback and the AVX2 kernels agree on every format and tile height.
#[cfg(target_arch = "x86_64")]
#[test]
fn portable_matches_avx2() {
    each_format_on_avx2(2, 31, |dtype, k, blocks, data, xq| {
        for tile in 1..=TILE {
            let (mut a, mut b) = ([[0f32; GROUP]; TILE], [[0f32; GROUP]; TILE]);
            portable_group(dtype, data, xq, 0, tile, k, &mut a);
            // SAFETY: AVX2 is present (checked by the helper); `data` is one group's records.
            unsafe { avx2::group(avx2::vnni(), dtype, records(data), xq, 0, tile, blocks, &mut b) };
            for (ra, rb) in a.iter().zip(&b).take(tile) {
                for (va, vb) in ra.iter().zip(rb) {
                    assert!((va - vb).abs() <= 1e-4 * (1.0 + va.abs()), "{dtype:?} tile {tile}: {va} vs {vb}");
                }
            }
        }
    });
}

/// A row's result does not depend on its tile: every format's kernel gives each row of
/// a full tile exactly what it gives that row alone (batch invariance).
#[cfg(target_arch = "x86_64")]
#[test]
fn rows_are_tile_invariant() {
    each_format_on_avx2(3, 51, |dtype, _, blocks, data, xq| {
        let mut tiled = [[0f32; GROUP]; TILE];
        // SAFETY: AVX2 is present (checked by the helper); `data` is one group's records.
        unsafe { avx2::group(avx2::vnni(), dtype, records(data), xq, 0, TILE, blocks, &mut tiled) };
        for (t, want) in tiled.iter().enumerate() {
            let mut alone = [[0f32; GROUP]; TILE];
            // SAFETY: as above.
            unsafe { avx2::group(avx2::vnni(), dtype, records(data), xq, t, 1, blocks, &mut alone) };
            assert_eq!(alone[0], *want, "{dtype:?} row {t}");
        }
    });
}

/// Values decoded ahead give every kernel that reads them (the K-quants', TQ1_0's, the
/// lookup formats'), at every tile height, the very results it computes from the records,
/// and the decoded bytes are the file's values.
#[cfg(target_arch = "x86_64")]
#[test]
fn decoded_values_change_nothing() {
    each_format_on_avx2(3, 71, |dtype, k, blocks, data, xq| {
        if !decodable(dtype) {
            return;
        }
        let mut vals = vec![0u8; blocks * decoded_bytes(dtype)];
        decode(dtype, data, blocks, &mut vals);
        for tile in 1..=TILE {
            let (mut want, mut got) = ([[0f32; GROUP]; TILE], [[0f32; GROUP]; TILE]);
            let src = avx2::Src { rec: data.as_ptr(), vals: vals.as_ptr() };
            // SAFETY: AVX2 is present (checked by the helper); `data` is one group's
            // records and `vals` their decoded values.
            unsafe {
                avx2::group(avx2::vnni(), dtype, records(data), xq, 0, tile, blocks, &mut want);
                avx2::group(avx2::vnni(), dtype, src, xq, 0, tile, blocks, &mut got);
            }
            assert_eq!(got, want, "{dtype:?} tile {tile}");
        }
        let raw: Vec<Vec<u8>> = (0..GROUP).map(|r| raw_row(dtype, data, r, k)).collect();
        if dtype == GgmlType::Tq1_0 {
            // The codes of TQ2_0 records of the same weights.
            let two: Vec<u8> = raw
                .iter()
                .flat_map(|row| row.chunks_exact(dtype.block().1))
                .flat_map(|b| tq2_0_block(&tq1_0_codes(b), half::f16::from_le_bytes([b[52], b[53]])))
                .collect();
            let (row_bytes, (rec_bytes, head)) = (two.len() / GROUP, record(GgmlType::Tq2_0));
            let two = interleave(GgmlType::Tq2_0, &two, row_bytes / TQ2_0_BYTES * 256);
            for (b, vals) in vals.chunks_exact(decoded_bytes(dtype)).enumerate() {
                assert_eq!(vals, &two[b * rec_bytes + head..(b + 1) * rec_bytes], "TQ1_0 block {b}");
            }
            return;
        }
        if lookup(dtype) {
            // Per 32 values, the low nibbles' four chunks, then the high ones', each byte
            // the looked-up value plus 128.
            let table = table(dtype);
            let (values, bytes) = dtype.block();
            for (at, &v) in vals.iter().enumerate() {
                let (run, h, c, r, i) = (at / 256, at % 256 / 128, at % 128 / 32, at % 32 / 4, at % 4);
                let (b, sub) = (run * QB / values, run % (values / QB));
                let qs = if dtype == GgmlType::Mxfp4 { 1 } else { iq4_indices_at(dtype, sub) };
                let q = raw[r][b * bytes + qs + 4 * c + i] >> (4 * h) & 0xF;
                assert_eq!(v, (table[q as usize] as u8) ^ 0x80, "{dtype:?} byte {at}");
            }
            return;
        }
        // Each decoded byte is a row's value with its format's offset left in (the
        // nibble, the 6-bit value before Q6_K's −32, and Q3_K's and Q2_K's as Q6_K's).
        let value = |r: usize, j: usize| -> u8 {
            let blk = &raw[r][j / 256 * dtype.block().1..];
            let (sub, i) = (j % 256 / 32, j % 32);
            match dtype {
                GgmlType::Q4K => (blk[16 + sub / 2 * 32 + i] >> (4 * (sub % 2))) & 0xF,
                GgmlType::Q5K => {
                    let low = (blk[48 + sub / 2 * 32 + i] >> (4 * (sub % 2))) & 0xF;
                    low | ((blk[16 + i] >> sub) & 1) << 4
                }
                // Value `q − 4` as `q + 28`, `q` as `q + 32` (runs as Q6_K's outputs).
                GgmlType::Q3K => {
                    let low = (blk[32 + sub / 4 * 32 + i] >> (2 * (sub % 4))) & 3;
                    28 + (low | ((blk[i] >> sub) & 1) << 2)
                }
                GgmlType::Q2K => 32 + ((blk[16 + sub / 4 * 32 + i] >> (2 * (sub % 4))) & 3),
                _ => {
                    let (n, l) = (j % 256 / 128, j % 128);
                    let (ql, qh) = (&blk[64 * n..], &blk[128 + 32 * n..]);
                    let low = if l < 64 { ql[l] & 0xF } else { ql[l - 64] >> 4 };
                    low | ((qh[l % 32] >> (2 * (l / 32))) & 3) << 4
                }
            }
        };
        for (at, &v) in vals.iter().enumerate() {
            // Block, then 32-value run (sub-block or output), then chunk, row, value.
            let (b, run, c, r, i) = (at / DECODED, at % DECODED / 256, at % 256 / 32, at % 32 / 4, at % 4);
            assert_eq!(v, value(r, 256 * b + 32 * run + 4 * c + i), "{dtype:?} byte {at}");
        }
    });
}

/// Two groups side by side give each group, at every tile height, the very results
/// it gets alone (the paired kernels, the assembly sums among them, change nothing).
#[cfg(target_arch = "x86_64")]
#[test]
fn pairs_change_nothing() {
    if !crate::kernels::matmul::avx2::available() {
        return;
    }
    for dtype in BLOCK_FORMATS.into_iter().filter(|&d| pairs(d)) {
        let (k, rows) = (3 * 256, 2 * GROUP);
        let blocks = k / dtype.block().0;
        let data = interleave(dtype, &random_blocks(dtype, rows * blocks, 81), k);
        let (a, b) = data.split_at(data.len() / 2);
        let mut xq = QActs::default();
        quantize_rows(&random_vec(TILE * k, 82), TILE, k, act_scales(dtype), &mut xq);
        // Alone from decoded values where the format has them (else from the records);
        // paired as the step runs them: from decoded values, or with VNNI (Q4_K, Q8_0,
        // TQ2_0) from the records.
        let vals: Vec<Option<Vec<u8>>> = [a, b]
            .iter()
            .map(|d| {
                decodable(dtype).then(|| {
                    let mut v = vec![0u8; blocks * decoded_bytes(dtype)];
                    decode(dtype, d, blocks, &mut v);
                    v
                })
            })
            .collect();
        let mut side_by_side = vec![0u8; 2 * blocks * decoded_bytes(dtype)];
        if decodes_in_pairs(dtype) {
            decode_pair(dtype, [a, b], blocks, &mut side_by_side);
        }
        let paired_vals = match (decodes(dtype), decodes_in_pairs(dtype)) {
            (true, true) => [Some(&side_by_side[..]); 2],
            (true, false) => [vals[0].as_deref(), vals[1].as_deref()],
            _ => [None, None],
        };
        // The lookup formats pair from their records too, below `decode_from` rows.
        let ways = if lookup(dtype) { vec![paired_vals, [None, None]] } else { vec![paired_vals] };
        for (paired_vals, tile) in ways.iter().flat_map(|&v| (1..=TILE).map(move |t| (v, t))) {
            let mut paired = [[[0f32; GROUP]; TILE]; 2];
            pair(dtype, [a, b], paired_vals, &xq, 0, tile, k, &mut paired, &[]);
            for (g, d) in [a, b].into_iter().enumerate() {
                let mut alone = [[0f32; GROUP]; TILE];
                group(dtype, d, vals[g].as_deref(), &xq, 0, tile, k, &mut alone);
                assert_eq!(paired[g][..tile], alone[..tile], "{dtype:?} tile {tile} group {g}");
            }
        }
    }
}

/// Four groups run together give each group's results alone, bit for bit, at every
/// tile height, for the formats that run in [`quads`] (none without VNNI): Q4_K's from
/// its records, the Q6_K family's from each pair's values side by side, the lookup
/// formats' both ways.
#[test]
fn quads_change_nothing() {
    for dtype in BLOCK_FORMATS.into_iter().filter(|&d| quads(d)) {
        let (k, rows) = (3 * 256, 4 * GROUP);
        let blocks = k / dtype.block().0;
        let data = interleave(dtype, &random_blocks(dtype, rows * blocks, 85), k);
        let groups: Vec<&[u8]> = data.chunks_exact(data.len() / 4).collect();
        let mut xq = QActs::default();
        quantize_rows(&random_vec(TILE * k, 86), TILE, k, act_scales(dtype), &mut xq);
        let decoded = blocks * decoded_bytes(dtype);
        let mut side_by_side = vec![0u8; 4 * decoded];
        let (first, second) = side_by_side.split_at_mut(2 * decoded);
        if decodes_in_pairs(dtype) {
            decode_pair(dtype, [groups[0], groups[1]], blocks, first);
            decode_pair(dtype, [groups[2], groups[3]], blocks, second);
        }
        let (first, second) = side_by_side.split_at(2 * decoded);
        let both_ways = if lookup(dtype) { &[true, false][..] } else { &[decodes_in_pairs(dtype)] };
        for (&pre, tile) in both_ways.iter().flat_map(|p| (1..=TILE).map(move |t| (p, t))) {
            let [a, b] = [first, second].map(|v| pre.then_some(v));
            let mut four = [[[0f32; GROUP]; TILE]; 4];
            let data = [groups[0], groups[1], groups[2], groups[3]];
            quad(dtype, data, [a, a, b, b], &xq, 0, tile, k, &mut four, &[]);
            for (g, d) in groups.iter().enumerate() {
                let mut vals = vec![0u8; decoded];
                if decodes(dtype) {
                    decode(dtype, d, blocks, &mut vals);
                }
                let mut alone = [[0f32; GROUP]; TILE];
                group(dtype, d, decodes(dtype).then_some(&vals), &xq, 0, tile, k, &mut alone);
                assert_eq!(four[g][..tile], alone[..tile], "{dtype:?} tile {tile} group {g} decoded {pre}");
            }
        }
    }
}

/// Where the CPU has AVX-512 VNNI, its copies of the kernels give the AVX2 ones'
/// results bit for bit (the same integers, then the same float operations in the same
/// order): every format and tile height, from records and from decoded values, alone
/// and paired.
#[cfg(target_arch = "x86_64")]
#[test]
fn vnni_matches_avx2_bit_for_bit() {
    if !avx2::vnni() {
        return;
    }
    each_format_on_avx2(3, 91, |dtype, _, blocks, data, xq| {
        let mut vals = vec![0u8; blocks * decoded_bytes(dtype)];
        let mut srcs = vec![records(data)];
        if decodable(dtype) {
            decode(dtype, data, blocks, &mut vals);
            srcs.push(avx2::Src { rec: data.as_ptr(), vals: vals.as_ptr() });
        }
        for (tile, src) in (1..=TILE).flat_map(|t| srcs.iter().map(move |s| (t, *s))) {
            let (mut avx2, mut vnni) = ([[0f32; GROUP]; TILE], [[0f32; GROUP]; TILE]);
            // SAFETY: VNNI (and so AVX2) is present; `src` is one group's records and,
            // where not null, their decoded values.
            unsafe {
                avx2::group(false, dtype, src, xq, 0, tile, blocks, &mut avx2);
                avx2::group(true, dtype, src, xq, 0, tile, blocks, &mut vnni);
            }
            assert_eq!(avx2, vnni, "{dtype:?} tile {tile}, decoded {}", !src.vals.is_null());
        }
    });
    for dtype in BLOCK_FORMATS.into_iter().filter(|&d| pairs(d)) {
        let k = 3 * 256;
        let blocks = k / dtype.block().0;
        let data = interleave(dtype, &random_blocks(dtype, 2 * GROUP * blocks, 93), k);
        let mut xq = QActs::default();
        quantize_rows(&random_vec(TILE * k, 94), TILE, k, act_scales(dtype), &mut xq);
        let (a, b) = data.split_at(data.len() / 2);
        if !k_quant(dtype) {
            // The formats scaled per 32 values and the ternary ones pair with VNNI only: against the
            // AVX2 kernel alone (TQ1_0 from its codes decoded ahead, as the step runs it,
            // and the lookup formats from their values, side by side where paired).
            let decoded: Vec<Vec<u8>> = [a, b]
                .iter()
                .map(|d| {
                    let mut v = vec![0u8; blocks * decoded_bytes(dtype)];
                    if decodes(dtype) {
                        decode(dtype, d, blocks, &mut v);
                    }
                    v
                })
                .collect();
            let src = |g: usize| avx2::Src {
                rec: [a, b][g].as_ptr(),
                vals: if decodes(dtype) { decoded[g].as_ptr() } else { std::ptr::null() },
            };
            let mut side_by_side = vec![0u8; 2 * blocks * decoded_bytes(dtype)];
            let paired = if decodes_in_pairs(dtype) {
                decode_pair(dtype, [a, b], blocks, &mut side_by_side);
                [a, b].map(|d| avx2::Src { rec: d.as_ptr(), vals: side_by_side.as_ptr() })
            } else {
                [src(0), src(1)]
            };
            for tile in 1..=TILE {
                let mut vnni = [[[0f32; GROUP]; TILE]; 2];
                // SAFETY: as above, for two groups' records (and decoded values).
                unsafe { avx2::pair(true, dtype, paired, &xq, 0, tile, blocks, &mut vnni, avx2::Ahead::NONE) };
                for (g, vnni) in vnni.iter().enumerate() {
                    let mut avx2 = [[0f32; GROUP]; TILE];
                    // SAFETY: as above, one group's records (and decoded values).
                    unsafe { avx2::group(false, dtype, src(g), &xq, 0, tile, blocks, &mut avx2) };
                    assert_eq!(&avx2, vnni, "{dtype:?} paired, tile {tile}, group {g}");
                }
            }
            continue;
        }
        let mut vals = vec![0u8; 2 * blocks * DECODED];
        let (va, vb) = vals.split_at_mut(blocks * DECODED);
        decode(dtype, a, blocks, va);
        decode(dtype, b, blocks, vb);
        let src = [avx2::Src { rec: a.as_ptr(), vals: va.as_ptr() }, avx2::Src { rec: b.as_ptr(), vals: vb.as_ptr() }];
        // VNNI reads Q4_K's records, not decoded values ([`decodes`]), and the Q6_K
        // family's values side by side ([`decodes_in_pairs`]).
        let mut side_by_side = vec![0u8; 2 * blocks * decoded_bytes(dtype)];
        let vnni_src = if decodes_in_pairs(dtype) {
            decode_pair(dtype, [a, b], blocks, &mut side_by_side);
            [a, b].map(|d| avx2::Src { rec: d.as_ptr(), vals: side_by_side.as_ptr() })
        } else if decodes(dtype) {
            src
        } else {
            [records(a), records(b)]
        };
        for tile in 1..=TILE {
            let (mut avx2, mut vnni) = ([[[0f32; GROUP]; TILE]; 2], [[[0f32; GROUP]; TILE]; 2]);
            // SAFETY: as above, for two groups with their values decoded (or not, where
            // VNNI reads the records).
            unsafe {
                avx2::pair(false, dtype, src, &xq, 0, tile, blocks, &mut avx2, avx2::Ahead::NONE);
                avx2::pair(true, dtype, vnni_src, &xq, 0, tile, blocks, &mut vnni, avx2::Ahead::NONE);
            }
            assert_eq!(avx2, vnni, "{dtype:?} paired, tile {tile}");
        }
    }
}

/// A pair's values decoded side by side are each group's decoded values, chunk by chunk.
#[cfg(target_arch = "x86_64")]
#[test]
fn pairs_decode_side_by_side() {
    for dtype in BLOCK_FORMATS.into_iter().filter(|&d| decodes_in_pairs(d)) {
        let k = 3 * 256;
        let blocks = k / dtype.block().0;
        let data = interleave(dtype, &random_blocks(dtype, 2 * GROUP * blocks, 97), k);
        let (a, b) = data.split_at(data.len() / 2);
        let mut both = vec![0u8; 2 * blocks * decoded_bytes(dtype)];
        decode_pair(dtype, [a, b], blocks, &mut both);
        for (g, d) in [a, b].into_iter().enumerate() {
            let mut alone = vec![0u8; blocks * decoded_bytes(dtype)];
            decode(dtype, d, blocks, &mut alone);
            let from_pair: Vec<u8> = both.chunks_exact(32).skip(g).step_by(2).flatten().copied().collect();
            assert_eq!(from_pair, alone, "{dtype:?} group {g}");
        }
    }
}

/// Repacking and reading a row back give the file's bytes, for every interleaved format.
#[test]
fn interleave_round_trips() {
    for dtype in BLOCK_FORMATS {
        let (per, bytes) = dtype.block();
        let k = 2 * per.max(64);
        let rows = 16;
        let raw = random_blocks(dtype, rows * k / per, 21);
        let packed = interleave(dtype, &raw, k);
        assert_eq!(packed.len(), rows * k / per * bytes / GROUP * record(dtype).0 / bytes);
        let row_bytes = k / per * bytes;
        for r in 0..rows {
            assert_eq!(raw_row(dtype, &packed, r, k), raw[r * row_bytes..(r + 1) * row_bytes], "{dtype:?} {r}");
        }
    }
}

/// Every block format has its record size checked at compile time.
#[test]
fn every_format_has_a_checked_record_size() {
    for dtype in BLOCK_FORMATS {
        assert!(super::layout::RECORD_BYTES.iter().any(|&(d, _)| d == dtype), "{dtype:?}");
    }
}
