//! f32 → GGML block formats: the inverse of [`super::quant::dequantize`], for `weft
//! quantize` and for quantizing float weights at load. Each format follows ggml's block
//! layout exactly; the choice of scales is this engine's own (legacy formats as ggml's
//! reference does, K-quants by a small search per sub-block for the scale and offset with
//! the least squared error, then the 6- or 8-bit sub-scales relative to the super-block's;
//! IQ4 by a search for the scale whose nearest table values fit best).

use super::quant::{iq4_indices_at, pack_iq4_xs_scales, GgmlType, IQ4_VALUES};
use half::f16;
use std::borrow::Cow;
use std::ops::Range;

/// The block formats this module writes.
pub const TARGETS: [GgmlType; 10] = [
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
    GgmlType::Iq4Nl,
    GgmlType::Iq4Xs,
];

/// A quantization target from its ggml name (`q8_0`, `q4_k`, ...), for the command line.
pub fn parse_target(s: &str) -> Result<GgmlType, String> {
    match s.parse::<GgmlType>()? {
        t if TARGETS.contains(&t) => Ok(t),
        t => Err(format!(
            "cannot quantize to {t:?} (supported: q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k, iq4_nl, iq4_xs)"
        )),
    }
}

/// Whether [`quantize`] writes `t`: a block format of [`TARGETS`], plain f32 / f16 / bf16,
/// or (for ternary weights, into files) TQ1_0 / TQ2_0.
pub fn writable(t: GgmlType) -> bool {
    TARGETS.contains(&t)
        || matches!(t, GgmlType::F16 | GgmlType::Bf16 | GgmlType::F32 | GgmlType::Tq1_0 | GgmlType::Tq2_0)
}

/// A file's matrix type for `weft quantize` (see [`writable`]).
pub fn parse_file_type(s: &str) -> Result<GgmlType, String> {
    match s.parse::<GgmlType>()? {
        t if writable(t) => Ok(t),
        t => Err(format!(
            "cannot write matrices as {t:?} (supported: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k, iq4_nl, iq4_xs, tq1_0, tq2_0)"
        )),
    }
}

/// The format a matrix gets when its rows are not whole blocks of `target`: for the
/// K-quants, a 32-value format of about the same size, as llama.cpp's quantizer picks.
pub fn fitting(target: GgmlType, k: usize) -> Option<GgmlType> {
    let fallback = match target {
        GgmlType::Q4K => GgmlType::Q5_0,
        GgmlType::Q5K => GgmlType::Q5_1,
        GgmlType::Q6K => GgmlType::Q8_0,
        GgmlType::Iq4Xs => GgmlType::Iq4Nl,
        other => other,
    };
    [target, fallback].into_iter().find(|t| k.is_multiple_of(t.block().0))
}

/// Quantizes `x` (whole blocks of `dtype`) into its raw bytes; f32, f16 and bf16 are plain
/// little-endian values.
pub fn quantize(dtype: GgmlType, x: &[f32]) -> Vec<u8> {
    match dtype {
        GgmlType::F32 => return x.iter().flat_map(|v| v.to_le_bytes()).collect(),
        GgmlType::F16 => return x.iter().flat_map(|&v| f16::from_f32(v).to_le_bytes()).collect(),
        GgmlType::Bf16 => return x.iter().flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect(),
        _ => {}
    }
    let (per, bytes) = dtype.block();
    assert!(x.len().is_multiple_of(per), "{} values are not whole {dtype:?} blocks", x.len());
    let mut out = vec![0u8; x.len() / per * bytes];
    for (x, b) in x.chunks_exact(per).zip(out.chunks_exact_mut(bytes)) {
        match dtype {
            GgmlType::Q8_0 => q8_0(x, b),
            GgmlType::Q4_0 => legacy(x, b, 4, false),
            GgmlType::Q4_1 => legacy(x, b, 4, true),
            GgmlType::Q5_0 => legacy(x, b, 5, false),
            GgmlType::Q5_1 => legacy(x, b, 5, true),
            GgmlType::Q4K => k_quant(x, b, false),
            GgmlType::Q5K => k_quant(x, b, true),
            GgmlType::Q6K => q6_k(x, b),
            GgmlType::Iq4Nl => iq4_nl(x, b),
            GgmlType::Iq4Xs => iq4_xs(x, b),
            GgmlType::Tq2_0 | GgmlType::Tq1_0 => b.copy_from_slice(&super::ternary::quantize(dtype, x)),
            other => panic!("quantizing to {other:?} is not supported"),
        }
    }
    out
}

/// The index of [`IQ4_VALUES`]' value nearest `v`, the lower one at a tie. A table of
/// half-unit buckets gives it at once: the table's midpoints are whole or half units, so
/// none falls inside a bucket, and only a bucket's left edge can be a tie.
fn iq4_index(v: f32) -> usize {
    let i = IQ4_BUCKETS[(2.0 * v + 256.0).clamp(0.0, 511.0) as usize] as usize;
    if i > 0 && v - IQ4_VALUES[i - 1] as f32 <= IQ4_VALUES[i] as f32 - v {
        i - 1
    } else {
        i
    }
}

/// [`iq4_index`]'s buckets: entry `b` is the nearest index inside `[(b − 256) / 2, (b − 255) / 2)`.
static IQ4_BUCKETS: [u8; 512] = {
    let mut out = [0u8; 512];
    let mut b = 0;
    while b < 512 {
        // Four times the bucket's middle, against four times each table value.
        let mid = 2 * (b as i32 - 256) + 1;
        let mut best = 0;
        let mut i = 1;
        while i < 16 {
            if (4 * IQ4_VALUES[i] as i32 - mid).abs() < (4 * IQ4_VALUES[best] as i32 - mid).abs() {
                best = i;
            }
            i += 1;
        }
        out[b] = best as u8;
        b += 1;
    }
    out
};

/// The scale of a run of 32 values on the IQ4 table with the least squared error weighted
/// by the values' squares (large weights matter most): for 30 grids that put the value of
/// largest magnitude at or near either end of the table (−127 or 113), the weighted
/// least-squares scale of that grid's nearest values; the best of them (the search ggml's
/// reference makes).
fn iq4_scale(x: &[f32]) -> f32 {
    let max = signed_max(x);
    if max == 0.0 {
        return 0.0;
    }
    let fit = |id: f32| {
        let (mut sqx, mut sq2) = (0f32, 0f32);
        for &v in x {
            let q = IQ4_VALUES[iq4_index(id * v)] as f32;
            sqx += v * v * q * v;
            sq2 += v * v * q * q;
        }
        (sqx, sq2)
    };
    let (mut best_d, mut best) = (max / IQ4_VALUES[0] as f32, f32::MIN);
    for (end, t) in [IQ4_VALUES[0], IQ4_VALUES[15]].into_iter().flat_map(|e| (-7..=7).map(move |t| (e, t))) {
        let (sqx, sq2) = fit((end as f32 + t as f32) / max);
        // The error is Σw·x² − sqx²/sq2 at the least-squares scale sqx/sq2.
        if sq2 > 0.0 && sqx * sqx / sq2 > best {
            (best_d, best) = (sqx / sq2, sqx * sqx / sq2);
        }
    }
    best_d
}

/// A run's 32 indices under scale `d`, packed two to a byte (value `j` in the low nibble
/// of byte `j`, value `j + 16` in its high nibble).
fn iq4_pack(x: &[f32], d: f32, qs: &mut [u8]) {
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    for (j, q) in qs.iter_mut().enumerate() {
        *q = iq4_index(id * x[j]) as u8 | (iq4_index(id * x[j + 16]) as u8) << 4;
    }
}

/// IQ4_NL: one f16 scale and 32 indices.
fn iq4_nl(x: &[f32], b: &mut [u8]) {
    let d = f16_round(iq4_scale(x));
    put_f16(b, 0, d);
    iq4_pack(x, d, &mut b[iq4_indices_at(GgmlType::Iq4Nl, 0)..][..16]);
}

/// IQ4_XS: each run's best scale, as a 6-bit multiple `ls − 32` of the super-block's f16
/// scale (the largest run scale maps to −32), then the runs' indices under the scales
/// they get.
fn iq4_xs(x: &[f32], b: &mut [u8]) {
    let scales: [f32; 8] = std::array::from_fn(|sub| iq4_scale(&x[32 * sub..32 * sub + 32]));
    let d = f16_round(signed_max(&scales) / -32.0);
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(b, 0, d);
    let l = scales.map(|s| ((s * id).round() as i32).clamp(-32, 31));
    b[2..8].copy_from_slice(&pack_iq4_xs_scales(l.map(|l| (l + 32) as u8)));
    for (sub, (x, l)) in x.chunks_exact(32).zip(l).enumerate() {
        let at = iq4_indices_at(GgmlType::Iq4Xs, sub);
        iq4_pack(x, d * l as f32, &mut b[at..at + 16]);
    }
}

/// `rows` rows of `k` values in `dtype`, quantized in parallel 64 rows at a time;
/// `values(r)` gives the f32 values of the rows in range `r` (borrowed, or widened from
/// another format just for them, so a large tensor is never widened whole).
pub fn quantize_matrix<'a>(
    dtype: GgmlType,
    k: usize,
    rows: usize,
    values: impl Fn(Range<usize>) -> Cow<'a, [f32]> + Sync,
) -> Vec<u8> {
    use rayon::prelude::*;
    const CHUNK: usize = 64;
    let row_bytes = k / dtype.block().0 * dtype.block().1;
    let mut out = vec![0u8; rows * row_bytes];
    out.par_chunks_mut(CHUNK * row_bytes).enumerate().for_each(|(i, o)| {
        let first = i * CHUNK;
        o.copy_from_slice(&quantize(dtype, &values(first..first + o.len() / row_bytes)));
    });
    out
}

fn put_f16(b: &mut [u8], at: usize, v: f32) {
    b[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
}

/// The value of largest magnitude, with its sign (0 for an empty slice).
fn signed_max(x: &[f32]) -> f32 {
    x.iter().fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a })
}

fn f16_round(v: f32) -> f32 {
    f16::from_f32(v).to_f32()
}

fn q8_0(x: &[f32], b: &mut [u8]) {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    put_f16(b, 0, d);
    for (q, v) in b[2..34].iter_mut().zip(x) {
        *q = (v * id).round() as i8 as u8;
    }
}

/// Q4_0/Q5_0 (`offset = false`: symmetric, the value of largest magnitude maps to −2^(bits−1))
/// and Q4_1/Q5_1 (`d = (max − min) / (2^bits − 1)`, `m = min`), as ggml's reference.
fn legacy(x: &[f32], b: &mut [u8], bits: u32, offset: bool) {
    let levels = (1u32 << bits) as f32;
    let (d, m) = if offset {
        let (lo, hi) = x.iter().fold((f32::MAX, f32::MIN), |(l, h), &v| (l.min(v), h.max(v)));
        ((hi - lo) / (levels - 1.0), lo)
    } else {
        let half = levels / 2.0;
        let d = signed_max(x) / -half;
        (d, -half * d)
    };
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let q: Vec<u8> = x.iter().map(|&v| (((v - m) * id + 0.5) as i32).clamp(0, levels as i32 - 1) as u8).collect();
    put_f16(b, 0, d);
    let mut at = 2;
    if offset {
        put_f16(b, 2, m);
        at = 4;
    }
    if bits == 5 {
        let qh = q.iter().enumerate().fold(0u32, |h, (j, &v)| h | (((v >> 4) as u32 & 1) << j));
        b[at..at + 4].copy_from_slice(&qh.to_le_bytes());
        at += 4;
    }
    for j in 0..16 {
        b[at + j] = (q[j] & 0xF) | ((q[j + 16] & 0xF) << 4);
    }
}

/// `x.round().clamp(0.0, max)` for an integer `max`, exactly, without `f32::round`, which is
/// a libm call without SSE4.1 (and this search rounds every value 22 times).
fn round_in(x: f32, max: f32) -> f32 {
    let x = x.clamp(0.0, max);
    let t = x as u32 as f32;
    if x - t >= 0.5 {
        t + 1.0
    } else {
        t
    }
}

/// The scale and offset of `x` on `levels` steps (`x ≈ s·q − m`, `q` in `0..levels`, `m ≥ 0`)
/// with the least error weighted by `w`. Candidates: the min–max fit, and for each of 21
/// rounding grids around it, the weighted least-squares `(s, m)` of that grid's levels
/// (the search llama.cpp's K-quant reference makes).
fn fit_min_max(x: &[f32], w: &[f32], levels: f32) -> (f32, f32) {
    let nmax = levels - 1.0;
    let lo = x.iter().fold(0f32, |a, &v| a.min(v));
    let hi = x.iter().fold(f32::MIN, |a, &v| a.max(v));
    if hi <= lo {
        return (0.0, -lo);
    }
    let err = |s: f32, m: f32| -> f32 {
        let inv = 1.0 / s;
        x.iter()
            .zip(w)
            .map(|(&v, &w)| {
                let q = round_in((v + m) * inv, nmax);
                w * (s * q - m - v).powi(2)
            })
            .sum()
    };
    let mut best = ((hi - lo) / nmax, -lo);
    let mut best_err = err(best.0, best.1);
    for step in 0..=20 {
        let iscale = (nmax - 1.0 + 0.1 * step as f32) / (hi - lo);
        let (mut sw, mut sl, mut sl2, mut sxl, mut sx) = (0f32, 0f32, 0f32, 0f32, 0f32);
        for (&v, &w) in x.iter().zip(w) {
            let l = round_in(iscale * (v - lo), nmax);
            (sw, sl, sl2, sxl, sx) = (sw + w, sl + w * l, sl2 + w * l * l, sxl + w * v * l, sx + w * v);
        }
        let det = sw * sl2 - sl * sl;
        if det <= 0.0 {
            continue;
        }
        // x ≈ s·l + b with b ≤ 0 (the offset is stored as m = −b ≥ 0).
        let (mut scale, mut b) = ((sw * sxl - sx * sl) / det, (sl2 * sx - sl * sxl) / det);
        if b > 0.0 {
            (scale, b) = (sxl / sl2, 0.0);
        }
        if scale > 0.0 && scale.is_finite() {
            let e = err(scale, -b);
            if e < best_err {
                (best, best_err) = ((scale, -b), e);
            }
        }
    }
    best
}

/// Q4_K / Q5_K: eight 32-value sub-blocks, each `d·sc · q − dmin·m` with 6-bit `sc` and `m`.
fn k_quant(x: &[f32], b: &mut [u8], five: bool) {
    let levels = if five { 32.0 } else { 16.0 };
    // Errors weigh more on larger values, relative to the super-block's RMS.
    let rms = (x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32).sqrt();
    let w: Vec<f32> = x.iter().map(|v| rms + v.abs()).collect();
    let fits: Vec<(f32, f32)> =
        x.chunks_exact(32).zip(w.chunks_exact(32)).map(|(s, w)| fit_min_max(s, w, levels)).collect();
    let max_s = fits.iter().fold(0f32, |a, f| a.max(f.0));
    let max_m = fits.iter().fold(0f32, |a, f| a.max(f.1));
    let d = f16_round(max_s / 63.0);
    let dmin = f16_round(max_m / 63.0);
    let q6 = |v: f32, unit: f32| if unit > 0.0 { (v / unit).round().clamp(0.0, 63.0) as u8 } else { 0 };
    let sc: Vec<u8> = fits.iter().map(|f| q6(f.0, d)).collect();
    let mn: Vec<u8> = fits.iter().map(|f| q6(f.1, dmin)).collect();
    put_f16(b, 0, d);
    put_f16(b, 2, dmin);
    for j in 0..4 {
        b[4 + j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        b[8 + j] = mn[j] | ((mn[j + 4] >> 4) << 6);
        b[12 + j] = (sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4);
    }
    let q: Vec<u8> = x
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            let (s, m) = (d * sc[i / 32] as f32, dmin * mn[i / 32] as f32);
            if s > 0.0 {
                ((v + m) / s).round().clamp(0.0, levels - 1.0) as u8
            } else {
                0
            }
        })
        .collect();
    let qs = if five { 48 } else { 16 };
    if five {
        b[16..48].fill(0);
        for (i, &v) in q.iter().enumerate() {
            b[16 + i % 32] |= ((v >> 4) & 1) << (i / 32);
        }
    }
    for pair in 0..4 {
        for l in 0..32 {
            let (lo, hi) = (q[pair * 64 + l], q[pair * 64 + 32 + l]);
            b[qs + pair * 32 + l] = (lo & 0xF) | ((hi & 0xF) << 4);
        }
    }
}

/// Q6_K: sixteen 16-value groups, `d·sc · (q − 32)` with signed 8-bit `sc`.
fn q6_k(x: &[f32], b: &mut [u8]) {
    // Each group's scale maps its value of largest magnitude to −32, as ggml's reference.
    let scales: Vec<f32> = x.chunks_exact(16).map(|g| signed_max(g) / -32.0).collect();
    let max = signed_max(&scales);
    let d = f16_round(max / -128.0);
    let sc: Vec<i8> =
        scales.iter().map(|&s| if d != 0.0 { (s / d).round().clamp(-128.0, 127.0) as i8 } else { 0 }).collect();
    let q: Vec<u8> = x
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            let s = d * sc[i / 16] as f32;
            if s != 0.0 {
                ((v / s).round() + 32.0).clamp(0.0, 63.0) as u8
            } else {
                32
            }
        })
        .collect();
    b[..192].fill(0);
    for n in 0..2 {
        for l in 0..32 {
            let at = |i: usize| q[n * 128 + l + 32 * i];
            let (q1, q2, q3, q4) = (at(0), at(1), at(2), at(3));
            b[n * 64 + l] = (q1 & 0xF) | ((q3 & 0xF) << 4);
            b[n * 64 + l + 32] = (q2 & 0xF) | ((q4 & 0xF) << 4);
            b[128 + n * 32 + l] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6);
        }
    }
    for (o, s) in b[192..208].iter_mut().zip(&sc) {
        *o = *s as u8;
    }
    put_f16(b, 208, d);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::quant::{dequantize, QK_K};
    use crate::kernels::testing::random_vec;

    /// Plain float types round-trip as their own rounding of each value.
    #[test]
    fn float_types_round_trip() {
        let x = random_vec(64, 3);
        assert_eq!(dequantize(GgmlType::F32, &quantize(GgmlType::F32, &x)), x);
        let f16s: Vec<f32> = x.iter().map(|&v| f16::from_f32(v).to_f32()).collect();
        assert_eq!(dequantize(GgmlType::F16, &quantize(GgmlType::F16, &x)), f16s);
        let bf16s: Vec<f32> = x.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
        assert_eq!(dequantize(GgmlType::Bf16, &quantize(GgmlType::Bf16, &x)), bf16s);
    }

    /// The bucket table finds the nearest table value, the lower at a tie, as a search does.
    #[test]
    fn iq4_index_is_the_nearest_value() {
        let steps = (0..60_000).map(|i| i as f32 * 0.005 - 150.0);
        let midpoints = IQ4_VALUES.windows(2).map(|w| (w[0] as f32 + w[1] as f32) / 2.0);
        for v in steps.chain(midpoints) {
            let dist = |i: usize| (v - IQ4_VALUES[i] as f32).abs();
            let want = (0..16).fold(0, |b, i| if dist(i) < dist(b) { i } else { b });
            assert_eq!(iq4_index(v), want, "{v}");
        }
    }

    #[test]
    fn round_in_is_round_then_clamp() {
        let edges = [-0.6f32, -0.5, -0.49999997, 0.0, 0.49999997, 0.5, 1.5, 2.4999998, 2.5, 14.5, 15.0, 15.5, 40.0];
        let steps = (0..20_000).map(|i| i as f32 * 0.00137 - 3.0);
        for x in edges.into_iter().chain(steps) {
            assert_eq!(round_in(x, 15.0), x.round().clamp(0.0, 15.0), "{x}");
        }
    }

    /// Relative RMS error of a round trip through each format, on values with outliers.
    #[test]
    fn round_trips_through_the_dequantizer() {
        let mut x = random_vec(4 * QK_K, 7);
        x[5] = 4.0;
        x[300] = -3.0;
        x[608..640].iter_mut().for_each(|v| *v = 0.0);
        let rms = |v: &[f32]| (v.iter().map(|a| a * a).sum::<f32>() / v.len() as f32).sqrt();
        for (dtype, bound) in [
            (GgmlType::Q8_0, 0.01),
            (GgmlType::Q4_0, 0.15),
            (GgmlType::Q4_1, 0.12),
            (GgmlType::Q5_0, 0.08),
            (GgmlType::Q5_1, 0.06),
            (GgmlType::Q4K, 0.12),
            (GgmlType::Q5K, 0.06),
            (GgmlType::Q6K, 0.04),
            (GgmlType::Iq4Nl, 0.1),
            (GgmlType::Iq4Xs, 0.1),
        ] {
            let raw = quantize(dtype, &x);
            assert_eq!(raw.len(), x.len() / dtype.block().0 * dtype.block().1);
            let back = dequantize(dtype, &raw);
            let err: Vec<f32> = back.iter().zip(&x).map(|(a, b)| a - b).collect();
            let rel = rms(&err) / rms(&x);
            assert!(rel < bound, "{dtype:?}: relative RMS error {rel}");
            // An all-zero block stays zero, with no NaN from a zero scale.
            assert!(back[608..640].iter().all(|v| *v == 0.0), "{dtype:?}: {:?}", &back[608..640]);
            // Quantizing the dequantized values again reproduces them (a fixed point).
            let again = dequantize(dtype, &quantize(dtype, &back));
            let drift = rms(&again.iter().zip(&back).map(|(a, b)| a - b).collect::<Vec<_>>()) / rms(&x);
            assert!(drift < bound / 2.0, "{dtype:?}: requantizing drifts by {drift}");
        }
    }
}
