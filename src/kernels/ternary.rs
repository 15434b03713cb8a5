//! Ternary weights (BitNet b1.58): values −1, 0 and +1 times a scale. llama.cpp's TQ2_0
//! and TQ1_0 are computed as stored; every other form a model arrives in (bitnet.cpp's
//! I2_S, Hugging Face's uint8 packing, or floats that happen to be ternary) becomes TQ2_0
//! blocks at load. The kernels compute codes `t + 1`, unsigned for `maddubs`/`vpdpbusd`,
//! with the activations' sum taken off the integer dot product.

use super::quant::{f16_at, i2s_bytes, i2s_codes, tq2_0_codes, GgmlType, I2S_GROUP, QK_K, TQ1_0_BYTES, TQ2_0_BYTES};
use half::f16;

/// A TQ2_0 block of `codes` under scale `d`.
pub fn tq2_0_block(codes: &[u8; QK_K], d: f16) -> [u8; TQ2_0_BYTES] {
    let mut b = [0u8; TQ2_0_BYTES];
    for (j, &c) in codes.iter().enumerate() {
        let (h, l, m) = (j / 128, j % 128 / 32, j % 32);
        b[32 * h + m] |= (c & 3) << (2 * l);
    }
    b[64..].copy_from_slice(&d.to_le_bytes());
    b
}

/// A TQ1_0 block of `codes` under scale `d`, packed as ggml packs it: five base-3 digits
/// a byte (the first the most significant), the byte `⌈q · 256 / 243⌉` so that
/// [`tq1_0_codes`] reads each digit back with a multiply and a shift.
pub fn tq1_0_block(codes: &[u8; QK_K], d: f16) -> [u8; TQ1_0_BYTES] {
    let pack = |digits: &mut dyn Iterator<Item = u8>, n: u32| -> u8 {
        let q = digits.fold(0u16, |q, c| q * 3 + c as u16) * 3u16.pow(5 - n);
        (q * 256).div_ceil(243) as u8
    };
    let mut b = [0u8; TQ1_0_BYTES];
    for m in 0..32 {
        b[m] = pack(&mut (0..5).map(|n| codes[n * 32 + m]), 5);
    }
    for m in 0..16 {
        b[32 + m] = pack(&mut (0..5).map(|n| codes[160 + n * 16 + m]), 5);
    }
    for j in 0..4 {
        b[48 + j] = pack(&mut (0..4).map(|n| codes[240 + n * 4 + j]), 4);
    }
    b[52..].copy_from_slice(&d.to_le_bytes());
    b
}

/// Checks a ternary tensor as a file holds it: every scale finite, every 2-bit code one
/// of −1, 0, +1 (the fourth, 3, means nothing), and the values whole blocks.
pub fn check(dtype: GgmlType, raw: &[u8], n: usize) -> Result<(), String> {
    let scale = |d: f32| if d.is_finite() { Ok(()) } else { Err(format!("its scale is {d}")) };
    let bad_code = |c: u8| c == 3;
    match dtype {
        GgmlType::I2s => {
            if !n.is_multiple_of(I2S_GROUP) || raw.len() != i2s_bytes(n) {
                return Err(format!("{n} values are not whole I2_S groups of {I2S_GROUP}"));
            }
            let (mut codes, d) = i2s_codes(raw);
            scale(d)?;
            match codes.position(bad_code) {
                Some(i) => Err(format!("value {i} has the code 3, which is not ternary")),
                None => Ok(()),
            }
        }
        GgmlType::Tq1_0 | GgmlType::Tq2_0 => {
            let (bytes, d_at) = if dtype == GgmlType::Tq1_0 { (TQ1_0_BYTES, 52) } else { (TQ2_0_BYTES, 64) };
            if !n.is_multiple_of(QK_K) || raw.len() != n / QK_K * bytes {
                return Err(format!("{n} values are not whole {dtype} blocks of {QK_K}"));
            }
            for (i, b) in raw.chunks_exact(bytes).enumerate() {
                scale(f16_at(b, d_at)).map_err(|e| format!("block {i}: {e}"))?;
                // TQ1_0's digits are in 0..3 by construction; a TQ2_0 byte holds a 3 where
                // both bits of a field are set (checked a byte at a time: this runs over
                // every weight at load).
                if dtype == GgmlType::Tq2_0 && b[..64].iter().any(|&c| c & (c >> 1) & 0x55 != 0) {
                    let j = tq2_0_codes(b).into_iter().position(bad_code).unwrap_or_default();
                    return Err(format!("block {i} value {j} has the code 3, which is not ternary"));
                }
            }
            Ok(())
        }
        other => Err(format!("{other} is not a ternary format")),
    }
}

/// An I2_S tensor of rows of `k` values that [`check`] passed, as TQ2_0 blocks (the
/// form the kernels compute); `None` if its rows are not whole TQ2_0 blocks, or its one
/// scale is not exact in f16 (then it is computed widened).
pub fn i2s_to_tq2_0(raw: &[u8], k: usize) -> Option<Vec<u8>> {
    if k == 0 || !k.is_multiple_of(QK_K) {
        return None;
    }
    let (codes, d) = i2s_codes(raw);
    let d = exact_f16(d)?;
    let codes: Vec<u8> = codes.collect();
    Some(codes.chunks_exact(QK_K).flat_map(|c| tq2_0_block(c.try_into().unwrap(), d)).collect())
}

/// `d` as an f16 when it is exactly one.
fn exact_f16(d: f32) -> Option<f16> {
    let h = f16::from_f32(d);
    (h.to_f32() == d).then_some(h)
}

/// The largest magnitude of `x`.
fn abs_max(x: &[f32]) -> f32 {
    x.iter().fold(0f32, |m, v| m.max(v.abs()))
}

/// A 256-value block's codes and scale `d`, if every value is `−d`, `0` or `+d` and `d`
/// is exact in f16.
fn ternary_block(blk: &[f32]) -> Option<([u8; QK_K], f16)> {
    let d = abs_max(blk);
    let h = exact_f16(d)?;
    let mut codes = [1u8; QK_K];
    for (c, &v) in codes.iter_mut().zip(blk) {
        *c = match v {
            _ if v == 0.0 => 1,
            _ if v == d => 2,
            _ if v == -d => 0,
            _ => return None,
        };
    }
    Some((codes, h))
}

/// Float values that are ternary (each 256-value block's values all `−d`, `0` or `+d`,
/// with `d` exact in f16) as TQ2_0 blocks; `None` if any block is not, or rows of `k`
/// values are not whole blocks.
pub fn from_floats(x: &[f32], k: usize) -> Option<Vec<u8>> {
    if k == 0 || !k.is_multiple_of(QK_K) || !x.len().is_multiple_of(k) {
        return None;
    }
    let mut out = Vec::with_capacity(x.len() / QK_K * TQ2_0_BYTES);
    for blk in x.chunks_exact(QK_K) {
        let (codes, d) = ternary_block(blk)?;
        out.extend_from_slice(&tq2_0_block(&codes, d));
    }
    Some(out)
}

/// Hugging Face's packing of a ternary `[rows, k]` matrix (transformers' `pack_weights`,
/// as BitNet b1.58 2B-4T is released): uint8 `[rows / 4, k]`, row `i · rows/4 + r` in bits
/// `2i` of packed row `r`, codes `t + 1`. Returns the codes `[rows, k]`, or why not.
pub fn unpack_hf(packed: &[u8], rows: usize, k: usize) -> Result<Vec<u8>, String> {
    if !rows.is_multiple_of(4) || packed.len() != rows / 4 * k {
        return Err(format!("{} packed bytes are not a [{}, {k}] matrix of four codes each", packed.len(), rows / 4));
    }
    let quarter = rows / 4;
    let mut codes = vec![0u8; rows * k];
    for (i, out) in codes.chunks_exact_mut(quarter * k).enumerate() {
        for (o, &p) in out.iter_mut().zip(packed) {
            *o = (p >> (2 * i)) & 3;
        }
    }
    match codes.iter().position(|&c| c == 3) {
        Some(at) => Err(format!("value {at} has the code 3, which is not ternary")),
        None => Ok(codes),
    }
}

/// Codes `[rows, k]` under one scale as TQ2_0 rows; `None` unless rows are whole blocks
/// and the scale is exact in f16.
pub fn codes_to_tq2_0(codes: &[u8], k: usize, scale: f32) -> Option<Vec<u8>> {
    let d = exact_f16(scale)?;
    (k > 0 && k.is_multiple_of(QK_K))
        .then(|| codes.chunks_exact(QK_K).flat_map(|c| tq2_0_block(c.try_into().unwrap(), d)).collect())
}

/// TQ2_0 (or TQ1_0) blocks of `x`, rounding each value to the nearest of `−d, 0, +d` with
/// `d` its block's largest magnitude (llama.cpp's `quantize_row_tq2_0_ref`): exact for
/// ternary weights, a coarse approximation of any others ([`not_ternary`] tells them apart).
pub fn quantize(dtype: GgmlType, x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / QK_K * dtype.block().1);
    for blk in x.chunks_exact(QK_K) {
        let d = abs_max(blk);
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        let codes = std::array::from_fn(|j| ((blk[j] * id).round() as i32 + 1).clamp(0, 2) as u8);
        match dtype {
            GgmlType::Tq1_0 => out.extend_from_slice(&tq1_0_block(&codes, f16::from_f32(d))),
            _ => out.extend_from_slice(&tq2_0_block(&codes, f16::from_f32(d))),
        }
    }
    out
}

/// Why `x` (rows of `k` values) would not survive TQ1_0 or TQ2_0 exactly, if it would not:
/// a 256-value block holding a value other than `−d`, `0`, `+d`, or a `d` f16 cannot hold.
pub fn not_ternary(x: &[f32], k: usize) -> Option<String> {
    if k == 0 || !k.is_multiple_of(QK_K) {
        return Some(format!("rows of {k} values are not whole blocks of {QK_K}"));
    }
    let (i, blk) = x.chunks_exact(QK_K).enumerate().find(|(_, b)| ternary_block(b).is_none())?;
    let d = abs_max(blk);
    Some(match blk.iter().find(|&&v| v != 0.0 && v.abs() != d) {
        Some(v) => format!("block {i} holds {v} beside ±{d}: the weights are not ternary"),
        None => format!("block {i}'s scale {d} is not exact in f16"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::quant::{dequantize, tq1_0_codes};

    fn codes(seed: usize, n: usize) -> Vec<u8> {
        (0..n).map(|i| ((i * 7 + seed * 13 + i / 5) % 3) as u8).collect()
    }

    #[test]
    fn tq2_0_blocks_round_trip_and_dequantize() {
        let c: [u8; QK_K] = codes(1, QK_K).try_into().unwrap();
        let b = tq2_0_block(&c, f16::from_f32(0.5));
        assert_eq!(tq2_0_codes(&b), c);
        let v = dequantize(GgmlType::Tq2_0, &b);
        assert!(v.iter().zip(&c).all(|(&v, &c)| v == (c as f32 - 1.0) * 0.5));
        assert_eq!(check(GgmlType::Tq2_0, &b, QK_K), Ok(()));
        let mut bad = b;
        bad[7] |= 3 << 4;
        assert!(check(GgmlType::Tq2_0, &bad, QK_K).unwrap_err().contains("code 3"));
        let mut nan = b;
        nan[64..].copy_from_slice(&f16::NAN.to_le_bytes());
        assert!(check(GgmlType::Tq2_0, &nan, QK_K).unwrap_err().contains("scale"));
        assert!(check(GgmlType::Tq2_0, &b, 128).is_err(), "a ragged block");
    }

    /// TQ1_0's digits packed as ggml packs them (five per byte, scaled to fill it) read
    /// back, every combination of five digits included, and turned into the same TQ2_0
    /// values.
    #[test]
    fn tq1_0_reads_what_it_packs() {
        for seed in 0..243 {
            let c: [u8; QK_K] = std::array::from_fn(|i| {
                if i < 160 {
                    (seed / 3usize.pow((i / 32) as u32) % 3) as u8
                } else {
                    ((i * 5 + seed) % 3) as u8
                }
            });
            let b = tq1_0_block(&c, f16::from_f32(0.25));
            assert_eq!(tq1_0_codes(&b), c, "digits {seed}");
        }
        let c: [u8; QK_K] = codes(2, QK_K).try_into().unwrap();
        let b = tq1_0_block(&c, f16::from_f32(0.25));
        let as_tq2 = tq2_0_block(&c, f16::from_f32(0.25));
        assert_eq!(dequantize(GgmlType::Tq2_0, &as_tq2), dequantize(GgmlType::Tq1_0, &b));
        let x = dequantize(GgmlType::Tq1_0, &b);
        assert_eq!(quantize(GgmlType::Tq1_0, &x), b.to_vec());
    }

    #[test]
    fn i2s_groups_and_trailer() {
        let n = 2 * QK_K;
        let c = codes(3, n);
        let mut raw = vec![0u8; i2s_bytes(n)];
        for (i, &v) in c.iter().enumerate() {
            let (g, j) = (i / I2S_GROUP, i % I2S_GROUP);
            raw[g * 32 + j % 32] |= v << (6 - 2 * (j / 32));
        }
        raw[n / 4..n / 4 + 4].copy_from_slice(&0.375f32.to_le_bytes());
        let v = dequantize(GgmlType::I2s, &raw);
        assert!(v.iter().zip(&c).all(|(&v, &c)| v == (c as f32 - 1.0) * 0.375));
        let tq = i2s_to_tq2_0(&raw, QK_K).unwrap();
        assert_eq!(dequantize(GgmlType::Tq2_0, &tq), v);
        // A scale f16 cannot hold exactly: computed widened instead.
        raw[n / 4..n / 4 + 4].copy_from_slice(&0.1f32.to_le_bytes());
        assert_eq!(i2s_to_tq2_0(&raw, QK_K), None);
        raw[n / 4..n / 4 + 4].copy_from_slice(&f32::INFINITY.to_le_bytes());
        assert!(check(GgmlType::I2s, &raw, n).is_err());
        raw[n / 4..n / 4 + 4].copy_from_slice(&0.375f32.to_le_bytes());
        raw[5] = 0xFF;
        assert!(check(GgmlType::I2s, &raw, n).unwrap_err().contains("code 3"));
    }

    #[test]
    fn floats_and_hf_packing() {
        let (rows, k) = (8, QK_K);
        let c = codes(4, rows * k);
        let x: Vec<f32> = c.iter().map(|&c| (c as f32 - 1.0) * 0.125).collect();
        let tq = from_floats(&x, k).unwrap();
        assert_eq!(dequantize(GgmlType::Tq2_0, &tq), x);
        assert_eq!(quantize(GgmlType::Tq2_0, &x), tq);
        assert_eq!(not_ternary(&x, k), None);
        let mut y = x.clone();
        y[3] = 0.1;
        assert!(from_floats(&y, k).is_none(), "not ternary");
        assert!(not_ternary(&y, k).unwrap().contains("not ternary"));
        y[3] = 0.0;
        y.iter_mut().for_each(|v| *v *= 1.1);
        assert!(not_ternary(&y, k).unwrap().contains("not exact in f16"));
        let mut packed = vec![0u8; rows / 4 * k];
        for (r, row) in c.chunks_exact(k).enumerate() {
            for (col, &v) in row.iter().enumerate() {
                packed[(r % (rows / 4)) * k + col] |= v << (2 * (r / (rows / 4)));
            }
        }
        assert_eq!(unpack_hf(&packed, rows, k).unwrap(), c);
        assert_eq!(codes_to_tq2_0(&c, k, 0.125).unwrap(), tq);
        packed[0] |= 3;
        assert!(unpack_hf(&packed, rows, k).is_err());
    }
}
