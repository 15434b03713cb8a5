//! Attention of the query heads that share one KV head over a sequence's paged K/V.
//!
//! A layer's cache pool is `[num_blocks, kv_heads, block_size, head_dim]` for K and for V; a
//! sequence's position `p` lives in block `block_table[p / block_size]`, slot
//! `p % block_size`, so one head's positions in a block are contiguous. The query heads of a
//! GQA group are processed together, block by block, so each block of K and V is fetched
//! from memory once for all of them. Scores are formed per position and summed over
//! positions in order, so a query's result does not depend on how its prompt was chunked or
//! what else ran in the step. Pools hold f32 or f16: at many sequences decode is bound by
//! reading the cache, and f16 halves those bytes (and the memory a sequence takes).

use super::buffer::Zeroable;
use super::dot::{axpy_lanes, dot_lanes};
use super::exp::exp;

/// An element of the K/V pools, widened to f32 as it is read.
pub trait KvElem: Zeroable + Send + Sync + 'static {
    /// Whether the element is f32 already (its rows need no widening).
    const IS_F32: bool;
    fn from_f32(x: f32) -> Self;
    fn to_f32(self) -> f32;
    /// Eight consecutive elements as f32 (inlined into AVX2+F16C code only).
    ///
    /// # Safety
    /// `p` must point at eight readable elements, and the CPU must have AVX2 and F16C.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

impl KvElem for f32 {
    const IS_F32: bool = true;
    fn from_f32(x: f32) -> Self {
        x
    }
    fn to_f32(self) -> f32 {
        self
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        std::arch::x86_64::_mm256_loadu_ps(p)
    }
}

/// f16, as its bits.
impl KvElem for u16 {
    const IS_F32: bool = false;
    fn from_f32(x: f32) -> Self {
        half::f16::from_f32(x).to_bits()
    }
    fn to_f32(self) -> f32 {
        half::f16::from_bits(self).to_f32()
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const u16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
    }
}

/// One layer's K and V pools, in their element type.
#[derive(Clone, Copy)]
pub enum Pools<'a> {
    F32 { k: &'a [f32], v: &'a [f32] },
    F16 { k: &'a [u16], v: &'a [u16] },
}

/// One layer's K and V pools, viewed for reading.
#[derive(Clone, Copy)]
pub struct PagedKv<'a> {
    pub pools: Pools<'a>,
    pub block_size: usize,
    /// Kv heads in the pools (their stride).
    pub kv_heads: usize,
    pub head_dim: usize,
    /// The kv heads this view reads, `first_head..first_head + view_heads` (all of them
    /// unless narrowed by [`PagedKv::head`]).
    pub first_head: usize,
    pub view_heads: usize,
}

impl<'a> PagedKv<'a> {
    /// The pools of one layer, every kv head in view.
    pub fn new(pools: Pools<'a>, block_size: usize, kv_heads: usize, head_dim: usize) -> Self {
        PagedKv { pools, block_size, kv_heads, head_dim, first_head: 0, view_heads: kv_heads }
    }

    /// This view narrowed to kv head `h` alone, so the heads of one sequence can be
    /// attended in parallel (a decode step has too few rows to keep the cores busy).
    pub fn head(self, h: usize) -> Self {
        PagedKv { first_head: h, view_heads: 1, ..self }
    }

    /// Offset of (position, kv head) in the pools.
    #[inline]
    pub fn offset(&self, block_table: &[u32], pos: usize, kv_head: usize) -> usize {
        let block = block_table[pos / self.block_size] as usize;
        ((block * self.kv_heads + kv_head) * self.block_size + pos % self.block_size) * self.head_dim
    }

    /// Positions `start..end` as runs of consecutive positions, one per block: (offset of
    /// the run's first position for kv head 0, positions in it). Kv head `h` of the run
    /// starts `h * block_size * head_dim` further in.
    fn runs<'t>(&self, block_table: &'t [u32], start: usize, end: usize) -> impl Iterator<Item = (usize, usize)> + 't {
        let (bs, hd, block) = (self.block_size, self.head_dim, self.kv_heads * self.block_size * self.head_dim);
        (start / bs..end.div_ceil(bs)).map(move |i| {
            let first = start.max(i * bs);
            (block_table[i] as usize * block + (first - i * bs) * hd, end.min((i + 1) * bs) - first)
        })
    }
}

/// Where one attention call reads: a sequence's blocks, positions `first_pos..=last_pos`
/// (`first_pos` > 0 under a sliding window).
#[derive(Clone, Copy)]
pub struct KvSpan<'a> {
    pub block_table: &'a [u32],
    pub first_pos: usize,
    pub last_pos: usize,
}

/// How a query-key dot product becomes a score: `dot · scale`, then, with a soft-cap `c`,
/// `c · tanh(score / c)` (Gemma 2).
#[derive(Clone, Copy, Debug)]
pub struct Scoring {
    pub scale: f32,
    pub softcap: Option<f32>,
}

impl Scoring {
    /// The soft-cap over a row of scaled scores (nothing without one).
    fn cap(&self, scores: &mut [f32]) {
        if let Some(c) = self.softcap {
            softcap(scores, c);
        }
    }
}

/// `cap · tanh(x / cap)` over `xs` (Gemma 2's attention scores and final logits).
pub fn softcap(xs: &mut [f32], cap: f32) {
    xs.iter_mut().for_each(|x| *x = (*x / cap).tanh() * cap);
}

/// Reusable buffers for [`attend`].
#[derive(Default)]
pub struct Scratch {
    scores: Vec<f32>,
    /// K or V rows widened to f32: one row on the portable path, one kv head's run of K
    /// on the AVX2 path (widened once for all the query heads that score against it).
    row: Vec<f32>,
    /// The span's runs of positions (the AVX2 path, which fetches them ahead).
    runs: Vec<(usize, usize)>,
}

/// For each query head `h` (`q` and `out` are `[heads, head_dim]`, heads a multiple of the
/// kv heads, head `h` reading kv head `h / (heads / kv_heads)`):
/// `out[h] = softmax(score(q[h]·Kᵀ)) · V` over the span. Blocks are visited in order with
/// every kv head of a block together, so each block's K (and V) is one contiguous read.
pub fn attend(q: &[f32], kv: PagedKv<'_>, span: KvSpan<'_>, scoring: Scoring, scratch: &mut Scratch, out: &mut [f32]) {
    match kv.pools {
        Pools::F32 { k, v } => attend_in(q, k, v, kv, span, scoring, scratch, out),
        Pools::F16 { k, v } => attend_in(q, k, v, kv, span, scoring, scratch, out),
    }
}

/// [`attend`] over pools of `E`.
#[allow(clippy::too_many_arguments)]
fn attend_in<E: KvElem>(
    q: &[f32],
    kp: &[E],
    vp: &[E],
    kv: PagedKv<'_>,
    span: KvSpan<'_>,
    scoring: Scoring,
    scratch: &mut Scratch,
    out: &mut [f32],
) {
    let hd = kv.head_dim;
    assert!(span.first_pos <= span.last_pos, "empty attention span");
    let (start, end) = (span.first_pos, span.last_pos + 1);
    let n = end - start;
    let scale = scoring.scale;
    let Scratch { scores, row, runs } = scratch;
    scores.clear();
    scores.resize(q.len() / hd * n, 0.0);
    #[cfg(target_arch = "x86_64")]
    if hd.is_multiple_of(8) && crate::kernels::matmul::avx2::available() {
        // SAFETY: the CPU supports AVX2, FMA and F16C, and the head dim is a multiple of 8.
        return unsafe { attend_avx2(q, kp, vp, kv, span, scoring, scores, row, runs, out) };
    }
    row.resize(hd, 0.0);
    let widen = |row: &mut [f32], src: &[E]| row.iter_mut().zip(src).for_each(|(r, s)| *r = s.to_f32());
    let group_width = q.len() / kv.view_heads;
    let head_stride = kv.block_size * hd;
    let mut p0 = 0;
    for (base, len) in kv.runs(span.block_table, start, end) {
        for (g, qg) in q.chunks_exact(group_width).enumerate() {
            let kb = base + (kv.first_head + g) * head_stride;
            for j in 0..len {
                widen(row, &kp[kb + j * hd..kb + (j + 1) * hd]);
                for (hh, qh) in qg.chunks_exact(hd).enumerate() {
                    scores[(g * group_width / hd + hh) * n + p0 + j] = dot_lanes(qh, row) * scale;
                }
            }
        }
        p0 += len;
    }
    scoring.cap(scores);
    scores.chunks_exact_mut(n).for_each(softmax);
    out.fill(0.0);
    let mut p0 = 0;
    for (base, len) in kv.runs(span.block_table, start, end) {
        for (g, og) in out.chunks_exact_mut(group_width).enumerate() {
            let vb = base + (kv.first_head + g) * head_stride;
            for j in 0..len {
                widen(row, &vp[vb + j * hd..vb + (j + 1) * hd]);
                for (hh, oh) in og.chunks_exact_mut(hd).enumerate() {
                    axpy_lanes(oh, scores[(g * group_width / hd + hh) * n + p0 + j], row);
                }
            }
        }
        p0 += len;
    }
}

/// AVX2 version. Scores: each kv head's run of K is widened to f32 once and read from L1
/// by every query head of its group, eight positions at a time (eight dot products end in
/// one horizontal-sum tree). The weighted sum of V: each V vector is widened as it is
/// loaded and shared by up to [`MAX_HEADS`] query heads, the sums in registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn attend_avx2<E: KvElem>(
    q: &[f32],
    kp: &[E],
    vp: &[E],
    kv: PagedKv<'_>,
    span: KvSpan<'_>,
    scoring: Scoring,
    scores: &mut [f32],
    widened: &mut Vec<f32>,
    runs: &mut Vec<(usize, usize)>,
    out: &mut [f32],
) {
    let hd = kv.head_dim;
    let (start, end) = (span.first_pos, span.last_pos + 1);
    let n = end - start;
    let group = q.len() / hd / kv.view_heads;
    let head_stride = kv.block_size * hd;
    let kv_heads = kv.first_head..kv.first_head + kv.view_heads;
    runs.clear();
    runs.extend(kv.runs(span.block_table, start, end));
    // Blocks are scattered in the pool, where the hardware prefetcher cannot follow: the
    // runs are fetched `AHEAD` ahead in the order they are read, K's and then V's.
    let fetch = |i: usize| {
        let (pool, i) = if i < runs.len() { (kp, i) } else { (vp, i - runs.len()) };
        if let Some(&(base, len)) = runs.get(i) {
            for kvh in kv_heads.clone() {
                let run = &pool[base + kvh * head_stride..][..len * hd];
                crate::kernels::prefetch_lines(run.as_ptr().cast(), std::mem::size_of_val(run));
            }
        }
    };
    (0..AHEAD).for_each(fetch);
    let mut p0 = 0;
    for (i, &(base, len)) in runs.iter().enumerate() {
        fetch(i + AHEAD);
        let mut kb = std::ptr::null();
        for (h, qh) in q.chunks_exact(hd).enumerate() {
            if h % group == 0 {
                kb = widen_run(&kp[base + (kv.first_head + h / group) * head_stride..][..len * hd], widened);
            }
            score_run(qh, kb, len, hd, scoring.scale, &mut scores[h * n + p0..h * n + p0 + len]);
        }
        p0 += len;
    }
    scoring.cap(scores);
    scores.chunks_exact_mut(n).for_each(softmax);
    let mut p0 = 0;
    for (i, &(base, len)) in runs.iter().enumerate() {
        fetch(runs.len() + i + AHEAD);
        for (g, (h0, heads)) in head_chunks(kv.view_heads, group) {
            let vb = vp.as_ptr().add(base + (kv.first_head + g) * head_stride);
            let (w, o) = (scores.as_ptr().add(h0 * n + p0), out.as_mut_ptr().add(h0 * hd));
            // Each chunk of heads sums as many vectors of V at a time as keep its
            // accumulators, broadcast weights and one V vector within the 16 registers.
            macro_rules! sum_v {
                ($h:literal: $($d:literal)+) => {{
                    let widest = [$($d),+].len();
                    for c0 in (0..hd).step_by(8 * widest) {
                        let args = (w, n, vb.add(c0), hd, len, o.add(c0), i > 0);
                        match ((hd - c0) / 8).min(widest) {
                            $($d => weighted_sum::<E, $h, $d>(args),)+
                            _ => unreachable!("a multiple of 8 dims"),
                        }
                    }
                }};
            }
            match heads {
                1 => sum_v!(1: 1 2 3 4 5 6 7 8),
                2 => sum_v!(2: 1 2 3 4),
                _ => sum_v!(3: 1 2 3),
            }
        }
        p0 += len;
    }
}

/// Runs of K and V fetched ahead of the one being read.
#[cfg(target_arch = "x86_64")]
const AHEAD: usize = 2;
/// Query heads that share each V load: three heads' sums of three V vectors, their
/// broadcast weights and the loaded vectors fit the sixteen AVX2 registers (sums of four
/// vectors for three heads spilled, and ran slower than widening V once per kv head).
#[cfg(target_arch = "x86_64")]
const MAX_HEADS: usize = 3;

/// The query heads in view cut into chunks that share V loads: `(kv head, (first
/// query head, heads))`, each kv head's `group` heads in about even chunks of at most
/// [`MAX_HEADS`].
#[cfg(target_arch = "x86_64")]
fn head_chunks(kv_heads: usize, group: usize) -> impl Iterator<Item = (usize, (usize, usize))> {
    let chunks = group.div_ceil(MAX_HEADS);
    (0..kv_heads).flat_map(move |g| {
        (0..chunks).map(move |c| {
            let (lo, hi) = (c * group / chunks, (c + 1) * group / chunks);
            (g, (g * group + lo, hi - lo))
        })
    })
}

/// `run` (one kv head's rows of a block) as f32: the pool itself when it is f32, else
/// widened into `buf`, so the query heads sharing the kv head read it without converting.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn widen_run<E: KvElem>(run: &[E], buf: &mut Vec<f32>) -> *const f32 {
    use std::arch::x86_64::*;
    if E::IS_F32 {
        return run.as_ptr().cast();
    }
    buf.resize(run.len(), 0.0);
    for (i, dst) in buf.chunks_exact_mut(8).enumerate() {
        _mm256_storeu_ps(dst.as_mut_ptr(), E::load8(run.as_ptr().add(8 * i)));
    }
    buf.as_ptr()
}

/// `row[j] = scale · (qh · K[j])` for the `len` rows of `kb` (`hd` apart), eight rows at a
/// time: eight independent FMA chains, summed together.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn score_run(qh: &[f32], kb: *const f32, len: usize, hd: usize, scale: f32, row: &mut [f32]) {
    use std::arch::x86_64::*;
    for j in (0..len).step_by(8) {
        // Past the run's end the last row repeats; those scores are not kept.
        let rows: [*const f32; 8] = std::array::from_fn(|i| kb.add((j + i).min(len - 1) * hd));
        let mut acc = [_mm256_setzero_ps(); 8];
        for c in (0..hd).step_by(8) {
            let qv = _mm256_loadu_ps(qh.as_ptr().add(c));
            for (a, r) in acc.iter_mut().zip(&rows) {
                *a = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r.add(c)), *a);
            }
        }
        let sums = _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(scale));
        if j + 8 <= len {
            _mm256_storeu_ps(row.as_mut_ptr().add(j), sums);
        } else {
            let mut s = [0f32; 8];
            _mm256_storeu_ps(s.as_mut_ptr(), sums);
            for (r, v) in row[j..].iter_mut().zip(s) {
                *r = v;
            }
        }
    }
}

/// `out_h[..8·D] (+)= Σ_j w[h·n + j] · v[j·hd..][..8·D]` for `H` heads (`out` rows `hd`
/// apart), summed over the `len` positions in order with the accumulators in registers;
/// each V vector is loaded once for the `H` heads.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn weighted_sum<E: KvElem, const H: usize, const D: usize>(
    (w, n, v, hd, len, out, accumulate): (*const f32, usize, *const E, usize, usize, *mut f32, bool),
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm256_setzero_ps(); D]; H];
    if accumulate {
        for (h, acc) in acc.iter_mut().enumerate() {
            for (d, a) in acc.iter_mut().enumerate() {
                *a = _mm256_loadu_ps(out.add(h * hd + 8 * d));
            }
        }
    }
    for j in 0..len {
        let wj: [__m256; H] = std::array::from_fn(|h| _mm256_set1_ps(*w.add(h * n + j)));
        let row = v.add(j * hd);
        let xs: [__m256; D] = std::array::from_fn(|d| E::load8(row.add(8 * d)));
        for (acc, w) in acc.iter_mut().zip(&wj) {
            for (a, x) in acc.iter_mut().zip(&xs) {
                *a = _mm256_fmadd_ps(*w, *x, *a);
            }
        }
    }
    for (h, acc) in acc.iter().enumerate() {
        for (d, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(out.add(h * hd + 8 * d), *a);
        }
    }
}

/// The sums of eight vectors, each added as ((0+1)+(2+3)) + ((4+5)+(6+7)).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn hsum8(a: [std::arch::x86_64::__m256; 8]) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let lo = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    let hi = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(lo, hi), _mm256_permute2f128_ps::<0x31>(lo, hi))
}

/// A row of scores becomes its softmax.
fn softmax(row: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::matmul::avx2::available() {
        // SAFETY: the CPU supports AVX2 and FMA.
        return unsafe { softmax_avx2(row) };
    }
    let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for s in row.iter_mut() {
        *s = exp(*s - max);
        sum += *s;
    }
    let inv = 1.0 / sum;
    row.iter_mut().for_each(|s| *s *= inv);
}

/// [`softmax`] with eight lanes of exponentials and partial sums.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_avx2(row: &mut [f32]) {
    use super::exp::avx2;
    use std::arch::x86_64::*;
    let n8 = row.len() / 8 * 8;
    let p = row.as_mut_ptr();
    let mut mv = _mm256_set1_ps(f32::NEG_INFINITY);
    for i in (0..n8).step_by(8) {
        mv = _mm256_max_ps(mv, _mm256_loadu_ps(p.add(i)));
    }
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), mv);
    let max = lanes.iter().chain(&row[n8..]).cloned().fold(f32::NEG_INFINITY, f32::max);
    let (maxv, mut sv) = (_mm256_set1_ps(max), _mm256_setzero_ps());
    for i in (0..n8).step_by(8) {
        let e = avx2::exp(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), maxv));
        _mm256_storeu_ps(p.add(i), e);
        sv = _mm256_add_ps(sv, e);
    }
    _mm256_storeu_ps(lanes.as_mut_ptr(), sv);
    let mut sum = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
    for s in &mut row[n8..] {
        *s = exp(*s - max);
        sum += *s;
    }
    let inv = _mm256_set1_ps(1.0 / sum);
    for i in (0..n8).step_by(8) {
        _mm256_storeu_ps(p.add(i), _mm256_mul_ps(_mm256_loadu_ps(p.add(i)), inv));
    }
    for s in &mut row[n8..] {
        *s *= 1.0 / sum;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::{assert_close, random_vec};

    /// Head dims that are a multiple of 8 take the AVX2 path (where available); others the
    /// portable one. Both must match the naive computation.
    #[test]
    fn matches_naive_over_scattered_blocks() {
        check_against_naive(6, 3);
        // The AVX2 path's head chunks (1; 3; 2 + 2; 2 + 2 + 3) and its passes over V's
        // vectors (2; 5 as 5, 4 + 1 or 3 + 2; 9 as 8 + 1, 4 + 4 + 1 or 3 + 3 + 3).
        for group in [1, 3, 4, 7] {
            for hd in [16, 40, 72] {
                check_against_naive(hd, group);
            }
        }
    }

    fn check_against_naive(hd: usize, group: usize) {
        let (bs, kvh, blocks) = (4, 2, 8);
        let k = random_vec(blocks * bs * kvh * hd, 1);
        let v = random_vec(blocks * bs * kvh * hd, 2);
        let kv = PagedKv::new(Pools::F32 { k: &k, v: &v }, bs, kvh, hd);
        let table = [5u32, 0, 7, 2];
        let heads = kvh * group;
        let q = random_vec(heads * hd, 3);
        let scale = 0.4f32;
        let spans = [(0, 0), (0, 3), (0, 13), (0, 15), (2, 13), (4, 15), (9, 9), (5, 11)];
        for ((first, last), softcap) in spans.into_iter().zip([None, Some(1.5)].into_iter().cycle()) {
            let mut out = vec![0f32; heads * hd];
            let span = KvSpan { block_table: &table, first_pos: first, last_pos: last };
            attend(&q, kv, span, Scoring { scale, softcap }, &mut Scratch::default(), &mut out);
            // One kv head at a time gives the same heads, bit for bit.
            for (g, (qg, og)) in q.chunks(group * hd).zip(out.chunks(group * hd)).enumerate() {
                let mut one = vec![0f32; group * hd];
                attend(qg, kv.head(g), span, Scoring { scale, softcap }, &mut Scratch::default(), &mut one);
                assert_eq!(one, og, "kv head {g} alone");
            }

            let at = |pool: &[f32], p: usize, g: usize| {
                let o = ((table[p / bs] as usize * kvh + g) * bs + p % bs) * hd;
                pool[o..o + hd].to_vec()
            };
            for h in 0..heads {
                let (qh, g) = (&q[h * hd..(h + 1) * hd], h / group);
                let s: Vec<f64> = (first..=last)
                    .map(|p| at(&k, p, g).iter().zip(qh).map(|(a, b)| (*a * *b) as f64).sum::<f64>() * scale as f64)
                    .map(|x| softcap.map_or(x, |c| (x / c as f64).tanh() * c as f64))
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                let mut want = vec![0f64; hd];
                for (p, ep) in (first..).zip(&e) {
                    for (w, vv) in want.iter_mut().zip(at(&v, p, g)) {
                        *w += ep / z * vv as f64;
                    }
                }
                let want: Vec<f32> = want.into_iter().map(|x| x as f32).collect();
                assert_close(&out[h * hd..(h + 1) * hd], &want, 1e-5, &format!("hd {hd} {first}..={last} head {h}"));
            }
        }
    }

    /// f16 pools give what f32 pools holding the same (f16-rounded) values give, on the
    /// AVX2 path and the portable one.
    #[test]
    fn f16_pools_read_as_their_values() {
        for hd in [6, 16, 64] {
            let (bs, kvh, blocks, group) = (4, 2, 8, 3);
            let round = |x: Vec<f32>| -> (Vec<u16>, Vec<f32>) {
                let h: Vec<u16> = x.iter().map(|&x| u16::from_f32(x)).collect();
                let f = h.iter().map(|&b| b.to_f32()).collect();
                (h, f)
            };
            let (k16, k32) = round(random_vec(blocks * bs * kvh * hd, 4));
            let (v16, v32) = round(random_vec(blocks * bs * kvh * hd, 5));
            let q = random_vec(kvh * group * hd, 6);
            let table = [3u32, 6, 1, 4];
            for (first, last) in [(0, 0), (0, 15), (3, 12)] {
                let span = KvSpan { block_table: &table, first_pos: first, last_pos: last };
                let scoring = Scoring { scale: 0.3, softcap: None };
                let run = |pools| {
                    let mut out = vec![0f32; q.len()];
                    attend(&q, PagedKv::new(pools, bs, kvh, hd), span, scoring, &mut Scratch::default(), &mut out);
                    out
                };
                let (half, full) = (run(Pools::F16 { k: &k16, v: &v16 }), run(Pools::F32 { k: &k32, v: &v32 }));
                assert_eq!(half, full, "hd {hd} {first}..={last}");
            }
        }
    }

    #[test]
    fn runs_walk_blocks_in_position_order() {
        let kv = PagedKv::new(Pools::F32 { k: &[], v: &[] }, 2, 3, 4);
        let table = [4u32, 1, 6];
        for (start, end) in [(0, 3), (1, 3), (2, 6), (3, 5), (5, 6)] {
            let got: Vec<usize> = kv
                .runs(&table, start, end)
                .flat_map(|(base, len)| (0..len).map(move |j| base + 2 * 2 * 4 + j * 4))
                .collect();
            let want: Vec<usize> = (start..end).map(|p| kv.offset(&table, p, 2)).collect();
            assert_eq!(got, want, "{start}..{end}");
        }
    }

    #[test]
    fn softmax_sums_to_one_and_keeps_order() {
        for n in [1, 7, 8, 19] {
            let mut row: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 5.0).collect();
            let before = row.clone();
            softmax(&mut row);
            assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-5, "n {n}");
            let m = before.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let z: f64 = before.iter().map(|x| ((x - m) as f64).exp()).sum();
            for (got, x) in row.iter().zip(&before) {
                let want = ((x - m) as f64).exp() / z;
                assert!((*got as f64 - want).abs() < 1e-6, "n {n}: {got} vs {want}");
            }
        }
    }
}
