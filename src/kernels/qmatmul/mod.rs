//! `Y = X · Wᵀ` with `W` kept in a GGML block format: each row of `X` is quantized to int8
//! with one f32 scale per 16 values, or per 32 for Q6_K and 256 for Q4_K ([`ActScales`]), plus
//! their integer sums for the formats with an offset; the dot products with `W`'s blocks
//! are integer (`maddubs`/`madd` on AVX2) with f32 scales applied per activation scale.
//! llama.cpp scales per 32 (per 256 for the K-quants); per 16 costs one more conversion
//! and multiply-add per block and row, and pays where the weights are fine enough for the
//! activations' rounding to show. The common formats run on eight interleaved rows at a
//! time ([`x8`]); the rest, and tails of fewer than eight rows, one row at a time in the
//! file's layout ([`rows`]).
//!
//! **Batch invariance.** A row's result is the same chain of operations whatever else is
//! in the step: rows are quantized on their own, and a row tile only shares the decoded
//! weights between rows, never a sum. **Bandwidth.** Weights are read in their file's size
//! (a Q4 model reads about a seventh of its f32 bytes per token), which is what bounds
//! decode at one sequence.

use super::buffer::Buf;
use super::quant::{dequantize, GgmlType};
use super::round_small;
use rayon::prelude::*;
use std::borrow::Cow;

mod rows;
mod x8;

pub use x8::{avx2_step, vnni, Avx2Step};

/// Values per activation block (and per decoded weight block).
const QB: usize = 32;
/// Values per activation scale: half a block.
const QH: usize = 16;
/// Activation rows that share one decoded weight block.
const TILE: usize = 8;

/// How a part's rows are laid out in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// The file's layout: each row its blocks in order, `row_bytes` apart.
    Rows { row_bytes: usize },
    /// Groups of eight rows interleaved block by block ([`x8`]); `rows` is a multiple of 8.
    X8,
}

/// One run of rows of a single block format.
struct Part {
    dtype: GgmlType,
    rows: usize,
    layout: Layout,
    data: Buf<u8>,
}

impl Part {
    /// Row `r`'s raw blocks in the file's layout.
    fn raw_row(&self, r: usize, k: usize) -> Vec<u8> {
        match self.layout {
            Layout::Rows { row_bytes } => self.data[r * row_bytes..(r + 1) * row_bytes].to_vec(),
            Layout::X8 => x8::raw_row(self.dtype, &self.data, r, k),
        }
    }
}

/// A weight `[n, k]` in GGML block formats; stacked projections of different formats (say
/// Q4_K q/k and Q6_K v) are parts that follow each other. Formats with an interleaved
/// kernel are repacked at load into groups of eight rows (the file's bytes, a little more
/// where packed scales are unpacked), the rest stay row by row.
pub struct QMatrix {
    n: usize,
    k: usize,
    parts: Vec<Part>,
}

impl QMatrix {
    /// Stacks parts `(format, rows, raw bytes)` of `k` columns each, interleaving what
    /// [`x8`] computes (a tail of fewer than eight rows stays row by row).
    pub fn new(k: usize, parts: Vec<(GgmlType, usize, Cow<'_, [u8]>)>) -> anyhow::Result<Self> {
        let mut out = Vec::with_capacity(parts.len());
        for (dtype, rows, data) in parts {
            let (per_block, block_bytes) = dtype.block();
            anyhow::ensure!(
                Self::supports(dtype) && k > 0 && k.is_multiple_of(per_block) && k.is_multiple_of(QB),
                "{dtype:?} rows of {k} values are not whole blocks of {per_block}"
            );
            let row_bytes = k / per_block * block_bytes;
            anyhow::ensure!(data.len() == rows * row_bytes, "{dtype:?} [{rows}, {k}]: {} bytes", data.len());
            let grouped = if x8::supports(dtype) { rows / x8::GROUP * x8::GROUP } else { 0 };
            if grouped > 0 {
                let data = x8::interleave(dtype, &data[..grouped * row_bytes], k);
                out.push(Part { dtype, rows: grouped, layout: Layout::X8, data });
            }
            if grouped < rows {
                let data = Buf::copied(&data[grouped * row_bytes..]);
                out.push(Part { dtype, rows: rows - grouped, layout: Layout::Rows { row_bytes }, data });
            }
        }
        Ok(QMatrix { n: out.iter().map(|p| p.rows).sum(), k, parts: out })
    }

    /// Whether `dtype` can be computed quantized (block formats; floats stay f32).
    pub fn supports(dtype: GgmlType) -> bool {
        crate::kernels::quant::BLOCK_FORMATS.contains(&dtype)
    }

    /// How the activations this matrix takes are scaled: the coarsest its parts' kernels
    /// need ([`x8::act_scales`]; the row-by-row kernels take any), since every kernel
    /// reads coarser scales.
    pub fn act_scales(&self) -> ActScales {
        let need = |p: &Part| if p.layout == Layout::X8 { x8::act_scales(p.dtype) } else { ActScales::PerHalf };
        self.parts.iter().map(need).max().unwrap_or_default()
    }

    /// Quantizes `m` rows of `x` for this matrix: scaled as [`QMatrix::act_scales`] says,
    /// and, where a part takes 16-bit activations ([`takes_wide`]), each row again as a
    /// pair of int8 rows, its values and what they leave over.
    pub fn quantize(&self, x: &[f32], m: usize, out: &mut QActs) {
        let (k, scales) = (self.k, self.act_scales());
        quantize_rows(x, m, k, scales, out);
        out.has_wide = self.parts.iter().any(|p| takes_wide(p.dtype));
        if out.has_wide {
            let mut pairs = std::mem::take(&mut out.pairs_f32);
            pairs.resize(2 * m * k, 0.0);
            let rows = pairs.par_chunks_mut(2 * k).zip(x[..m * k].par_chunks(k));
            rows.zip(out.q.par_chunks(k).zip(out.d.par_chunks(k / QH))).for_each(|((pair, x), (q, d))| {
                let (hi, lo) = pair.split_at_mut(k);
                hi.copy_from_slice(x);
                for (((r, x), q), &d) in lo.chunks_exact_mut(QH).zip(x.chunks_exact(QH)).zip(q.chunks_exact(QH)).zip(d)
                {
                    r.iter_mut().zip(x).zip(q).for_each(|((r, &x), &q)| *r = x - d * q as f32);
                }
            });
            quantize_rows(&pairs, 2 * m, k, scales, out.wide.get_or_insert_with(Default::default));
            out.pairs_f32 = pairs;
        }
    }

    /// Whether [`QMatrix::quantize`] quantizes rows for `self` exactly as for `other`:
    /// then one quantization of a row serves both, [`QActs::gather`]ed.
    pub fn quantizes_as(&self, other: &QMatrix) -> bool {
        let wide = |w: &QMatrix| w.parts.iter().any(|p| takes_wide(p.dtype));
        self.k == other.k && self.act_scales() == other.act_scales() && wide(self) == wide(other)
    }

    /// Rows (`n`).
    pub fn rows(&self) -> usize {
        self.n
    }

    /// Values per row (`k`).
    pub fn cols(&self) -> usize {
        self.k
    }

    /// Multiply-adds one activation row costs, by block format (a part each).
    pub fn products(&self) -> impl Iterator<Item = (GgmlType, usize)> + '_ {
        self.parts.iter().map(|p| (p.dtype, p.rows * self.k))
    }

    /// Bytes of weights one pass over the matrix reads.
    pub fn bytes(&self) -> usize {
        self.parts.iter().map(|p| p.data.len()).sum()
    }

    /// Row `r`, dequantized (an embedding, when the LM head is tied to it).
    pub fn row_into(&self, mut r: usize, out: &mut [f32]) {
        for p in &self.parts {
            if r < p.rows {
                out[..self.k].copy_from_slice(&dequantize(p.dtype, &p.raw_row(r, self.k)));
                return;
            }
            r -= p.rows;
        }
        panic!("row {r} past the end of the matrix");
    }
}

/// How finely a row's int8 activations are scaled: the matrix that takes them chooses
/// ([`QMatrix::act_scales`]). Scales are stored per 16 values whatever the choice (equal
/// across the values that share one), so a kernel reads any scales as coarse as it needs
/// or coarser (ordered from finest to coarsest).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub enum ActScales {
    /// One scale per 16 values: an outlier coarsens 15 others, not 31, which about halves
    /// the KL divergence from the f32 path against per 32 (`docs/kernels.md`).
    #[default]
    PerHalf,
    /// One per 32, for Q6_K: the scaled sums of its two 16-value sub-blocks add in i32 and
    /// convert once, for a little more KL divergence than per 16.
    PerBlock,
    /// One per 256, a K-quant super-block (llama.cpp's `q8_K`), for Q4_K and Q5_K: a
    /// block's scaled sub-block sums then add in i32, and the kernel converts and scales
    /// once per block and row instead of once per 32 values (Q6_K stays per 32 for its
    /// quality).
    PerSuper,
    /// One per row, by its largest `|x|` (at least 1e-5): BitNet b1.58's per-token int8
    /// activations, as the model was trained and transformers computes it, for TQ2_0.
    PerRow,
}

impl ActScales {
    /// 16-value halves that share one scale, in rows of `k` values.
    fn halves(self, k: usize) -> usize {
        match self {
            ActScales::PerHalf => 1,
            ActScales::PerBlock => 2,
            ActScales::PerSuper => 16,
            ActScales::PerRow => k / QH,
        }
    }
}

/// Whether `dtype`'s parts take 16-bit activations: each row as two int8 rows, its values
/// and the values of what they leave over, run as neighbours in one tile (so the weights
/// unpack once for both) and their results added. MXFP4, for gpt-oss: trained with 16-bit
/// activations against its 4-bit experts; on its random-weight fixture int8 activations
/// alone agreed with the exact dequantization on 92.7 % of teacher-forced steps, 16-bit
/// on all of them.
pub fn takes_wide(dtype: GgmlType) -> bool {
    dtype == GgmlType::Mxfp4
}

/// `X`'s rows quantized for [`qmatmul`].
#[derive(Default)]
pub struct QActs {
    q: Vec<i8>,
    /// One scale per 16 values (equal across each run of [`ActScales::halves`]).
    d: Vec<f32>,
    /// Integer sums of each 16 values, for the formats with an offset.
    sums: Vec<i32>,
    /// `Σ d · (sum of the 16 values)` per 32, for the formats with one offset per block.
    dsum: Vec<f32>,
    /// Per 16 values, formed on first use by a Q6_K kernel without VNNI ([`QActs::q6_offsets`]).
    q6: std::sync::OnceLock<Vec<i32>>,
    /// Per 16 values, formed on first use by a Q6_K kernel with VNNI ([`QActs::q6_starts`]).
    q6_starts: std::sync::OnceLock<Vec<i32>>,
    /// Per 64 values, formed on first use by a Q4_K kernel ([`QActs::pair_sums`]).
    pairs: std::sync::OnceLock<Vec<i32>>,
    /// Per 32 values, formed on first use by a Q2_K kernel ([`QActs::half_pairs`]).
    half_pairs: std::sync::OnceLock<Vec<i32>>,
    /// Per 256 values, formed on first use by a ternary kernel ([`QActs::block_sums`]).
    block_sums: std::sync::OnceLock<Vec<i32>>,
    /// Two bytes per value, formed on first use by a TQ1_0 kernel ([`QActs::split_pairs`]).
    split: std::sync::OnceLock<Vec<i8>>,
    scales: ActScales,
    /// For [`takes_wide`] parts ([`QMatrix::quantize`]): `2m` rows, each row's values and
    /// then its remainder `x − d·q`, quantized the same way; kept for its buffers.
    wide: Option<Box<QActs>>,
    /// Whether `wide` holds this quantization's rows.
    has_wide: bool,
    /// Scratch for `wide`'s rows in f32.
    pairs_f32: Vec<f32>,
}

impl QActs {
    /// Rows `rows` of `src` (rows of `k` values), in that order: what quantizing those
    /// rows alone writes, since each row is quantized on its own. A mixture's experts take
    /// their rows of one quantization of the step's rows, not one each.
    pub fn gather(&mut self, src: &QActs, k: usize, rows: &[usize]) {
        self.take_rows(src, k, rows.iter().copied());
        self.has_wide = src.has_wide;
        if let (true, Some(wide)) = (src.has_wide, src.wide.as_deref()) {
            let pairs = rows.iter().flat_map(|&r| [2 * r, 2 * r + 1]);
            self.wide.get_or_insert_with(Default::default).take_rows(wide, k, pairs);
        }
    }

    /// [`QActs::gather`]'s rows of `src` itself, without its wide rows.
    fn take_rows(&mut self, src: &QActs, k: usize, rows: impl Iterator<Item = usize>) {
        let (per_d, per_sum) = (k / QH, k / QB);
        self.clear_formed();
        self.scales = src.scales;
        self.q.clear();
        self.d.clear();
        self.sums.clear();
        self.dsum.clear();
        for r in rows {
            self.q.extend_from_slice(&src.q[r * k..(r + 1) * k]);
            self.d.extend_from_slice(&src.d[r * per_d..(r + 1) * per_d]);
            self.sums.extend_from_slice(&src.sums[r * per_d..(r + 1) * per_d]);
            self.dsum.extend_from_slice(&src.dsum[r * per_sum..(r + 1) * per_sum]);
        }
    }

    /// Forgets what kernels formed on first use from the previous rows.
    fn clear_formed(&mut self) {
        self.q6 = Default::default();
        self.q6_starts = Default::default();
        self.pairs = Default::default();
        self.half_pairs = Default::default();
        self.block_sums = Default::default();
        self.split = Default::default();
    }

    /// The rows a part of `dtype` computes with, of these `m`: the `2m` paired rows when it
    /// takes them and this quantization has them (then `true`: add each pair's results),
    /// else these.
    pub(super) fn for_part(&self, dtype: GgmlType, m: usize) -> (&QActs, usize, bool) {
        match self.wide.as_deref().filter(|_| self.has_wide && takes_wide(dtype)) {
            Some(pairs) => (pairs, 2 * m, true),
            None => (self, m, false),
        }
    }

    /// Per 16 values `x0..x16`, the i16 pair `−32 · (x0 + x1 + x4 + x5 + x8 + …, x2 + x3 +
    /// x6 + x7 + x10 + …)`: what Q6_K's −32 takes off the lanes of four `maddubs` of four
    /// values each, so that its kernel applies the offset with one 16-bit add per 16
    /// values instead of a multiply. Formed once per quantization, on the first call.
    pub(super) fn q6_offsets(&self) -> &[i32] {
        self.q6.get_or_init(|| {
            let pair =
                |v: &[i8], a: usize| (0..16).step_by(4).map(|c| v[c + a] as i32 + v[c + a + 1] as i32).sum::<i32>();
            let sixteen = self.q.chunks_exact(QH);
            sixteen
                .map(|v| ((-32 * pair(v, 0)) as u16 as u32 | ((-32 * pair(v, 2)) as u16 as u32) << 16) as i32)
                .collect()
        })
    }

    /// Per 16 values, `−32 ·` their sum: where Q6_K's VNNI sums of unsigned values start.
    /// Read with a broadcast load per row and 16 values, the offset costs no multiply and
    /// no move into a vector. Formed once per quantization, on the first call.
    pub(super) fn q6_starts(&self) -> &[i32] {
        self.q6_starts.get_or_init(|| self.sums.iter().map(|&s| -32 * s).collect())
    }

    /// Per 64 values, the i16 pair of the integer sums of its two 32-value halves: `madd`
    /// with a pair of Q4_K sub-block mins gives their terms in one instruction. Formed once
    /// per quantization, on the first call.
    pub(super) fn pair_sums(&self) -> &[i32] {
        self.pairs.get_or_init(|| {
            let half = |s: &[i32]| (s[0] + s[1]) as u16 as u32;
            self.sums.chunks_exact(4).map(|s| (half(&s[..2]) | half(&s[2..]) << 16) as i32).collect()
        })
    }

    /// Per 32 values, the i16 pair of the integer sums of its two 16-value halves: `madd`
    /// with a pair of Q2_K mins gives their terms in one instruction. Formed once per
    /// quantization, on the first call.
    pub(super) fn half_pairs(&self) -> &[i32] {
        self.half_pairs.get_or_init(|| {
            self.sums.chunks_exact(2).map(|s| (s[0] as u16 as u32 | (s[1] as u16 as u32) << 16) as i32).collect()
        })
    }

    /// Per 256 values, their integer sum: what TQ2_0's codes `t + 1` add beyond `t`.
    /// Formed once per quantization, on the first call.
    pub(super) fn block_sums(&self) -> &[i32] {
        self.block_sums.get_or_init(|| self.sums.chunks_exact(16).map(|s| s.iter().sum()).collect())
    }

    /// Per 4 values `x0..x4`, the 8 bytes `0 x0 0 x2 0 x1 0 x3`: the even and the odd values
    /// each in the high byte of an i16, where TQ1_0's one-row kernel finds its digits.
    /// Formed once per quantization, on the first call.
    pub(super) fn split_pairs(&self) -> &[i8] {
        self.split.get_or_init(|| self.q.chunks_exact(4).flat_map(|x| [0, x[0], 0, x[2], 0, x[1], 0, x[3]]).collect())
    }
}

/// How one call of the block quantizer scales its values: `Runs(h)`, each run of `h`
/// 16-value halves by its own largest `|x|`; `Fixed(a)`, every value by `a` (a row's).
#[derive(Debug, Clone, Copy)]
enum Runs {
    Halves(usize),
    Fixed(f32),
}

/// Quantizes `m` rows of `k` values: per 16 (or 32, 256 or the row: `scales`),
/// `d = max|x| / 127`, `q = round(x / d)`.
pub fn quantize_rows(x: &[f32], m: usize, k: usize, scales: ActScales, out: &mut QActs) {
    let blocks = m * k / QB;
    let halves = scales.halves(k);
    assert!(
        k.is_multiple_of(QB) && k.is_multiple_of(QH * halves),
        "quantize_rows: rows of {k} values are not whole runs of {halves} × {QH}"
    );
    out.clear_formed();
    out.has_wide = false;
    out.scales = scales;
    out.q.resize(m * k, 0);
    out.d.resize(2 * blocks, 0.0);
    out.sums.resize(2 * blocks, 0);
    out.dsum.resize(blocks, 0.0);
    let run = |x: &[f32], q: &mut [i8], d: &mut [f32], sums: &mut [i32], dsum: &mut [f32], runs: Runs| {
        #[cfg(target_arch = "x86_64")]
        if super::matmul::avx2::available() {
            // SAFETY: AVX2 was detected.
            return unsafe { avx2::quantize_blocks(x, q, d, sums, dsum, runs) };
        }
        quantize_blocks(x, q, d, sums, dsum, runs)
    };
    if scales == ActScales::PerRow {
        // A row's largest magnitude first, then its values in pieces of 64 blocks.
        let rows = x[..m * k].par_chunks(k).zip(out.q.par_chunks_mut(k));
        let rows = rows.zip(out.d.par_chunks_mut(k / QH)).zip(out.sums.par_chunks_mut(k / QH));
        rows.zip(out.dsum.par_chunks_mut(k / QB)).for_each(|((((x, q), d), sums), dsum)| {
            let amax = x.iter().fold(0f32, |a, v| a.max(v.abs())).max(1e-5);
            let pieces = x.chunks(QB * 64).zip(q.chunks_mut(QB * 64)).zip(d.chunks_mut(128));
            for (((x, q), d), (sums, dsum)) in pieces.zip(sums.chunks_mut(128).zip(dsum.chunks_mut(64))) {
                run(x, q, d, sums, dsum, Runs::Fixed(amax));
            }
        });
        return;
    }
    // Chunks of 64 blocks: whole runs of every `halves`, since rows are.
    let work = x[..m * k].par_chunks(QB * 64).zip(out.q.par_chunks_mut(QB * 64));
    let work = work.zip(out.d.par_chunks_mut(128)).zip(out.sums.par_chunks_mut(128)).zip(out.dsum.par_chunks_mut(64));
    work.for_each(|((((x, q), d), sums), dsum)| run(x, q, d, sums, dsum, Runs::Halves(halves)));
}

/// Each 16 values' largest `|x|` in `amax` becomes its run's (or the fixed scale).
fn run_max(amax: &mut [f32], runs: Runs) {
    match runs {
        Runs::Fixed(a) => amax.fill(a),
        Runs::Halves(halves) => {
            for run in amax.chunks_exact_mut(halves) {
                let m = run.iter().fold(0f32, |a, &v| a.max(v));
                run.fill(m);
            }
        }
    }
}

/// [`quantize_rows`] over whole blocks: `x` and `q` hold `dsum.len()` blocks of 32 (at
/// most 64), `d` and `sums` two entries per block; `runs`: how values share a scale.
fn quantize_blocks(x: &[f32], q: &mut [i8], d: &mut [f32], sums: &mut [i32], dsum: &mut [f32], runs: Runs) {
    assert!(x.len() <= 64 * QB && x.len() == q.len());
    let mut amax = [0f32; 128];
    for (a, h) in amax.iter_mut().zip(x.chunks_exact(QH)) {
        *a = h.iter().fold(0f32, |a, v| a.max(v.abs()));
    }
    run_max(&mut amax[..x.len() / QH], runs);
    let each = x.chunks_exact(QH).zip(q.chunks_exact_mut(QH)).zip(d.iter_mut().zip(sums.iter_mut()));
    for (((x, q), (d, s)), &amax) in each.zip(&amax) {
        *d = amax / 127.0;
        let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        for (q, &v) in q.iter_mut().zip(x) {
            *q = round_small(v * id) as i8;
        }
        *s = q.iter().map(|&v| v as i32).sum();
    }
    for ((ds, d), s) in dsum.iter_mut().zip(d.chunks_exact(2)).zip(sums.chunks_exact(2)) {
        *ds = d[0] * s[0] as f32 + d[1] * s[1] as f32;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{run_max, Runs, QB, QH};
    use std::arch::x86_64::*;

    /// [`super::quantize_blocks`] in vectors, with the same result bit for bit: the same
    /// scales and products, and `cvtps` rounds to nearest even as `round_small` does.
    /// The scalar version does not vectorize (a float maximum and saturating casts), and
    /// at 32 rows it took 7% of a SmolLM2 decode step.
    ///
    /// # Safety
    /// AVX2 must be available.
    #[target_feature(enable = "avx2")]
    pub unsafe fn quantize_blocks(
        x: &[f32],
        q: &mut [i8],
        d: &mut [f32],
        sums: &mut [i32],
        dsum: &mut [f32],
        runs: Runs,
    ) {
        unsafe {
            assert!(x.len() <= 64 * QB && x.len() == q.len() && d.len() * QH >= x.len() && sums.len() == d.len());
            let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
            let halves_here = x.len() / QH;
            let mut amax = [0f32; 128];
            // Plain loops: intrinsics in a closure would not take this function's features.
            for (h, a) in amax[..halves_here].iter_mut().enumerate() {
                let lo = _mm256_loadu_ps(x[h * QH..h * QH + 8].as_ptr());
                let hi = _mm256_loadu_ps(x[h * QH + 8..h * QH + 16].as_ptr());
                let m = _mm256_max_ps(_mm256_and_ps(lo, abs_mask), _mm256_and_ps(hi, abs_mask));
                let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
                let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
                *a = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
            }
            run_max(&mut amax[..halves_here], runs);
            for (h, &amax) in amax[..halves_here].iter().enumerate() {
                let at = h * QH;
                let lo = _mm256_loadu_ps(x[at..at + 8].as_ptr());
                let hi = _mm256_loadu_ps(x[at + 8..at + 16].as_ptr());
                d[h] = amax / 127.0;
                let id = _mm256_set1_ps(if amax > 0.0 { 127.0 / amax } else { 0.0 });
                let (il, ih) = (_mm256_cvtps_epi32(_mm256_mul_ps(lo, id)), _mm256_cvtps_epi32(_mm256_mul_ps(hi, id)));
                // i16 in order, then i8 (every value is within ±127, so nothing saturates).
                let w = _mm256_permute4x64_epi64(_mm256_packs_epi32(il, ih), 0b11_01_10_00);
                let bytes = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
                _mm_storeu_si128(q[at..at + 16].as_mut_ptr().cast(), bytes);
                let t = _mm256_add_epi32(il, ih);
                let t = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
                let t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0b01_00_11_10));
                sums[h] = _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0b10_11_00_01)));
            }
            for (b, ds) in dsum.iter_mut().enumerate() {
                *ds = d[2 * b] * sums[2 * b] as f32 + d[2 * b + 1] * sums[2 * b + 1] as f32;
            }
        }
    }
}

/// `y[i, j] = Σ_k x[i, k] · w[j, k]` for `i < m`; `y` is `[m, n]` row-major; `xq` holds
/// `X` quantized by [`quantize_rows`] with `w`'s [`QMatrix::act_scales`].
pub fn qmatmul(xq: &QActs, w: &QMatrix, y: &mut [f32], m: usize) {
    qmatmul_each(&mut [Product { xq, w, y, m }]);
}

/// One product of [`qmatmul_each`]: [`qmatmul`]'s arguments.
pub struct Product<'a> {
    pub xq: &'a QActs,
    pub w: &'a QMatrix,
    pub y: &'a mut [f32],
    pub m: usize,
}

/// A run of one part's rows (or groups of eight) of one product: a task of the pool.
struct Task {
    product: usize,
    part: usize,
    col0: usize,
    units: std::ops::Range<usize>,
}

/// [`qmatmul`] for independent products at once: the tasks of all of them go to the pool
/// together, so that many small products (a mixture's experts, a few rows each) cost one
/// dispatch and keep every thread busy however unevenly their sizes fall.
pub fn qmatmul_each(products: &mut [Product<'_>]) {
    let mut tasks = Vec::new();
    let mut work = 0;
    for (pi, pr) in products.iter().enumerate() {
        let (n, k, m) = (pr.w.n, pr.w.k, pr.m);
        assert!(pr.xq.q.len() >= m * k && pr.y.len() >= m * n, "qmatmul: buffers too small");
        assert!(pr.xq.scales >= pr.w.act_scales(), "qmatmul: activations scaled more finely than the kernels read");
        // No rows (a step whose rows all sit inside prompts asks the LM head for none, an
        // expert no row chose): nothing to write, and no task to start.
        if m == 0 {
            continue;
        }
        work += m * n * k;
        let mut col0 = 0;
        for (part, p) in pr.w.parts.iter().enumerate() {
            let (units, per_task) = match p.layout {
                Layout::Rows { .. } => (p.rows, rows::ROWS_PER_TASK),
                Layout::X8 => (p.rows / x8::GROUP, x8::groups_per_task(p.rows / x8::GROUP)),
            };
            tasks.extend((0..units.div_ceil(per_task)).map(|t| Task {
                product: pi,
                part,
                col0,
                units: t * per_task..((t + 1) * per_task).min(units),
            }));
            col0 += p.rows;
        }
    }
    let outs: Vec<SharedOut> = products.iter_mut().map(|p| SharedOut(p.y.as_mut_ptr())).collect();
    let products: &[Product<'_>] = products;
    let run = |t: &Task| {
        let pr = &products[t.product];
        let (p, k, n) = (&pr.w.parts[t.part], pr.w.k, pr.w.n);
        // SAFETY (both arms): each task writes only its own rows' or groups' columns of its
        // part's `col0..col0 + p.rows` in its product's `y`, whose size was checked above.
        match p.layout {
            Layout::Rows { row_bytes } => unsafe {
                rows::rows_task(pr.xq, p, row_bytes, k, t.units.clone(), t.col0, n, pr.m, outs[t.product])
            },
            Layout::X8 => unsafe { x8::groups_task(pr.xq, p, k, t.units.clone(), t.col0, n, pr.m, outs[t.product]) },
        }
    };
    // Small products run on the calling thread: a dispatch would cost more than the work.
    if work >= 1 << 16 {
        tasks.par_iter().for_each(run);
    } else {
        tasks.iter().for_each(run);
    }
}

#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: tasks write disjoint elements.
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

fn write(y: SharedOut, n: usize, col: usize, first: usize, vals: &[f32]) {
    for (t, &v) in vals.iter().enumerate() {
        // SAFETY: the caller owns column `col` of rows `first..first + vals.len()`.
        unsafe { *y.0.add((first + t) * n + col) = v };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::random_vec;

    /// Random blocks of `dtype` with sane scales (random bytes, then every f16 scale field
    /// rewritten to a small positive value).
    pub(super) fn random_blocks(dtype: GgmlType, n_blocks: usize, seed: u64) -> Vec<u8> {
        let (_, bytes) = dtype.block();
        let noise = random_vec(n_blocks * bytes, seed);
        let mut raw: Vec<u8> = noise.iter().map(|v| ((v + 1.0) * 127.5) as u8).collect();
        let scale_at: &[usize] = match dtype {
            GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Iq4Nl | GgmlType::Iq4Xs => &[0],
            GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
            GgmlType::Q6K => &[208],
            GgmlType::Q2K => &[80, 82],
            GgmlType::Q3K => &[108],
            GgmlType::Tq2_0 => &[64],
            GgmlType::Tq1_0 => &[52],
            _ => &[],
        };
        if dtype == GgmlType::Mxfp4 {
            // E8M0 exponents around 2^-7, never the NaN byte.
            raw.chunks_exact_mut(bytes).enumerate().for_each(|(i, blk)| blk[0] = 118 + (i % 7) as u8);
        }
        for (i, blk) in raw.chunks_exact_mut(bytes).enumerate() {
            if dtype == GgmlType::Tq2_0 {
                // Ternary codes are 0, 1 or 2: a 3 becomes a 2.
                blk[..64].iter_mut().for_each(|b| *b &= !((*b & 0xAA) >> 1 & *b));
            }
            for &at in scale_at {
                let v = half::f16::from_f32(0.01 + 0.001 * ((i + at) % 7) as f32).to_le_bytes();
                blk[at..at + 2].copy_from_slice(&v);
            }
        }
        raw
    }

    const TYPES: [GgmlType; 15] = crate::kernels::quant::BLOCK_FORMATS;

    /// Many products at once (a mixture's experts: every format, 0 to 40 rows each, some
    /// with none) give each product's [`qmatmul`] alone, bit for bit.
    #[test]
    fn products_at_once_equal_each_alone() {
        let k = 512;
        let mats: Vec<(QMatrix, usize)> = TYPES
            .iter()
            .enumerate()
            .map(|(i, &dtype)| {
                let n = 8 * (1 + i % 3) + i % 2;
                let raw = random_blocks(dtype, n * k / dtype.block().0, 20 + i as u64);
                (QMatrix::new(k, vec![(dtype, n, raw.into())]).unwrap(), [0, 1, 3, 7, 40][i % 5])
            })
            .collect();
        let acts: Vec<QActs> = mats
            .iter()
            .enumerate()
            .map(|(i, (w, m))| {
                let mut q = QActs::default();
                quantize_rows(&random_vec(m * k, 50 + i as u64), *m, k, w.act_scales(), &mut q);
                q
            })
            .collect();
        let alone: Vec<Vec<f32>> = mats
            .iter()
            .zip(&acts)
            .map(|((w, m), xq)| {
                let mut y = vec![0.0; m * w.rows()];
                qmatmul(xq, w, &mut y, *m);
                y
            })
            .collect();
        let mut ys: Vec<Vec<f32>> = mats.iter().map(|(w, m)| vec![f32::NAN; m * w.rows()]).collect();
        let mut products: Vec<Product> =
            mats.iter().zip(&acts).zip(&mut ys).map(|(((w, m), xq), y)| Product { xq, w, y, m: *m }).collect();
        qmatmul_each(&mut products);
        for (i, (a, b)) in alone.iter().zip(&ys).enumerate() {
            assert!(a == b, "{}: {} rows", TYPES[i], mats[i].1);
        }
    }

    /// Rows gathered from one quantization of all rows give every format the products of
    /// those rows quantized alone, bit for bit: none, one, repeats, out of order, and
    /// MXFP4's wide rows.
    #[test]
    fn gathered_rows_compute_as_quantized_alone() {
        let (k, m) = (512, 6);
        let x = random_vec(m * k, 61);
        for (i, &dtype) in TYPES.iter().enumerate() {
            let raw = random_blocks(dtype, 16 * k / dtype.block().0, 70 + i as u64);
            let w = QMatrix::new(k, vec![(dtype, 16, raw.into())]).unwrap();
            assert!(w.quantizes_as(&w));
            let mut all = QActs::default();
            w.quantize(&x, m, &mut all);
            let mut gathered = QActs::default();
            for rows in [&[][..], &[4], &[5, 0, 5, 2], &[1, 2, 3, 4, 5, 0]] {
                let picked: Vec<f32> = rows.iter().flat_map(|&r| x[r * k..(r + 1) * k].to_vec()).collect();
                let mut alone = QActs::default();
                w.quantize(&picked, rows.len(), &mut alone);
                let (mut want, mut got) = (vec![0.0; rows.len() * 16], vec![f32::NAN; rows.len() * 16]);
                qmatmul(&alone, &w, &mut want, rows.len());
                gathered.gather(&all, k, rows);
                qmatmul(&gathered, &w, &mut got, rows.len());
                assert!(want == got, "{dtype}: rows {rows:?}");
            }
        }
    }

    /// Every format against the naive version: dequantize the weights, dequantize the
    /// quantized activations, dot in f64.
    #[test]
    fn matches_dequantize_then_dot_for_every_format() {
        let every = [ActScales::PerHalf, ActScales::PerBlock, ActScales::PerSuper, ActScales::PerRow];
        // Each format under its matrix's activation scales and every coarser kind (as a
        // Q6_K part beside Q4_K reads per-256 scales).
        let cases = TYPES.iter().flat_map(|&dtype| every.iter().map(move |&scales| (dtype, scales)));
        for (dtype, scales) in cases {
            let per = dtype.block().0;
            let (m, n, k) = (5, 19, 2 * per.max(128));
            let raw = random_blocks(dtype, n * k / per, 3);
            let w = QMatrix::new(k, vec![(dtype, n, (&raw[..]).into())]).unwrap();
            if scales < w.act_scales() {
                continue;
            }
            let wf = dequantize(dtype, &raw);
            let x = random_vec(m * k, 4);
            let mut xq = QActs::default();
            quantize_rows(&x, m, k, scales, &mut xq);
            let mut y = vec![0f32; m * n];
            qmatmul(&xq, &w, &mut y, m);
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|c| wf[j * k + c] as f64 * xq.q[i * k + c] as f64 * xq.d[(i * k + c) / QH] as f64)
                        .sum();
                    let got = y[i * n + j] as f64;
                    let close = (got - want).abs() <= 1e-4 * (1.0 + want.abs());
                    assert!(close, "{dtype:?} {scales:?} [{i},{j}] {got} vs {want}");
                }
            }
            // The int8 activations stay close to the f32 ones: within 1 % of the products'
            // magnitude, and within 5 % of their sum, except for IQ4_XS, whose random 6-bit
            // scales take both signs, so that its sum can cancel far below the products.
            let exact: f64 = (0..k).map(|c| wf[c] as f64 * x[c] as f64).sum();
            let size: f64 = (0..k).map(|c| (wf[c] as f64 * x[c] as f64).abs()).sum();
            let err = (y[0] as f64 - exact).abs();
            assert!(err < 0.01 * (1.0 + size), "{dtype:?} {} vs {exact} (of {size})", y[0]);
            assert!(dtype == GgmlType::Iq4Xs || err < 0.05 * (1.0 + exact.abs()), "{dtype:?} {} vs {exact}", y[0]);
        }
    }

    /// Every format at every row count from 0 to past two tiles of either layout (and a
    /// step's worth), every few `k` it allows, and `n` with and without a ragged tail of
    /// rows: each row bit-identical to its result in the largest batch, that batch within
    /// rounding of the naive product, and nothing written past the `m` rows asked for.
    #[test]
    fn every_row_count_and_shape() {
        const M: usize = 2 * TILE + 17;
        for dtype in TYPES {
            let per = dtype.block().0;
            for k in [per, 2 * per, 3 * per] {
                // One row, one group and a ragged tail, and enough groups that the tasks
                // run on the pool.
                for n in [1, x8::GROUP, 2 * x8::GROUP + 3, 24 * x8::GROUP + 3] {
                    let raw = random_blocks(dtype, n * k / per, 21);
                    let w = QMatrix::new(k, vec![(dtype, n, (&raw[..]).into())]).unwrap();
                    let x = random_vec(M * k, 22);
                    let run = |m: usize| {
                        let mut xq = QActs::default();
                        quantize_rows(&x, m, k, w.act_scales(), &mut xq);
                        let mut y = vec![f32::NAN; (m + 1) * n];
                        qmatmul(&xq, &w, &mut y, m);
                        assert!(y[m * n..].iter().all(|v| v.is_nan()), "{dtype:?} m={m}: wrote past its rows");
                        y.truncate(m * n);
                        (y, xq)
                    };
                    let (all, xq) = run(M);
                    let wf = dequantize(dtype, &raw);
                    for (i, j) in (0..M).flat_map(|i| (0..n).map(move |j| (i, j))) {
                        let want: f64 = (0..k)
                            .map(|c| wf[j * k + c] as f64 * xq.q[i * k + c] as f64 * xq.d[(i * k + c) / QH] as f64)
                            .sum();
                        let got = all[i * n + j] as f64;
                        assert!((got - want).abs() <= 1e-4 * (1.0 + want.abs()), "{dtype:?} k={k} n={n} [{i},{j}]");
                    }
                    for m in 0..M {
                        assert_eq!(run(m).0, all[..m * n], "{dtype:?} k={k} n={n} m={m}");
                    }
                }
            }
        }
    }

    /// MXFP4 takes 16-bit activations: through [`QMatrix::quantize`], every row count and
    /// shape (one group, groups paired with VNNI, a ragged tail row by row, pooled tasks)
    /// gives the f32 product with the exactly dequantized weights to within 2e-5 of its
    /// magnitude, a hundred times closer than int8 alone, and each row the same whatever
    /// the batch.
    #[test]
    fn wide_activations_compute_within_float_rounding() {
        let dtype = GgmlType::Mxfp4;
        const M: usize = 11;
        let k = 3 * QB;
        for n in [1, x8::GROUP, 2 * x8::GROUP + 3, 24 * x8::GROUP + 3] {
            let raw = random_blocks(dtype, n * k / QB, 23);
            let w = QMatrix::new(k, vec![(dtype, n, (&raw[..]).into())]).unwrap();
            let x = random_vec(M * k, 24);
            let run = |m: usize, wide: bool| {
                let mut xq = QActs::default();
                if wide {
                    w.quantize(&x, m, &mut xq);
                } else {
                    quantize_rows(&x, m, k, w.act_scales(), &mut xq);
                }
                let mut y = vec![f32::NAN; (m + 1) * n];
                qmatmul(&xq, &w, &mut y, m);
                assert!(y[m * n..].iter().all(|v| v.is_nan()), "n={n} m={m}: wrote past its rows");
                y.truncate(m * n);
                y
            };
            let (wide, narrow) = (run(M, true), run(M, false));
            let wf = dequantize(dtype, &raw);
            let (mut worst_wide, mut worst_narrow) = (0f64, 0f64);
            for (i, j) in (0..M).flat_map(|i| (0..n).map(move |j| (i, j))) {
                let terms = (0..k).map(|c| wf[j * k + c] as f64 * x[i * k + c] as f64);
                let (want, size) = terms.fold((0.0, 0.0), |(s, a), t| (s + t, a + t.abs()));
                worst_wide = worst_wide.max((wide[i * n + j] as f64 - want).abs() / size);
                worst_narrow = worst_narrow.max((narrow[i * n + j] as f64 - want).abs() / size);
            }
            assert!(worst_wide <= 2e-5 && worst_wide * 100.0 <= worst_narrow, "n={n}: {worst_wide} {worst_narrow}");
            for m in 0..M {
                assert_eq!(run(m, true), wide[..m * n], "n={n} m={m}");
            }
        }
    }

    /// An outlier coarsens only its own 16 values: the other half keeps its own scale
    /// (unless the scales are per 256, where the whole run shares it).
    #[test]
    fn each_half_block_has_its_own_scale() {
        let mut x: Vec<f32> = (0..256).map(|i| 0.01 * (i as f32 % 32.0 - 15.5)).collect();
        x[3] = 100.0;
        let mut xq = QActs::default();
        quantize_rows(&x, 1, 256, ActScales::PerSuper, &mut xq);
        assert_eq!(xq.d, [100.0 / 127.0; 16]);
        x.truncate(QB);
        quantize_rows(&x, 1, QB, ActScales::PerBlock, &mut xq);
        assert_eq!(xq.d, [100.0 / 127.0; 2]);
        quantize_rows(&x, 1, QB, ActScales::PerHalf, &mut xq);
        assert_eq!(xq.d[0], 100.0 / 127.0);
        assert_eq!(xq.d[1], 0.155 / 127.0);
        for (i, &v) in x.iter().enumerate().skip(QH) {
            assert!((xq.q[i] as f32 * xq.d[1] - v).abs() <= xq.d[1] / 2.0 + 1e-7, "value {i}");
        }
        let sums: [i32; 2] = std::array::from_fn(|h| xq.q[h * QH..(h + 1) * QH].iter().map(|&q| q as i32).sum());
        assert_eq!(xq.sums, sums);
        assert_eq!(xq.dsum[0], xq.d[0] * sums[0] as f32 + xq.d[1] * sums[1] as f32);
    }

    /// The vector quantizer gives the scalar one's bytes, scales and sums exactly, zero
    /// blocks and rounding ties included.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_quantizer_matches_scalar() {
        if !crate::kernels::matmul::avx2::available() {
            return;
        }
        let mut x = random_vec(64 * QB, 12);
        x[..QH].fill(0.0);
        // A scale of exactly 1 and every other value halfway between two integers.
        x[QH..QB].iter_mut().enumerate().for_each(|(i, v)| *v = i as f32 - 7.5);
        x[QH] = 127.0;
        x[40] = 1e30;
        type Quantizer<'a> = &'a dyn Fn(&[f32], &mut [i8], &mut [f32], &mut [i32], &mut [f32], Runs);
        let run = |f: Quantizer<'_>, runs| {
            let (mut q, mut d, mut s, mut ds) = (vec![0i8; x.len()], vec![0f32; 128], vec![0i32; 128], vec![0f32; 64]);
            f(&x, &mut q, &mut d, &mut s, &mut ds, runs);
            (q, d, s, ds)
        };
        let every = [ActScales::PerHalf, ActScales::PerBlock, ActScales::PerSuper].map(|s| Runs::Halves(s.halves(0)));
        for runs in every.into_iter().chain([Runs::Fixed(2e30)]) {
            // SAFETY: AVX2 was detected above.
            let vector = run(&|x, q, d, s, ds, h| unsafe { avx2::quantize_blocks(x, q, d, s, ds, h) }, runs);
            let (label, scalar) = (format!("{runs:?}"), run(&quantize_blocks, runs));
            assert_eq!(vector, scalar, "{label}");
        }
    }

    /// Per row, every value shares the row's largest magnitude (at least 1e-5, as
    /// BitNet's activation quantizer clamps it), however long the row.
    #[test]
    fn per_row_scales_share_the_row_maximum() {
        let k = 96 * QB;
        let mut x = random_vec(3 * k, 13);
        x[k + 2500] = -40.0;
        x[2 * k..].fill(0.0);
        let mut xq = QActs::default();
        quantize_rows(&x, 3, k, ActScales::PerRow, &mut xq);
        let row_max = |r: usize| x[r * k..(r + 1) * k].iter().fold(0f32, |a, v| a.max(v.abs()));
        let per_row = k / QH;
        for r in 0..3 {
            let want = row_max(r).max(1e-5) / 127.0;
            assert!(xq.d[r * per_row..(r + 1) * per_row].iter().all(|&d| d == want), "row {r}");
        }
        assert_eq!(xq.q[k + 2500], -127);
        assert!(xq.q[2 * k..].iter().all(|&q| q == 0));
        let sums = xq.block_sums();
        assert_eq!(sums.len(), 3 * k / 256);
        assert_eq!(sums[0], xq.q[..256].iter().map(|&q| q as i32).sum::<i32>());
    }

    /// A row's result is bit-identical alone or inside any batch.
    #[test]
    fn rows_are_bit_identical_whatever_the_batch() {
        let short = [GgmlType::Q4_1, GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K, GgmlType::Q8_0]
            .map(|d| (d, 2 * d.block().0.max(64)));
        // Rows so long that one group and its decoded values outgrow a chunk: the paired
        // formats then take two groups a chunk, and a task's last may run alone.
        let long = [(GgmlType::Q4K, 16384), (GgmlType::Q6K, 16384)];
        for (dtype, k) in short.into_iter().chain(long) {
            let per = dtype.block().0;
            // 24 groups and a tail: with a few threads, tasks hold pairs of groups and odd
            // ones ([`x8`]'s paired kernels), and a row-by-row part.
            let n = 8 * 24 + 3;
            let w = QMatrix::new(k, vec![(dtype, n, random_blocks(dtype, n * k / per, 5).into())]).unwrap();
            let x = random_vec(9 * k, 6);
            let run = |rows: &[f32], m: usize| {
                let mut xq = QActs::default();
                quantize_rows(rows, m, k, w.act_scales(), &mut xq);
                let mut y = vec![0f32; m * n];
                qmatmul(&xq, &w, &mut y, m);
                y
            };
            let all = run(&x, 9);
            for i in 0..9 {
                assert_eq!(run(&x[i * k..(i + 1) * k], 1), all[i * n..(i + 1) * n], "{dtype:?} row {i}");
            }
        }
    }

    /// Stacked parts of different formats write their own columns; rows read back.
    #[test]
    fn mixed_parts_and_row_reads() {
        let k = 256;
        let a = random_blocks(GgmlType::Q4K, 3, 8);
        let b = random_blocks(GgmlType::Q6K, 2, 9);
        let w =
            QMatrix::new(k, vec![(GgmlType::Q4K, 3, (&a[..]).into()), (GgmlType::Q6K, 2, (&b[..]).into())]).unwrap();
        let x = random_vec(k, 10);
        let mut xq = QActs::default();
        quantize_rows(&x, 1, k, w.act_scales(), &mut xq);
        let mut y = vec![0f32; 5];
        qmatmul(&xq, &w, &mut y, 1);
        let single = |dtype, raw: Vec<u8>, rows| {
            let mut out = vec![0f32; rows];
            qmatmul(&xq, &QMatrix::new(k, vec![(dtype, rows, raw.into())]).unwrap(), &mut out, 1);
            out
        };
        assert_eq!(y[..3], single(GgmlType::Q4K, a.clone(), 3)[..]);
        assert_eq!(y[3..], single(GgmlType::Q6K, b.clone(), 2)[..]);
        let mut row = vec![0f32; k];
        w.row_into(4, &mut row);
        // Rows of no values are refused, not divided by.
        assert!(QMatrix::new(0, vec![(GgmlType::Q4_0, 8, Vec::new().into())]).is_err());
        assert_eq!(row, dequantize(GgmlType::Q6K, &b[210..]));
    }
}
