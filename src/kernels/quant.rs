//! GGML block formats: their sizes and their exact dequantization to f32, with ggml's
//! reference arithmetic (`d * q`, then `- m` or `+ m`, in f32, never fused), so an f32 path
//! over a quantized file reproduces what transformers computes from the same file.

use half::{bf16, f16};

/// Super-block length of the K-quants.
pub const QK_K: usize = 256;

/// GGML tensor element types this engine reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Bf16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    /// 4-bit indices into [`IQ4_VALUES`], one scale per 32 values.
    Iq4Nl,
    /// [`GgmlType::Iq4Nl`]'s values in 256-value super-blocks, with a 6-bit scale per 32.
    Iq4Xs,
    /// Ternary, 2-bit codes `t + 1` and an f16 scale per 256 values ([`super::ternary`]).
    Tq2_0,
    /// Ternary in base 3, five values a byte (1.69 bits a value), an f16 scale per 256.
    Tq1_0,
    /// bitnet.cpp's ternary: 2-bit codes, one f32 scale after a tensor's codes. Read, and
    /// computed as [`GgmlType::Tq2_0`].
    I2s,
    /// OCP microscaling FP4 (gpt-oss's experts): an E8M0 power-of-two scale byte, then 32
    /// E2M1 values as 4-bit codes ([`MXFP4_VALUES`]). Computed in its format, not written.
    Mxfp4,
}

/// The block formats (quantized, computed with int8 activations), in a fixed order.
pub const BLOCK_FORMATS: [GgmlType; 15] = [
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
    GgmlType::Iq4Nl,
    GgmlType::Iq4Xs,
    GgmlType::Tq2_0,
    GgmlType::Mxfp4,
    GgmlType::Tq1_0,
];

/// The values that IQ4_NL's and IQ4_XS's 4-bit indices stand for (ggml's `kvalues_iq4nl`):
/// denser near zero, where most weights are.
pub const IQ4_VALUES: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// The values of MXFP4's E2M1 codes, doubled to integers (ggml's `kvalues_mxfp4`), so a
/// block's scale is its E8M0 power of two halved.
pub const MXFP4_VALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Bytes of an MXFP4 block: the E8M0 scale, then 16 bytes of codes (low nibbles the first
/// 16 values, high nibbles the next 16).
pub const MXFP4_BYTES: usize = 17;

/// Every type this engine reads: the floats, [`BLOCK_FORMATS`], then I2_S (converted to
/// [`GgmlType::Tq2_0`] at load).
pub const TYPES: [GgmlType; 4 + BLOCK_FORMATS.len()] = {
    let mut all = [GgmlType::F32; 4 + BLOCK_FORMATS.len()];
    (all[1], all[2]) = (GgmlType::F16, GgmlType::Bf16);
    let mut i = 0;
    while i < BLOCK_FORMATS.len() {
        all[3 + i] = BLOCK_FORMATS[i];
        i += 1;
    }
    all[3 + i] = GgmlType::I2s;
    all
};

impl GgmlType {
    /// (elements per block, bytes per block)
    pub fn block(self) -> (usize, usize) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::Bf16 => (1, 2),
            GgmlType::Q4_0 => (32, 18),
            GgmlType::Q4_1 => (32, 20),
            GgmlType::Q5_0 => (32, 22),
            GgmlType::Q5_1 => (32, 24),
            GgmlType::Q8_0 => (32, 34),
            GgmlType::Q2K => (QK_K, 84),
            GgmlType::Q3K => (QK_K, 110),
            GgmlType::Q4K => (QK_K, 144),
            GgmlType::Q5K => (QK_K, 176),
            GgmlType::Q6K => (QK_K, 210),
            GgmlType::Iq4Nl => (32, 18),
            GgmlType::Iq4Xs => (QK_K, 136),
            GgmlType::Tq2_0 => (QK_K, TQ2_0_BYTES),
            GgmlType::Tq1_0 => (QK_K, TQ1_0_BYTES),
            // Plus one trailer of a scale per tensor ([`i2s_bytes`]).
            GgmlType::I2s => (I2S_GROUP, 32),
            GgmlType::Mxfp4 => (32, MXFP4_BYTES),
        }
    }
}

/// ggml's name of the type: `Q8_0`, `Q4_K`, `BF16`, ...
impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GgmlType::Iq4Nl => f.write_str("IQ4_NL"),
            GgmlType::Iq4Xs => f.write_str("IQ4_XS"),
            GgmlType::Tq2_0 => f.write_str("TQ2_0"),
            GgmlType::Tq1_0 => f.write_str("TQ1_0"),
            GgmlType::I2s => f.write_str("I2_S"),
            GgmlType::Mxfp4 => f.write_str("MXFP4"),
            _ => f.write_str(&format!("{self:?}").replace('K', "_K").to_uppercase()),
        }
    }
}

impl std::str::FromStr for GgmlType {
    type Err = String;
    /// ggml's names, any case: `q8_0`, `Q4_K`, `f16`, ...
    fn from_str(s: &str) -> Result<Self, String> {
        TYPES
            .into_iter()
            .find(|t| t.to_string().eq_ignore_ascii_case(s))
            .ok_or_else(|| format!("unknown GGML type {s:?}"))
    }
}

/// The little-endian f16 at byte `i` of `b`.
pub(crate) fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Converts raw GGML data (whole blocks) to f32.
pub fn dequantize(dtype: GgmlType, raw: &[u8]) -> Vec<f32> {
    if matches!(dtype, GgmlType::Tq2_0 | GgmlType::Tq1_0 | GgmlType::I2s) {
        return dequantize_ternary(dtype, raw);
    }
    let (per_block, block_bytes) = dtype.block();
    let mut out = vec![0f32; raw.len() / block_bytes * per_block];
    let blocks = raw.chunks_exact(block_bytes).zip(out.chunks_exact_mut(per_block));
    match dtype {
        GgmlType::F32 => blocks.for_each(|(b, o)| o[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        GgmlType::F16 => blocks.for_each(|(b, o)| o[0] = f16_at(b, 0)),
        GgmlType::Bf16 => blocks.for_each(|(b, o)| o[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32()),
        GgmlType::Q8_0 => blocks.for_each(|(b, o)| {
            let d = f16_at(b, 0);
            o.iter_mut().zip(&b[2..]).for_each(|(y, &q)| *y = d * (q as i8) as f32);
        }),
        GgmlType::Q4_0 => blocks.for_each(|(b, o)| {
            let d = f16_at(b, 0);
            for (j, &q) in b[2..].iter().enumerate() {
                o[j] = d * ((q & 0x0F) as i32 - 8) as f32;
                o[j + 16] = d * ((q >> 4) as i32 - 8) as f32;
            }
        }),
        GgmlType::Q4_1 => blocks.for_each(|(b, o)| {
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            for (j, &q) in b[4..].iter().enumerate() {
                o[j] = d * (q & 0x0F) as f32 + m;
                o[j + 16] = d * (q >> 4) as f32 + m;
            }
        }),
        GgmlType::Q5_0 => blocks.for_each(|(b, o)| {
            let d = f16_at(b, 0);
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            for (j, &q) in b[6..].iter().enumerate() {
                let (lo, hi) = five_bit(q, qh, j);
                o[j] = d * (lo - 16) as f32;
                o[j + 16] = d * (hi - 16) as f32;
            }
        }),
        GgmlType::Q5_1 => blocks.for_each(|(b, o)| {
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
            for (j, &q) in b[8..].iter().enumerate() {
                let (lo, hi) = five_bit(q, qh, j);
                o[j] = d * lo as f32 + m;
                o[j + 16] = d * hi as f32 + m;
            }
        }),
        GgmlType::Q2K => blocks.for_each(|(b, o)| dequant_q2k(b, o)),
        GgmlType::Q3K => blocks.for_each(|(b, o)| dequant_q3k(b, o)),
        GgmlType::Q4K => blocks.for_each(|(b, o)| dequant_q45k(b, o, false)),
        GgmlType::Q5K => blocks.for_each(|(b, o)| dequant_q45k(b, o, true)),
        GgmlType::Q6K => blocks.for_each(|(b, o)| dequant_q6k(b, o)),
        GgmlType::Iq4Nl | GgmlType::Iq4Xs => blocks.for_each(|(b, o)| {
            for (sub, o) in o.chunks_exact_mut(32).enumerate() {
                iq4_run(iq4_run_scale(dtype, b, sub), &b[iq4_indices_at(dtype, sub)..][..16], o);
            }
        }),
        GgmlType::Mxfp4 => blocks.for_each(|(b, o)| {
            let d = e8m0_half(b[0]);
            for (j, &q) in b[1..].iter().enumerate() {
                o[j] = MXFP4_VALUES[(q & 15) as usize] as f32 * d;
                o[j + 16] = MXFP4_VALUES[(q >> 4) as usize] as f32 * d;
            }
        }),
        GgmlType::Tq2_0 | GgmlType::Tq1_0 | GgmlType::I2s => unreachable!("ternary formats returned above"),
    }
    out
}

/// Half of the E8M0 scale `e` (2^(e − 127)), exactly: 2^(e − 128), subnormal below e = 2.
/// (0xFF, E8M0's NaN, is refused at load: [`mxfp4_check`].)
pub fn e8m0_half(e: u8) -> f32 {
    f32::from_bits(if e < 2 { 0x0020_0000 << e } else { (e as u32 - 1) << 23 })
}

/// An MXFP4 tensor's scales checked: a byte of 0xFF is E8M0's NaN.
pub fn mxfp4_check(raw: &[u8]) -> Result<(), String> {
    match raw.chunks_exact(MXFP4_BYTES).position(|b| b[0] == 0xFF) {
        Some(i) => Err(format!("block {i} has the scale byte 0xFF (NaN in E8M0)")),
        None => Ok(()),
    }
}

/// Bytes of a TQ2_0 block: 64 bytes of 2-bit codes, then the f16 scale.
pub const TQ2_0_BYTES: usize = 66;
/// Bytes of a TQ1_0 block: 48 bytes of five base-3 digits, 4 of four, the f16 scale.
pub const TQ1_0_BYTES: usize = 54;
/// Values per I2_S group: 32 bytes, four 2-bit codes each.
pub const I2S_GROUP: usize = 128;
/// Bytes after an I2_S tensor's codes: its f32 scale, then 28 bytes of padding.
pub const I2S_TRAILER: usize = 32;

/// The 256 codes (`t + 1`) of a TQ2_0 block: value `128h + 32l + m` in bits `2l` of byte
/// `32h + m`.
pub fn tq2_0_codes(b: &[u8]) -> [u8; QK_K] {
    std::array::from_fn(|j| {
        let (h, l, m) = (j / 128, j % 128 / 32, j % 32);
        (b[32 * h + m] >> (2 * l)) & 3
    })
}

/// The 256 codes of a TQ1_0 block ([`tq1_0_code`]).
pub fn tq1_0_codes(b: &[u8]) -> [u8; QK_K] {
    std::array::from_fn(|v| tq1_0_code(b, v))
}

/// Value `v`'s code in a TQ1_0 block: bytes of base-3 digits scaled to fill a byte
/// (`digit n = (q · 3^n mod 256) · 3 >> 8`, as ggml packs them), the first 32 bytes
/// five digits each over 32-value runs, the next 16 over 16-value runs, and the four
/// `qh` bytes four digits each over 4-value runs.
pub fn tq1_0_code(b: &[u8], v: usize) -> u8 {
    const POW3: [u8; 5] = [1, 3, 9, 27, 81];
    let (byte, n) = match v {
        0..160 => (v % 32, v / 32),
        160..240 => (32 + (v - 160) % 16, (v - 160) / 16),
        _ => (48 + (v - 240) % 4, (v - 240) / 4),
    };
    ((b[byte].wrapping_mul(POW3[n]) as u16 * 3) >> 8) as u8
}

/// Bytes of an I2_S tensor of `n` values.
pub fn i2s_bytes(n: usize) -> usize {
    n / 4 + I2S_TRAILER
}

/// An I2_S tensor's codes (value `j` of a 128-value group in bits `6 − 2·(j / 32)` of
/// byte `j % 32`) and its one f32 scale.
pub fn i2s_codes(raw: &[u8]) -> (impl Iterator<Item = u8> + '_, f32) {
    let n = (raw.len() - I2S_TRAILER) * 4;
    let s = &raw[n / 4..n / 4 + 4];
    let codes = (0..n).map(move |i| {
        let (g, j) = (i / I2S_GROUP, i % I2S_GROUP);
        (raw[g * 32 + j % 32] >> (6 - 2 * (j / 32))) & 3
    });
    (codes, f32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}

/// The values of a ternary tensor, as ggml computes them: `(code − 1) · d`.
fn dequantize_ternary(dtype: GgmlType, raw: &[u8]) -> Vec<f32> {
    let value = |c: u8, d: f32| (c as i32 - 1) as f32 * d;
    match dtype {
        GgmlType::I2s => {
            let (codes, d) = i2s_codes(raw);
            codes.map(|c| value(c, d)).collect()
        }
        GgmlType::Tq1_0 | GgmlType::Tq2_0 => {
            let (bytes, d_at) = if dtype == GgmlType::Tq1_0 { (TQ1_0_BYTES, 52) } else { (TQ2_0_BYTES, 64) };
            let mut out = Vec::with_capacity(raw.len() / bytes * QK_K);
            for b in raw.chunks_exact(bytes) {
                let codes = if dtype == GgmlType::Tq1_0 { tq1_0_codes(b) } else { tq2_0_codes(b) };
                let d = f16_at(b, d_at);
                out.extend(codes.iter().map(|&c| value(c, d)));
            }
            out
        }
        other => unreachable!("{other} is not a ternary format"),
    }
}

/// 32 IQ4 values from 16 bytes of indices (low nibbles first) under scale `d`.
fn iq4_run(d: f32, qs: &[u8], o: &mut [f32]) {
    for (j, &q) in qs.iter().enumerate() {
        o[j] = d * IQ4_VALUES[(q & 0xF) as usize] as f32;
        o[j + 16] = d * IQ4_VALUES[(q >> 4) as usize] as f32;
    }
}

/// IQ4_XS's 6-bit scale of 32-value run `sub` of block `b` (`scales_h` at 2, `scales_l` at
/// 4), before its −32.
pub(crate) fn iq4_xs_scale(b: &[u8], sub: usize) -> i32 {
    let high = (u16::from_le_bytes([b[2], b[3]]) >> (2 * sub)) & 3;
    ((b[4 + sub / 2] >> (4 * (sub % 2))) & 0xF) as i32 | (high as i32) << 4
}

/// IQ4_XS's eight 6-bit scales `ls` packed as the block keeps them at 2: `scales_h` (two
/// high bits each), then `scales_l` (low nibbles, two to a byte); [`iq4_xs_scale`] reads them.
pub(crate) fn pack_iq4_xs_scales(ls: [u8; 8]) -> [u8; 6] {
    let high = ls.iter().enumerate().fold(0u16, |h, (sub, &l)| h | ((l >> 4) as u16) << (2 * sub));
    let mut out = [0u8; 6];
    out[..2].copy_from_slice(&high.to_le_bytes());
    for (j, pair) in ls.chunks_exact(2).enumerate() {
        out[2 + j] = (pair[0] & 0xF) | (pair[1] & 0xF) << 4;
    }
    out
}

/// The weight scale of IQ4_NL's block `b`, or of IQ4_XS's 32-value run `sub` of it.
pub(crate) fn iq4_run_scale(dtype: GgmlType, b: &[u8], sub: usize) -> f32 {
    match dtype {
        GgmlType::Iq4Nl => f16_at(b, 0),
        _ => f16_at(b, 0) * (iq4_xs_scale(b, sub) - 32) as f32,
    }
}

/// Where the 16 bytes of indices of IQ4_NL's block, or of IQ4_XS's run `sub`, start.
pub(crate) fn iq4_indices_at(dtype: GgmlType, sub: usize) -> usize {
    if dtype == GgmlType::Iq4Nl {
        2
    } else {
        8 + 16 * sub
    }
}

/// The 5-bit values at `j` and `j + 16` of a Q5 block: low nibbles plus a bit from `qh`.
fn five_bit(q: u8, qh: u32, j: usize) -> (i32, i32) {
    let h0 = ((qh >> j) << 4) & 0x10;
    let h1 = (qh >> (j + 12)) & 0x10;
    ((q & 0x0F) as i32 | h0 as i32, (q >> 4) as i32 | h1 as i32)
}

/// Scale and min `j` (of 8) from the 12 packed 6-bit bytes of Q4_K / Q5_K.
pub fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

/// Q3_K's scale `i` (of 16, values `16i..16i + 16`) from its 12 packed 6-bit bytes, less
/// 32: the low four bits in byte `i % 8` (the high nibble from 8 on), the high two in byte
/// `8 + i % 4` at bit `2 · (i / 4)`.
pub fn scale_k3(i: usize, s: &[u8]) -> i8 {
    let low = if i < 8 { s[i] & 0xF } else { s[i - 8] >> 4 };
    let high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
    (low | (high << 4)) as i8 - 32
}

/// Q4_K (`d, dmin, scales[12], qs[128]`) and Q5_K (`d, dmin, scales[12], qh[32], qs[128]`):
/// eight 32-value sub-blocks, each `d*sc * q - dmin*m`.
fn dequant_q45k(b: &[u8], o: &mut [f32], five: bool) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let (qh, qs) = if five { (&b[16..48], &b[48..176]) } else { (&b[0..0], &b[16..144]) };
    for pair in 0..4 {
        let ql = &qs[pair * 32..pair * 32 + 32];
        for half in 0..2 {
            let (sc, m) = scale_min_k4(2 * pair + half, scales);
            let (d1, m1) = (d * sc as f32, dmin * m as f32);
            let bit = 1u8 << (2 * pair + half);
            for l in 0..32 {
                let mut q = if half == 0 { ql[l] & 0xF } else { ql[l] >> 4 };
                if five && qh[l] & bit != 0 {
                    q += 16;
                }
                o[pair * 64 + half * 32 + l] = d1 * q as f32 - m1;
            }
        }
    }
}

/// Q6_K (`ql[128], qh[64], scales[16] i8, d`): sixteen 16-value groups, `d*sc * (q - 32)`.
fn dequant_q6k(b: &[u8], o: &mut [f32]) {
    let d = f16_at(b, 208);
    for n in 0..2 {
        let ql = &b[n * 64..n * 64 + 64];
        let qh = &b[128 + n * 32..128 + n * 32 + 32];
        let sc = &b[192 + n * 8..192 + n * 8 + 8];
        let y = &mut o[n * 128..n * 128 + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            let s = |k: usize| d * (sc[is + k] as i8) as f32;
            y[l] = s(0) * q1 as f32;
            y[l + 32] = s(2) * q2 as f32;
            y[l + 64] = s(4) * q3 as f32;
            y[l + 96] = s(6) * q4 as f32;
        }
    }
}

/// Q2_K (`scales[16], qs[64], d, dmin`): sixteen 16-value groups, `d*sc * q - dmin*m`.
fn dequant_q2k(b: &[u8], o: &mut [f32]) {
    let (scales, qs) = (&b[0..16], &b[16..80]);
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    let mut y = 0;
    let mut is = 0;
    for n in 0..2 {
        let q = &qs[n * 32..n * 32 + 32];
        for shift in [0, 2, 4, 6] {
            for half in 0..2 {
                let sc = scales[is];
                is += 1;
                let (dl, ml) = (d * (sc & 0xF) as f32, dmin * (sc >> 4) as f32);
                for l in 0..16 {
                    o[y] = dl * ((q[l + 16 * half] >> shift) & 3) as f32 - ml;
                    y += 1;
                }
            }
        }
    }
}

/// Q3_K (`hmask[32], qs[64], scales[12], d`): sixteen 16-value groups of 3-bit values with
/// 6-bit signed scales, `d*(sc - 32) * (q - 4 unless the high bit is set)`.
fn dequant_q3k(b: &[u8], o: &mut [f32]) {
    let (hm, qs, packed) = (&b[0..32], &b[32..96], &b[96..108]);
    let d = f16_at(b, 108);
    let scales: [i32; 16] = std::array::from_fn(|i| scale_k3(i, packed) as i32);
    let mut y = 0;
    let mut is = 0;
    let mut m = 1u8;
    for n in 0..2 {
        let q = &qs[n * 32..n * 32 + 32];
        for shift in [0, 2, 4, 6] {
            for half in 0..2 {
                let dl = d * scales[is] as f32;
                is += 1;
                for l in 0..16 {
                    let i = l + 16 * half;
                    let v = ((q[i] >> shift) & 3) as i32 - if hm[i] & m != 0 { 0 } else { 4 };
                    o[y] = dl * v as f32;
                    y += 1;
                }
            }
            m <<= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn legacy_blocks() {
        let d = f16::from_f32(0.5).to_le_bytes();
        let m = f16::from_f32(-1.0).to_le_bytes();
        let mut q41 = vec![d[0], d[1], m[0], m[1]];
        q41.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let got = dequantize(GgmlType::Q4_1, &q41);
        assert_eq!((got[0], got[15], got[16], got[31]), (-1.0, 6.5, 6.5, -1.0));

        let mut q40 = vec![d[0], d[1]];
        q40.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let got = dequantize(GgmlType::Q4_0, &q40);
        assert_eq!((got[0], got[16], got[15]), (-4.0, 3.5, 3.5));

        let mut q80 = vec![d[0], d[1]];
        q80.extend((0..32).map(|j| (j as i8 - 16) as u8));
        let got = dequantize(GgmlType::Q8_0, &q80);
        assert_eq!((got[0], got[31]), (-8.0, 7.5));

        // Q5_0: value j's fifth bit is bit j of qh; value j+16's is bit j+16.
        let mut q50 = vec![d[0], d[1]];
        q50.extend(0x8000_0001u32.to_le_bytes());
        q50.extend([0x21u8; 16]);
        let got = dequantize(GgmlType::Q5_0, &q50);
        assert_eq!((got[0], got[1], got[16], got[31]), (0.5 * (17 - 16) as f32, 0.5 * (1 - 16) as f32, -7.0, 1.0));
        let mut q51 = vec![d[0], d[1], m[0], m[1]];
        q51.extend(0x8000_0001u32.to_le_bytes());
        q51.extend([0x21u8; 16]);
        let got = dequantize(GgmlType::Q5_1, &q51);
        assert_eq!((got[0], got[1], got[31]), (0.5 * 17.0 - 1.0, 0.5 - 1.0, 0.5 * 18.0 - 1.0));
    }

    /// IQ4_NL's indices pick [`IQ4_VALUES`] (low nibbles are values 0..16); IQ4_XS's runs
    /// of 32 take their 6-bit scales (low four bits from `scales_l`, two from `scales_h`),
    /// less 32. The values were also checked, bit for bit, against the `gguf` Python
    /// package's dequantizer on tensors that llama-quantize wrote.
    #[test]
    fn iq4_blocks() {
        let d = f16::from_f32(0.5).to_le_bytes();
        let indices: Vec<u8> = (0..16u8).map(|j| j | ((15 - j) << 4)).collect();
        let nl = [&d[..], &indices].concat();
        let got = dequantize(GgmlType::Iq4Nl, &nl);
        assert_eq!((got[0], got[15], got[16], got[31]), (-63.5, 56.5, 56.5, -63.5));

        // Scales 0, 1, 31, 32, 33, 47, 62, 63: the low nibbles two to a byte, the high bits
        // two per run.
        let ls = [0u16, 1, 31, 32, 33, 47, 62, 63];
        let high = ls.iter().enumerate().fold(0u16, |h, (i, &l)| h | (l >> 4) << (2 * i));
        let mut xs = [&d[..], &high.to_le_bytes()].concat();
        xs.extend((0..4).map(|i| (ls[2 * i] & 0xF) as u8 | ((ls[2 * i + 1] & 0xF) as u8) << 4));
        for _ in 0..8 {
            xs.extend(&indices);
        }
        let got = dequantize(GgmlType::Iq4Xs, &xs);
        for (run, &l) in ls.iter().enumerate() {
            let dl = 0.5 * (l as f32 - 32.0);
            assert_eq!((got[32 * run], got[32 * run + 16]), (dl * -127.0, dl * 113.0), "run {run}");
        }
    }

    #[test]
    fn parses_ggml_names() {
        let parse = |s: &str| s.parse::<GgmlType>();
        assert_eq!(
            (parse("q4_k"), parse("Q8_0"), parse("bf16")),
            (Ok(GgmlType::Q4K), Ok(GgmlType::Q8_0), Ok(GgmlType::Bf16))
        );
        assert!(parse("q4k").is_err() && parse("q4_k_m").is_err());
        assert_eq!((GgmlType::Q4K.to_string(), GgmlType::Bf16.to_string()), ("Q4_K".into(), "BF16".into()));
        assert_eq!((parse("iq4_xs"), GgmlType::Iq4Nl.to_string()), (Ok(GgmlType::Iq4Xs), "IQ4_NL".into()));
    }

    #[test]
    fn packed_k_scales() {
        // Sub-blocks 0..4 keep 6 bits in bytes 0..8; 4..8 split across bytes 8..12 and the top bits.
        let s = [1, 2, 3, 4 | 0xC0, 5, 6, 7, 8 | 0x40, 0x9A, 0xBC, 0xDE, 0xF1];
        assert_eq!(scale_min_k4(0, &s), (1, 5));
        assert_eq!(scale_min_k4(3, &s), (4, 8));
        assert_eq!(scale_min_k4(4, &s), (0xA, 0x9));
        assert_eq!(scale_min_k4(7, &s), (0x1 | (3 << 4), 0xF | (1 << 4)));
    }
}
