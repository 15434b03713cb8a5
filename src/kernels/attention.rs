//! Attention of the query heads that share one KV head over a sequence's paged K/V.
//!
//! A layer's cache pools hold, per block and kv head, a *slab* of `block_size` positions: V
//! position-major (`[block_size, head_dim]`, a row per position, read as rows weighted by
//! the scores) and K dim-major (`[head_dim, block_size]`, so eight positions' values of one
//! dim are one vector and eight scores come from one chain of multiply-adds, with no
//! horizontal sums). A sequence's position `p` lives in block `block_table[p / block_size]`,
//! slot `p % block_size`. The query heads of a GQA group are processed together, block by
//! block, so each block of K and V is fetched from memory once for all of them. Scores are
//! formed per position and summed over positions in order, so a query's result does not
//! depend on how its prompt was chunked or what else ran in the step. Pools hold f32, f16,
//! FP8 E4M3 or int8 with a scale per row: at many sequences decode is bound by reading the
//! cache, and each narrower element halves those bytes (and the memory a sequence takes).

use super::buffer::Zeroable;
use super::dot::{axpy_lanes, dot_chains};
use super::exp::exp;
use super::fp8::E4M3;

/// An element of the K/V pools, widened to f32 as it is read.
pub trait KvElem: Zeroable + Send + Sync + 'static {
    /// Whether each row (one position's values of one kv head) is stored divided by a
    /// scale of its own, kept beside the pools ([`RowScales`]).
    const SCALED: bool = false;
    /// The scale a row is stored with (1 where elements are not scaled).
    fn row_scale(_row: &[f32]) -> f32 {
        1.0
    }
    /// `src`, part of a row of scale `scale`, narrowed into `dst` (of the same length),
    /// rounding to nearest.
    fn narrow(src: &[f32], dst: &mut [Self], scale: f32);
    fn to_f32(self) -> f32;
    /// Eight consecutive elements as f32 (inlined into AVX2+F16C code only).
    ///
    /// # Safety
    /// `p` must point at eight readable elements, and the CPU must have AVX2 and F16C.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
    /// Sixteen consecutive elements as f32 (inlined into AVX-512F code only).
    ///
    /// # Safety
    /// `p` must point at sixteen readable elements, and the CPU must have AVX-512F.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
}

impl KvElem for f32 {
    fn narrow(src: &[f32], dst: &mut [f32], _scale: f32) {
        dst.copy_from_slice(src);
    }
    fn to_f32(self) -> f32 {
        self
    }
    /// # Safety
    /// AVX2 and F16C must be available, and `p` hold eight values.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }
    /// # Safety
    /// AVX-512F must be available, and `p` hold sixteen values.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> std::arch::x86_64::__m512 {
        unsafe { std::arch::x86_64::_mm512_loadu_ps(p) }
    }
}

/// f16, as its bits.
impl KvElem for u16 {
    /// In vectors (F16C where the CPU has it): one by one it is a call per value.
    fn narrow(src: &[f32], dst: &mut [u16], _scale: f32) {
        use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
        dst.reinterpret_cast_mut::<half::f16>().convert_from_f32_slice(src);
    }
    fn to_f32(self) -> f32 {
        half::f16::from_bits(self).to_f32()
    }
    /// # Safety
    /// AVX2 and F16C must be available, and `p` hold eight values.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const u16) -> std::arch::x86_64::__m256 {
        unsafe {
            use std::arch::x86_64::*;
            _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
        }
    }
    /// # Safety
    /// AVX-512F must be available, and `p` hold sixteen values.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const u16) -> std::arch::x86_64::__m512 {
        unsafe {
            use std::arch::x86_64::*;
            _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
        }
    }
}

/// FP8 E4M3, widened exactly.
impl KvElem for E4M3 {
    fn narrow(src: &[f32], dst: &mut [E4M3], _scale: f32) {
        E4M3::narrow(src, dst)
    }
    fn to_f32(self) -> f32 {
        E4M3::to_f32(self)
    }
    /// # Safety
    /// AVX2 must be available, and `p` hold eight values.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const E4M3) -> std::arch::x86_64::__m256 {
        unsafe { E4M3::load8(p) }
    }
    /// # Safety
    /// AVX-512F must be available, and `p` hold sixteen values.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const E4M3) -> std::arch::x86_64::__m512 {
        unsafe { E4M3::load16(p) }
    }
}

/// int8, each row over its absmax / 127 (the row's scale): rounding errors of at most half
/// a step of its largest value; on SmolLM2, a quarter of FP8's KL divergence from an f16
/// cache.
impl KvElem for i8 {
    const SCALED: bool = true;
    fn row_scale(row: &[f32]) -> f32 {
        row.iter().fold(0f32, |m, x| m.max(x.abs())) / 127.0
    }
    /// (`as` saturates, and takes NaN to 0.)
    fn narrow(src: &[f32], dst: &mut [i8], scale: f32) {
        let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        dst.iter_mut().zip(src).for_each(|(d, &x)| *d = super::round_small(x * inv) as i8);
    }
    fn to_f32(self) -> f32 {
        self as f32
    }
    /// # Safety
    /// AVX2 must be available, and `p` hold eight values.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const i8) -> std::arch::x86_64::__m256 {
        unsafe {
            use std::arch::x86_64::*;
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast())))
        }
    }
    /// # Safety
    /// AVX-512F must be available, and `p` hold sixteen values.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const i8) -> std::arch::x86_64::__m512 {
        unsafe {
            use std::arch::x86_64::*;
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast())))
        }
    }
}

/// One layer's K and V pools, in their element type.
#[derive(Clone, Copy)]
pub enum Pools<'a> {
    F32 { k: &'a [f32], v: &'a [f32] },
    F16 { k: &'a [u16], v: &'a [u16] },
    Fp8 { k: &'a [E4M3], v: &'a [E4M3] },
    Int8 { k: &'a [i8], v: &'a [i8], scales: RowScales<'a> },
}

impl<'a> Pools<'a> {
    /// The rows' scales of scaled pools.
    pub fn scales(&self) -> Option<RowScales<'a>> {
        match *self {
            Pools::Int8 { scales, .. } => Some(scales),
            _ => None,
        }
    }
}

/// The scales of scaled pools' rows: one per (block, kv head, slot), in that order, so a
/// slab at element `o` has its slots' scales from `o / head_dim`.
#[derive(Clone, Copy)]
pub struct RowScales<'a> {
    pub k: &'a [f32],
    pub v: &'a [f32],
}

impl RowScales<'_> {
    /// The index of the scale of `slot` in the slab that starts at pool element `slab`.
    #[inline(always)]
    pub fn index(slab: usize, head_dim: usize, slot: usize) -> usize {
        slab / head_dim + slot
    }
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
    /// unless narrowed by [`PagedKv::heads`]).
    pub first_head: usize,
    pub view_heads: usize,
}

impl<'a> PagedKv<'a> {
    /// The pools of one layer, every kv head in view.
    pub fn new(pools: Pools<'a>, block_size: usize, kv_heads: usize, head_dim: usize) -> Self {
        PagedKv { pools, block_size, kv_heads, head_dim, first_head: 0, view_heads: kv_heads }
    }

    /// This view narrowed to kv heads `first..first + count`: one, so that the heads of a
    /// sequence can be attended in parallel when a step has too few rows to keep the
    /// cores busy.
    pub fn heads(self, first: usize, count: usize) -> Self {
        PagedKv { first_head: first, view_heads: count, ..self }
    }

    /// Where (position, kv head) lives: the offset of its slab in the pools and its slot.
    /// Its V row starts at `slab + slot · head_dim`, its K value of dim `d` is at
    /// `slab + d · block_size + slot`.
    #[inline]
    pub fn slab(&self, block_table: &[u32], pos: usize, kv_head: usize) -> (usize, usize) {
        let block = block_table[pos / self.block_size] as usize;
        ((block * self.kv_heads + kv_head) * self.block_size * self.head_dim, pos % self.block_size)
    }

    /// Positions `start..end` as runs of consecutive positions, one per block: (kv head 0's
    /// slab, first slot, positions). Kv head `h`'s slab is `h · block_size · head_dim`
    /// further in.
    fn runs<'t>(
        &self,
        block_table: &'t [u32],
        start: usize,
        end: usize,
    ) -> impl Iterator<Item = (usize, usize, usize)> + 't {
        let (bs, block) = (self.block_size, self.kv_heads * self.block_size * self.head_dim);
        (start / bs..end.div_ceil(bs)).map(move |i| {
            let first = start.max(i * bs);
            (block_table[i] as usize * block, first - i * bs, end.min((i + 1) * bs) - first)
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
/// `c · tanh(score / c)` (Gemma 2); and with sinks, one learned logit per query head that
/// joins the softmax's denominator and takes its share of the weight to nothing (gpt-oss).
#[derive(Clone, Copy, Debug, Default)]
pub struct Scoring<'a> {
    pub scale: f32,
    pub softcap: Option<f32>,
    /// Per query head of the call, in order.
    pub sinks: Option<&'a [f32]>,
}

impl Scoring<'_> {
    /// Each head's row of scores turned into weights.
    fn softmax(&self, scores: &mut [f32], n: usize) {
        for (h, row) in scores.chunks_exact_mut(n).enumerate() {
            softmax(row, self.sinks.map(|s| s[h]));
        }
    }

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
    /// A K or V row widened to f32 (the portable path).
    row: Vec<f32>,
    /// The span's runs of positions (the AVX2 path, which fetches them ahead).
    runs: Vec<(usize, usize, usize)>,
}

/// For each query head `h` (`q` and `out` are `[heads, head_dim]`, heads a multiple of the
/// kv heads, head `h` reading kv head `h / (heads / kv_heads)`):
/// `out[h] = softmax(score(q[h]·Kᵀ)) · V` over the span. Blocks are visited in order with
/// every kv head of a block together, so each block's K (and V) is one contiguous read.
pub fn attend(q: &[f32], kv: PagedKv<'_>, span: KvSpan<'_>, scoring: Scoring, scratch: &mut Scratch, out: &mut [f32]) {
    match kv.pools {
        Pools::F32 { k, v } => attend_in(q, k, v, kv, span, scoring, scratch, out),
        Pools::F16 { k, v } => attend_in(q, k, v, kv, span, scoring, scratch, out),
        Pools::Fp8 { k, v } => attend_in(q, k, v, kv, span, scoring, scratch, out),
        Pools::Int8 { k, v, .. } => attend_in(q, k, v, kv, span, scoring, scratch, out),
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
    let n = span.last_pos + 1 - span.first_pos;
    let Scratch { scores, row, runs } = scratch;
    scores.clear();
    scores.resize(q.len() / hd * n, 0.0);
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::matmul::avx2::available() {
        if hd.is_multiple_of(8) && kv.block_size.is_multiple_of(8) {
            // SAFETY: the CPU supports AVX2, FMA and F16C; the head dim and block size are
            // multiples of 8.
            return unsafe {
                if crate::kernels::matmul::avx2::wide() {
                    attend_avx512(q, kp, vp, kv, span, scoring, scores, runs, out)
                } else {
                    attend_avx2(q, kp, vp, kv, span, scoring, scores, runs, out)
                }
            };
        }
        // SAFETY: the CPU supports FMA.
        return unsafe { attend_portable_fma(q, kp, vp, kv, span, scoring, scores, row, out) };
    }
    attend_portable(q, kp, vp, kv, span, scoring, scores, row, out)
}

/// [`attend_portable`] compiled with fused multiply-adds in hardware (its `mul_add`s are
/// otherwise calls into libm).
///
/// # Safety
/// The CPU must support FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn attend_portable_fma<E: KvElem>(
    q: &[f32],
    kp: &[E],
    vp: &[E],
    kv: PagedKv<'_>,
    span: KvSpan<'_>,
    scoring: Scoring,
    scores: &mut [f32],
    row: &mut Vec<f32>,
    out: &mut [f32],
) {
    attend_portable(q, kp, vp, kv, span, scoring, scores, row, out)
}

/// [`attend`] in plain code, with the AVX2 path's order of operations: any head dim and
/// block size, the same bits.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn attend_portable<E: KvElem>(
    q: &[f32],
    kp: &[E],
    vp: &[E],
    kv: PagedKv<'_>,
    span: KvSpan<'_>,
    scoring: Scoring,
    scores: &mut [f32],
    row: &mut Vec<f32>,
    out: &mut [f32],
) {
    let hd = kv.head_dim;
    let (start, end) = (span.first_pos, span.last_pos + 1);
    let n = end - start;
    let scale = scoring.scale;
    row.resize(hd, 0.0);
    let widen = |row: &mut [f32], src: &[E]| row.iter_mut().zip(src).for_each(|(r, s)| *r = s.to_f32());
    let group_width = q.len() / kv.view_heads;
    let (bs, head_stride) = (kv.block_size, kv.block_size * hd);
    let group = group_width / hd;
    let scales = kv.pools.scales();
    let mut p0 = 0;
    for (base, slot, len) in kv.runs(span.block_table, start, end) {
        for g in 0..kv.view_heads {
            let slab = base + (kv.first_head + g) * head_stride;
            let (kb, ks) = (slab + slot, scales.map(|s| &s.k[RowScales::index(slab, hd, slot)..][..len]));
            for j in 0..len {
                row.iter_mut().enumerate().for_each(|(d, r)| *r = kp[kb + d * bs + j].to_f32());
                // Each query head's score in the chains of its head chunk on the AVX2 path,
                // so that a block size or head dim this path serves gives that path's bits.
                for (_, (first, heads)) in head_chunks(1, group, MAX_HEADS) {
                    let chains = score_chains(heads);
                    for h in g * group + first..g * group + first + heads {
                        let dot = dot_chains(&q[h * hd..(h + 1) * hd], row, chains);
                        scores[h * n + p0 + j] = ks.map_or(dot, |ks| dot * ks[j]) * scale;
                    }
                }
            }
        }
        p0 += len;
    }
    scoring.cap(scores);
    scoring.softmax(scores, n);
    if let Some(s) = scales {
        weigh_by_row_scales(scores, n, kv, span, s.v, group);
    }
    out.fill(0.0);
    let mut p0 = 0;
    for (base, slot, len) in kv.runs(span.block_table, start, end) {
        for (g, og) in out.chunks_exact_mut(group_width).enumerate() {
            let vb = base + (kv.first_head + g) * head_stride + slot * hd;
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

/// AVX2 version: K and V are widened from the pools as they are loaded, each load shared
/// by a chunk of up to [`MAX_HEADS`] query heads of its group. Scores come sixteen slots
/// at a time from K's dim-major slabs, one lane per slot, so no horizontal sums; the
/// weighted sum of V keeps its sums in registers. With `ZMM` (512-bit FMAs, `attend_avx512`),
/// sixteen slots and sixteen dims of V take one register: each lane the same chain, so
/// the same bits.
///
/// # Safety
/// AVX2, FMA and F16C must be available, and AVX-512F with `ZMM`; the slices are those
/// [`attend`] checked.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn attend_simd<E: KvElem, const ZMM: bool>(
    q: &[f32],
    kp: &[E],
    vp: &[E],
    kv: PagedKv<'_>,
    span: KvSpan<'_>,
    scoring: Scoring,
    scores: &mut [f32],
    runs: &mut Vec<(usize, usize, usize)>,
    out: &mut [f32],
) {
    unsafe {
        let hd = kv.head_dim;
        let (start, end) = (span.first_pos, span.last_pos + 1);
        let n = end - start;
        let group = q.len() / hd / kv.view_heads;
        let (bs, head_stride) = (kv.block_size, kv.block_size * hd);
        let kv_heads = kv.first_head..kv.first_head + kv.view_heads;
        // (Four heads only where their V sums run sixteen dims a register.)
        let max_heads = if ZMM && hd.is_multiple_of(16) { MAX_HEADS_ZMM } else { MAX_HEADS };
        runs.clear();
        runs.extend(kv.runs(span.block_table, start, end));
        // Blocks are scattered in the pool, where the hardware prefetcher cannot follow: each
        // kv head's slab of a run (K's whole and dim-major, then V's rows) asks for the same
        // kv head's slab `ahead` runs on into L2 as it is read, so the asks spread over the
        // work.
        let ahead = (AHEAD / kv.view_heads).max(1);
        let scales = kv.pools.scales();
        let fetch = |i: usize, kvh: usize| {
            let (pool, i, whole) = if i < runs.len() { (kp, i, true) } else { (vp, i - runs.len(), false) };
            if let Some(&(base, slot, len)) = runs.get(i) {
                let slab = &pool[base + kvh * head_stride..][..head_stride];
                let run = if whole { slab } else { &slab[slot * hd..(slot + len) * hd] };
                crate::kernels::prefetch_lines_l2(run.as_ptr().cast(), std::mem::size_of_val(run));
                if let Some(s) = scales {
                    let row =
                        &(if whole { s.k } else { s.v })[RowScales::index(base + kvh * head_stride, hd, 0)..][..bs];
                    crate::kernels::prefetch_lines_l2(row.as_ptr().cast(), std::mem::size_of_val(row));
                }
            }
        };
        (0..ahead).for_each(|i| kv_heads.clone().for_each(|kvh| fetch(i, kvh)));
        let mut p0 = 0;
        for (i, &(base, slot, len)) in runs.iter().enumerate() {
            for (g, (h0, heads)) in head_chunks(kv.view_heads, group, max_heads) {
                // A kv head's first chunk asks for its slab.
                if h0 == g * group {
                    fetch(i + ahead, kv.first_head + g);
                }
                let slab = base + (kv.first_head + g) * head_stride;
                let kb = kp.as_ptr().add(slab);
                // Sixteen slots at a time (eight at a block's end) from the eight holding the
                // run's first, every slot's score formed alike; those outside the run are not
                // kept.
                let mut s0 = slot / 8 * 8;
                while s0 < slot + len {
                    let mut got = [[0f32; 16]; MAX_HEADS_ZMM];
                    let ks = scales.map(|s| s.k[RowScales::index(slab, hd, s0)..].as_ptr());
                    let args = (q.as_ptr().add(h0 * hd), hd, kb.add(s0), bs, ks, scoring.scale, &mut got);
                    let wide = s0 + 16 <= bs;
                    const {
                        assert!(
                            score_chains(1) == 4
                                && score_chains(2) == 2
                                && score_chains(3) == 2
                                && score_chains(4) == 2
                        )
                    };
                    match (heads, wide) {
                        (1, true) if ZMM => score_slots16::<E, 1, 4>(args),
                        (2, true) if ZMM => score_slots16::<E, 2, 2>(args),
                        (3, true) if ZMM => score_slots16::<E, 3, 2>(args),
                        (_, true) if ZMM => score_slots16::<E, 4, 2>(args),
                        (1, true) => score_slots::<E, 1, 4, 2>(args),
                        (1, false) => score_slots::<E, 1, 4, 1>(args),
                        (2, true) => score_slots::<E, 2, 2, 2>(args),
                        (2, false) => score_slots::<E, 2, 2, 1>(args),
                        (_, true) => score_slots::<E, 3, 2, 2>(args),
                        (3, false) => score_slots::<E, 3, 2, 1>(args),
                        // Four heads only with 512-bit steps, at a block's last eight slots.
                        (_, false) => score_slots::<E, 4, 2, 1>(args),
                    }
                    let s1 = s0 + if wide { 16 } else { 8 };
                    let keep = s0.max(slot)..s1.min(slot + len);
                    for (h, got) in got.iter().enumerate().take(heads) {
                        let at = (h0 + h) * n + p0 + keep.start - slot;
                        scores[at..at + keep.len()].copy_from_slice(&got[keep.start - s0..keep.end - s0]);
                    }
                    s0 = s1;
                }
            }
            p0 += len;
        }
        scoring.cap(scores);
        scoring.softmax(scores, n);
        if let Some(s) = scales {
            weigh_by_row_scales(scores, n, kv, span, s.v, group);
        }
        let mut p0 = 0;
        for (i, &(base, slot, len)) in runs.iter().enumerate() {
            for (g, (h0, heads)) in head_chunks(kv.view_heads, group, max_heads) {
                if h0 == g * group {
                    fetch(runs.len() + i + ahead, kv.first_head + g);
                }
                let vb = vp.as_ptr().add(base + (kv.first_head + g) * head_stride + slot * hd);
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
                // Sixteen dims a register where 512-bit FMAs run, up to four registers a head
                // per pass (64 dims).
                macro_rules! sum_v16 {
                    ($h:literal) => {{
                        for c0 in (0..hd).step_by(64) {
                            let args = (w, n, vb.add(c0), hd, len, o.add(c0), i > 0);
                            match (hd - c0) / 16 {
                                1 => weighted_sum16::<E, $h, 1>(args),
                                2 => weighted_sum16::<E, $h, 2>(args),
                                3 => weighted_sum16::<E, $h, 3>(args),
                                _ => weighted_sum16::<E, $h, 4>(args),
                            }
                        }
                    }};
                }
                match heads {
                    1 if ZMM && hd.is_multiple_of(16) => sum_v16!(1),
                    2 if ZMM && hd.is_multiple_of(16) => sum_v16!(2),
                    3 if ZMM && hd.is_multiple_of(16) => sum_v16!(3),
                    _ if ZMM && hd.is_multiple_of(16) => sum_v16!(4),
                    1 => sum_v!(1: 1 2 3 4 5 6 7 8),
                    2 => sum_v!(2: 1 2 3 4),
                    _ => sum_v!(3: 1 2 3),
                }
            }
            p0 += len;
        }
    }
}

/// [`attend_simd`] compiled twice: `attend_avx2` on 256-bit registers, `attend_avx512`
/// with its sixteen-lane steps in 512-bit ones.
///
/// # Safety
/// Each twin needs the features it is compiled with; the slices are those [`attend`]
/// checked.
macro_rules! attend_twins {
    ($($name:ident: $features:literal, $zmm:literal;)+) => {$(
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        #[allow(clippy::too_many_arguments)]
        unsafe fn $name<E: KvElem>(
            q: &[f32],
            kp: &[E],
            vp: &[E],
            kv: PagedKv<'_>,
            span: KvSpan<'_>,
            scoring: Scoring,
            scores: &mut [f32],
            runs: &mut Vec<(usize, usize, usize)>,
            out: &mut [f32],
        ) {
            // SAFETY: the caller's, as this function's.
            unsafe { attend_simd::<E, $zmm>(q, kp, vp, kv, span, scoring, scores, runs, out) }
        }
    )+};
}
attend_twins! {
    attend_avx2: "avx2,fma,f16c", false;
    attend_avx512: "avx2,fma,f16c,avx512f", true;
}

/// Slabs (a kv head's K or V in one block) fetched ahead of the one being read, in whole
/// runs: one run ahead for eight kv heads, eight for one.
#[cfg(target_arch = "x86_64")]
const AHEAD: usize = 8;
/// Query heads that share each K and V load: three heads' sums (twelve chains of scores,
/// or three V vectors each), their broadcasts and the loaded vectors fit the sixteen AVX2
/// registers (sums of four V vectors for three heads spilled, and ran slower).
const MAX_HEADS: usize = 3;
/// With 512-bit FMAs the 32 registers hold four heads' sums (sixteen V vectors, eight
/// chains of scores): a group of four (Llama 3, 1B to 8B) reads its K and V once.
const MAX_HEADS_ZMM: usize = 4;

/// Chains of multiply-adds a score is formed in when `heads` query heads share each K load:
/// four for one head, two for more (their sums then fill the registers).
const fn score_chains(heads: usize) -> usize {
    if heads == 1 {
        4
    } else {
        2
    }
}

/// The query heads in view cut into chunks that share K and V loads: `(kv head, (first
/// query head, heads))`, each kv head's `group` heads in about even chunks of at most
/// `max`. Every chunk of a group of two or more holds two or more heads, so its scores
/// take [`score_chains`]`(2)` whatever `max` is: the paths cut groups differently and
/// give the same bits.
fn head_chunks(kv_heads: usize, group: usize, max: usize) -> impl Iterator<Item = (usize, (usize, usize))> {
    let chunks = group.div_ceil(max);
    (0..kv_heads).flat_map(move |g| {
        (0..chunks).map(move |c| {
            let (lo, hi) = (c * group / chunks, (c + 1) * group / chunks);
            (g, (g * group + lo, hi - lo))
        })
    })
}

/// A scoring call's operands: `H` heads' queries, the head dim, the first slot's K in its
/// slab, the block size, the slots' row scales (scaled pools), the score scale and room
/// for the scores.
#[cfg(target_arch = "x86_64")]
type ScoreArgs<'o, E> =
    (*const f32, usize, *const E, usize, Option<*const f32>, f32, &'o mut [[f32; 16]; MAX_HEADS_ZMM]);

/// Scaled pools: each query head's weights times its kv head's V row scales, so that V's
/// rows are summed as stored. The same multiplies on every path.
fn weigh_by_row_scales(
    scores: &mut [f32],
    n: usize,
    kv: PagedKv<'_>,
    span: KvSpan<'_>,
    v_scales: &[f32],
    group: usize,
) {
    let head_stride = kv.block_size * kv.head_dim;
    let mut p0 = 0;
    for (base, slot, len) in kv.runs(span.block_table, span.first_pos, span.last_pos + 1) {
        for g in 0..kv.view_heads {
            let vs = &v_scales[RowScales::index(base + (kv.first_head + g) * head_stride, kv.head_dim, slot)..][..len];
            for h in g * group..(g + 1) * group {
                scores[h * n + p0..][..len].iter_mut().zip(vs).for_each(|(w, s)| *w *= s);
            }
        }
        p0 += len;
    }
}

/// `out[h][i] = scale · (q_h · K[slot i])` (the dot product times the slot's row scale,
/// if any) for `H` heads (`q` `[H, hd]`) and the `8·S` slots from `k` of a dim-major slab
/// (`bs` apart per dim): `S` vectors of eight slots per dim, each loaded once for the `H`
/// heads. Dims are taken in `C` interleaved chains (dim `d` into chain `d mod C`), added in
/// order at the end, so the multiply-adds are not one dependent chain; a slot's score does
/// not depend on `S` or on the other slots.
///
/// # Safety
/// AVX2, FMA and F16C must be available; `kp` holds the K blocks that `kv` and `span`
/// name, `q` `H` heads' queries and `scores` room for their slots.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn score_slots<E: KvElem, const H: usize, const C: usize, const S: usize>(
    (q, hd, k, bs, ks, scale, out): ScoreArgs<E>,
) {
    unsafe {
        use std::arch::x86_64::*;
        let mut acc = [[[_mm256_setzero_ps(); S]; H]; C];
        for d in (0..hd).step_by(C) {
            for (c, acc) in acc.iter_mut().enumerate() {
                if d + c < hd {
                    let row = k.add((d + c) * bs);
                    let kv: [__m256; S] = std::array::from_fn(|v| E::load8(row.add(8 * v)));
                    for (h, acc) in acc.iter_mut().enumerate() {
                        let qv = _mm256_set1_ps(*q.add(h * hd + d + c));
                        for (a, kv) in acc.iter_mut().zip(&kv) {
                            *a = _mm256_fmadd_ps(qv, *kv, *a);
                        }
                    }
                }
            }
        }
        for (h, out) in out.iter_mut().enumerate().take(H) {
            for v in 0..S {
                let mut sum = acc[0][h][v];
                for chain in &acc[1..] {
                    sum = _mm256_add_ps(sum, chain[h][v]);
                }
                if let Some(ks) = ks {
                    sum = _mm256_mul_ps(sum, _mm256_loadu_ps(ks.add(8 * v)));
                }
                _mm256_storeu_ps(out.as_mut_ptr().add(8 * v), _mm256_mul_ps(sum, _mm256_set1_ps(scale)));
            }
        }
    }
}

/// `out_h[..8·D] (+)= Σ_j w[h·n + j] · v[j·hd..][..8·D]` for `H` heads (`out` rows `hd`
/// apart), summed over the `len` positions in order with the accumulators in registers;
/// each V vector is loaded once for the `H` heads.
///
/// # Safety
/// AVX2, FMA and F16C must be available; `vp` holds the V blocks that `kv` and `span`
/// name, and `out` `H` heads of `D` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn weighted_sum<E: KvElem, const H: usize, const D: usize>(
    (w, n, v, hd, len, out, accumulate): (*const f32, usize, *const E, usize, usize, *mut f32, bool),
) {
    unsafe {
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
}

/// [`score_slots`] for sixteen slots (`S` = 2) in one 512-bit register per dim: each lane
/// the same chains in the same order, so the same bits.
///
/// # Safety
/// As [`score_slots`]'s, and AVX-512F must be available (inlined into
/// `attend_avx512` only).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn score_slots16<E: KvElem, const H: usize, const C: usize>((q, hd, k, bs, ks, scale, out): ScoreArgs<E>) {
    unsafe {
        use std::arch::x86_64::*;
        let mut acc = [[_mm512_setzero_ps(); H]; C];
        for d in (0..hd).step_by(C) {
            for (c, acc) in acc.iter_mut().enumerate() {
                if d + c < hd {
                    let kv = E::load16(k.add((d + c) * bs));
                    for (h, a) in acc.iter_mut().enumerate() {
                        *a = _mm512_fmadd_ps(_mm512_set1_ps(*q.add(h * hd + d + c)), kv, *a);
                    }
                }
            }
        }
        for (h, out) in out.iter_mut().enumerate().take(H) {
            let mut sum = acc[0][h];
            for chain in &acc[1..] {
                sum = _mm512_add_ps(sum, chain[h]);
            }
            if let Some(ks) = ks {
                sum = _mm512_mul_ps(sum, _mm512_loadu_ps(ks));
            }
            _mm512_storeu_ps(out.as_mut_ptr(), _mm512_mul_ps(sum, _mm512_set1_ps(scale)));
        }
    }
}

/// [`weighted_sum`] for `16·D` values a head, sixteen to a 512-bit register: each lane the
/// same chain of multiply-adds, so the same bits.
///
/// # Safety
/// As [`weighted_sum`]'s, and AVX-512F must be available (inlined into
/// `attend_avx512` only).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn weighted_sum16<E: KvElem, const H: usize, const D: usize>(
    (w, n, v, hd, len, out, accumulate): (*const f32, usize, *const E, usize, usize, *mut f32, bool),
) {
    unsafe {
        use std::arch::x86_64::*;
        let mut acc = [[_mm512_setzero_ps(); D]; H];
        if accumulate {
            for (h, acc) in acc.iter_mut().enumerate() {
                for (d, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_loadu_ps(out.add(h * hd + 16 * d));
                }
            }
        }
        for j in 0..len {
            let row = v.add(j * hd);
            let xs: [__m512; D] = std::array::from_fn(|d| E::load16(row.add(16 * d)));
            for (h, acc) in acc.iter_mut().enumerate() {
                let wj = _mm512_set1_ps(*w.add(h * n + j));
                for (a, x) in acc.iter_mut().zip(&xs) {
                    *a = _mm512_fmadd_ps(wj, *x, *a);
                }
            }
        }
        for (h, acc) in acc.iter().enumerate() {
            for (d, a) in acc.iter().enumerate() {
                _mm512_storeu_ps(out.add(h * hd + 16 * d), *a);
            }
        }
    }
}

/// A row of scores becomes its softmax.
fn softmax(row: &mut [f32], sink: Option<f32>) {
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::matmul::avx2::available() {
        // SAFETY: the CPU supports AVX2 and FMA.
        return unsafe { softmax_avx2(row, sink) };
    }
    let max = row.iter().cloned().fold(sink.unwrap_or(f32::NEG_INFINITY), f32::max);
    let mut sum = 0f32;
    for s in row.iter_mut() {
        *s = exp(*s - max);
        sum += *s;
    }
    if let Some(s) = sink {
        sum += exp(s - max);
    }
    let inv = 1.0 / sum;
    row.iter_mut().for_each(|s| *s *= inv);
}

/// [`softmax`] with eight lanes of exponentials and partial sums.
///
/// # Safety
/// AVX2 and FMA must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_avx2(row: &mut [f32], sink: Option<f32>) {
    unsafe {
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
        let max = lanes.iter().chain(&row[n8..]).cloned().fold(sink.unwrap_or(f32::NEG_INFINITY), f32::max);
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
        if let Some(s) = sink {
            sum += exp(s - max);
        }
        let inv = _mm256_set1_ps(1.0 / sum);
        for i in (0..n8).step_by(8) {
            _mm256_storeu_ps(p.add(i), _mm256_mul_ps(_mm256_loadu_ps(p.add(i)), inv));
        }
        for s in &mut row[n8..] {
            *s *= 1.0 / sum;
        }
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
        // The portable path: a head dim or block size not a multiple of 8.
        check_against_naive(6, 8, 3);
        check_against_naive(16, 4, 3);
        // The AVX2 path's head chunks (1; 3; 2 + 2; 2 + 3; 2 + 2 + 3; 2 + 3 + 3) and the
        // 512-bit steps' (4; 3 + 4; 4 + 4 at head dims of 16), their passes over V's
        // vectors (2; 5 as 5, 4 + 1 or 3 + 2; 9 as 8 + 1, 4 + 4 + 1 or 3 + 3 + 3) and
        // their slots scored eight (a block of 8) or sixteen and then eight (a block of 24).
        for group in [1, 3, 4, 5, 7, 8] {
            for hd in [16, 40, 72] {
                for bs in [8, 24] {
                    check_against_naive(hd, bs, group);
                }
            }
        }
    }

    /// Pools of `len` values of K and V as int8 rows (a slot's values of one kv head) with
    /// their scales, and the values they stand for: `(k, v, k_scales, v_scales, k_values,
    /// v_values)`.
    #[allow(clippy::type_complexity)]
    fn int8_pools(
        k: &[f32],
        v: &[f32],
        bs: usize,
        hd: usize,
    ) -> (Vec<i8>, Vec<i8>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
        let (mut k8, mut v8, mut kd, mut vd) = (vec![0i8; k.len()], vec![0i8; v.len()], k.to_vec(), v.to_vec());
        let (mut ks, mut vs) = (vec![0f32; k.len() / hd], vec![0f32; v.len() / hd]);
        let (mut row, mut q) = (vec![0f32; hd], vec![0i8; hd]);
        for (slab, slot) in (0..k.len()).step_by(bs * hd).flat_map(|o| (0..bs).map(move |s| (o, s))) {
            let at = |d: usize| slab + d * bs + slot;
            // The layout as RowScales documents it, written out independently of its helper.
            let i = slab / hd + slot;
            row.iter_mut().enumerate().for_each(|(d, r)| *r = k[at(d)]);
            ks[i] = i8::row_scale(&row);
            i8::narrow(&row, &mut q, ks[i]);
            (0..hd).for_each(|d| (k8[at(d)], kd[at(d)]) = (q[d], q[d] as f32 * ks[i]));
            let r = slab + slot * hd..slab + (slot + 1) * hd;
            vs[i] = i8::row_scale(&v[r.clone()]);
            i8::narrow(&v[r.clone()], &mut v8[r.clone()], vs[i]);
            (0..hd).for_each(|d| vd[r.start + d] = v8[r.start + d] as f32 * vs[i]);
        }
        (k8, v8, ks, vs, kd, vd)
    }

    /// Block size `bs`, four blocks of a table, spans that start and end inside blocks; f32
    /// pools and int8 ones against the values they stand for.
    fn check_against_naive(hd: usize, bs: usize, group: usize) {
        let (kvh, blocks) = (2, 8);
        let k = random_vec(blocks * bs * kvh * hd, 1);
        let v = random_vec(blocks * bs * kvh * hd, 2);
        check_pools_against_naive(PagedKv::new(Pools::F32 { k: &k, v: &v }, bs, kvh, hd), &k, &v, group);
        let (k8, v8, ks, vs, kd, vd) = int8_pools(&k, &v, bs, hd);
        let scales = RowScales { k: &ks, v: &vs };
        check_pools_against_naive(PagedKv::new(Pools::Int8 { k: &k8, v: &v8, scales }, bs, kvh, hd), &kd, &vd, group);
    }

    /// `kv`'s attention against the naive one over the values `k` and `v` it holds.
    fn check_pools_against_naive(kv: PagedKv<'_>, k: &[f32], v: &[f32], group: usize) {
        let (kvh, bs, hd) = (kv.kv_heads, kv.block_size, kv.head_dim);
        let table = [5u32, 0, 7, 2];
        let heads = kvh * group;
        let q = random_vec(heads * hd, 3);
        let scale = 0.4f32;
        let end = 4 * bs - 1;
        let spans = [
            (0, 0),
            (0, 3),
            (0, end - 2),
            (0, end),
            (2, end - 2),
            (bs, end),
            (2 * bs + 1, 2 * bs + 1),
            (5, 3 * bs - 1),
        ];
        for ((first, last), softcap) in spans.into_iter().zip([None, Some(1.5)].into_iter().cycle()) {
            let mut out = vec![0f32; heads * hd];
            let span = KvSpan { block_table: &table, first_pos: first, last_pos: last };
            attend(&q, kv, span, Scoring { scale, softcap, sinks: None }, &mut Scratch::default(), &mut out);
            // One kv head at a time gives the same heads, bit for bit.
            for (g, (qg, og)) in q.chunks(group * hd).zip(out.chunks(group * hd)).enumerate() {
                let mut one = vec![0f32; group * hd];
                attend(
                    qg,
                    kv.heads(g, 1),
                    span,
                    Scoring { scale, softcap, sinks: None },
                    &mut Scratch::default(),
                    &mut one,
                );
                assert_eq!(one, og, "kv head {g} alone");
            }

            // Slabs of (block, kv head): K dim-major, V position-major.
            let slab = |p: usize, g: usize| ((table[p / bs] as usize * kvh + g) * bs * hd, p % bs);
            let k_at = |p: usize, g: usize| {
                let (o, slot) = slab(p, g);
                (0..hd).map(|d| k[o + d * bs + slot]).collect::<Vec<f32>>()
            };
            let v_at = |p: usize, g: usize| {
                let (o, slot) = slab(p, g);
                v[o + slot * hd..o + (slot + 1) * hd].to_vec()
            };
            for h in 0..heads {
                let (qh, g) = (&q[h * hd..(h + 1) * hd], h / group);
                let s: Vec<f64> = (first..=last)
                    .map(|p| k_at(p, g).iter().zip(qh).map(|(a, b)| (*a * *b) as f64).sum::<f64>() * scale as f64)
                    .map(|x| softcap.map_or(x, |c| (x / c as f64).tanh() * c as f64))
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                let mut want = vec![0f64; hd];
                for (p, ep) in (first..).zip(&e) {
                    for (w, vv) in want.iter_mut().zip(v_at(p, g)) {
                        *w += ep / z * vv as f64;
                    }
                }
                let want: Vec<f32> = want.into_iter().map(|x| x as f32).collect();
                assert_close(&out[h * hd..(h + 1) * hd], &want, 1e-5, &format!("hd {hd} {first}..={last} head {h}"));
            }
        }
    }

    /// f16 and FP8 pools give what f32 pools holding the same (rounded) values give, on the
    /// AVX2 path and the portable one.
    #[test]
    fn narrow_pools_read_as_their_values() {
        narrow_reads_as_its_values::<u16>(|k, v| Pools::F16 { k, v });
        narrow_reads_as_its_values::<E4M3>(|k, v| Pools::Fp8 { k, v });
    }

    fn narrow_reads_as_its_values<E: KvElem>(pools: for<'a> fn(&'a [E], &'a [E]) -> Pools<'a>) {
        for (hd, bs) in [(6, 4), (16, 8), (64, 16)] {
            let (kvh, blocks, group) = (2, 8, 3);
            let round = |x: Vec<f32>| -> (Vec<E>, Vec<f32>) {
                let mut h = vec![E::default(); x.len()];
                E::narrow(&x, &mut h, 1.0);
                let f = h.iter().map(|&b| b.to_f32()).collect();
                (h, f)
            };
            let (kn, k32) = round(random_vec(blocks * bs * kvh * hd, 4));
            let (vn, v32) = round(random_vec(blocks * bs * kvh * hd, 5));
            let q = random_vec(kvh * group * hd, 6);
            let table = [3u32, 6, 1, 4];
            for (first, last) in [(0, 0), (0, 4 * bs - 1), (3, 3 * bs)] {
                let span = KvSpan { block_table: &table, first_pos: first, last_pos: last };
                let scoring = Scoring { scale: 0.3, softcap: None, sinks: None };
                let run = |pools| {
                    let mut out = vec![0f32; q.len()];
                    attend(&q, PagedKv::new(pools, bs, kvh, hd), span, scoring, &mut Scratch::default(), &mut out);
                    out
                };
                let (narrow, full) = (run(pools(&kn, &vn)), run(Pools::F32 { k: &k32, v: &v32 }));
                assert_eq!(narrow, full, "hd {hd} {first}..={last}");
            }
        }
    }

    /// The same positions in blocks of 2, 4, 8 and 24 slots (the portable path, and the
    /// AVX2 one or its 512-bit steps where the CPU has them), f32, f16, FP8 and int8 pools: the same
    /// result bit for bit, so a sequence's tokens do not depend on `--block-size`.
    #[test]
    fn every_block_size_gives_the_same_bits() {
        for (hd, group) in [(8, 1), (16, 3), (64, 4), (64, 7), (32, 8)] {
            let (kvh, len) = (2, 48);
            let k = random_vec(len * kvh * hd, 7);
            let v = random_vec(len * kvh * hd, 8);
            let q = random_vec(kvh * group * hd, 9);
            // Each narrow element's rows of (position, kv head) with their scales.
            fn rows<E: KvElem>(x: &[f32], hd: usize) -> (Vec<E>, Vec<f32>) {
                let scales: Vec<f32> = x.chunks(hd).map(E::row_scale).collect();
                let mut n = vec![E::default(); x.len()];
                n.chunks_mut(hd).zip(x.chunks(hd)).zip(&scales).for_each(|((n, x), &s)| E::narrow(x, n, s));
                (n, scales)
            }
            // Position p of kv head g at block p / bs (table reversed), in the pool layout.
            fn layout<E: KvElem>(k: &[f32], v: &[f32], hd: usize, kvh: usize, bs: usize) -> [Vec<E>; 2] {
                let len = k.len() / hd / kvh;
                let blocks = len / bs;
                let ((kn, _), (vn, _)) = (rows::<E>(k, hd), rows::<E>(v, hd));
                let (mut kl, mut vl) = (vec![E::default(); k.len()], vec![E::default(); v.len()]);
                for p in 0..len {
                    for g in 0..kvh {
                        let o = (((blocks - 1 - p / bs) * kvh + g) * bs) * hd;
                        for d in 0..hd {
                            let src = (p * kvh + g) * hd + d;
                            (kl[o + d * bs + p % bs], vl[o + (p % bs) * hd + d]) = (kn[src], vn[src]);
                        }
                    }
                }
                [kl, vl]
            }
            let scales_in_layout = |x: &[f32], bs: usize| -> Vec<f32> {
                let (_, s) = rows::<i8>(x, hd);
                let mut out = vec![0f32; s.len()];
                for p in 0..len {
                    for g in 0..kvh {
                        out[((len / bs - 1 - p / bs) * kvh + g) * bs + p % bs] = s[p * kvh + g];
                    }
                }
                out
            };
            let mut want: Option<Vec<Vec<f32>>> = None;
            for bs in [2, 4, 8, 24] {
                let ([kl, vl], [kh, vh]) = (layout::<f32>(&k, &v, hd, kvh, bs), layout::<u16>(&k, &v, hd, kvh, bs));
                let ([k8, v8], [ki, vi]) = (layout::<E4M3>(&k, &v, hd, kvh, bs), layout::<i8>(&k, &v, hd, kvh, bs));
                let (ks, vs) = (scales_in_layout(&k, bs), scales_in_layout(&v, bs));
                let table: Vec<u32> = (0..(len / bs) as u32).rev().collect();
                let mut got = Vec::new();
                let all = [
                    Pools::F32 { k: &kl, v: &vl },
                    Pools::F16 { k: &kh, v: &vh },
                    Pools::Fp8 { k: &k8, v: &v8 },
                    Pools::Int8 { k: &ki, v: &vi, scales: RowScales { k: &ks, v: &vs } },
                ];
                for pools in all {
                    for (first, last) in [(0, 0), (0, len - 1), (5, 30), (17, 17)] {
                        let span = KvSpan { block_table: &table, first_pos: first, last_pos: last };
                        let mut out = vec![0f32; q.len()];
                        let kv = PagedKv::new(pools, bs, kvh, hd);
                        attend(
                            &q,
                            kv,
                            span,
                            Scoring { scale: 0.3, softcap: None, sinks: None },
                            &mut Scratch::default(),
                            &mut out,
                        );
                        got.push(out);
                    }
                }
                match &want {
                    None => want = Some(got),
                    Some(w) => assert!(w == &got, "hd {hd}, group {group}: blocks of {bs} differ"),
                }
            }
        }
    }

    #[test]
    fn runs_walk_blocks_in_position_order() {
        let kv = PagedKv::new(Pools::F32 { k: &[], v: &[] }, 2, 3, 4);
        let table = [4u32, 1, 6];
        for (start, end) in [(0, 3), (1, 3), (2, 6), (3, 5), (5, 6)] {
            let got: Vec<(usize, usize)> = kv
                .runs(&table, start, end)
                .flat_map(|(base, slot, len)| (slot..slot + len).map(move |s| (base + 2 * 2 * 4, s)))
                .collect();
            let want: Vec<(usize, usize)> = (start..end).map(|p| kv.slab(&table, p, 2)).collect();
            assert_eq!(got, want, "{start}..{end}");
        }
    }

    /// A sink takes its share of the denominator: the weights are the softmax over the
    /// scores and the sink with the sink's own weight dropped, on either path.
    #[test]
    fn a_sink_joins_the_denominator() {
        for n in [1, 5, 8, 21] {
            for sink in [-3.0f32, 0.5, 9.0] {
                let mut row: Vec<f32> = (0..n).map(|i| (i as f32 * 0.61).cos() * 4.0).collect();
                let all: Vec<f64> = row.iter().map(|&x| x as f64).chain([sink as f64]).collect();
                let m = all.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = all.iter().map(|x| (x - m).exp()).sum();
                let want: Vec<f64> = all[..n].iter().map(|x| (x - m).exp() / z).collect();
                softmax(&mut row, Some(sink));
                for (got, want) in row.iter().zip(&want) {
                    assert!((*got as f64 - want).abs() < 1e-6, "n {n} sink {sink}: {got} vs {want}");
                }
            }
        }
    }

    #[test]
    fn softmax_sums_to_one_and_keeps_order() {
        for n in [1, 7, 8, 19] {
            let mut row: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 5.0).collect();
            let before = row.clone();
            softmax(&mut row, None);
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
