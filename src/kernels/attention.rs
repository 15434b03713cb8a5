//! Attention of the query heads that share one KV head over a sequence's paged K/V.
//!
//! A layer's cache pool is `[num_blocks, block_size, kv_heads, head_dim]` for K and for V; a
//! sequence's position `p` lives in block `block_table[p / block_size]`, slot
//! `p % block_size`. Scores are formed over positions in order, so a query's result does not
//! depend on how its prompt was chunked or what else ran in the step. The query heads of a
//! GQA group are processed together so each K and V row is read once for all of them.

use super::dot::{axpy_lanes, dot_lanes};

/// One layer's K and V pools, viewed for reading.
#[derive(Clone, Copy)]
pub struct PagedKv<'a> {
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub block_size: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl PagedKv<'_> {
    /// Offset of (position, kv head) in the pools.
    #[inline]
    pub fn offset(&self, block_table: &[u32], pos: usize, kv_head: usize) -> usize {
        let block = block_table[pos / self.block_size] as usize;
        ((block * self.block_size + pos % self.block_size) * self.kv_heads + kv_head) * self.head_dim
    }

    /// Offsets of kv head `kv_head` for positions `0..n`, in order, block by block.
    fn offsets<'t>(&self, block_table: &'t [u32], n: usize, kv_head: usize) -> impl Iterator<Item = usize> + 't {
        let (bs, stride) = (self.block_size, self.kv_heads * self.head_dim);
        let head = kv_head * self.head_dim;
        block_table[..n.div_ceil(bs)].iter().enumerate().flat_map(move |(i, &b)| {
            let base = b as usize * bs * stride + head;
            (0..bs.min(n - i * bs)).map(move |s| base + s * stride)
        })
    }
}

/// Where one attention call reads: a sequence's blocks, a KV head, positions `0..=last_pos`.
#[derive(Clone, Copy)]
pub struct KvSpan<'a> {
    pub block_table: &'a [u32],
    pub kv_head: usize,
    pub last_pos: usize,
}

/// Reusable buffers for [`attend`].
#[derive(Default)]
pub struct Scratch {
    scores: Vec<f32>,
    offsets: Vec<usize>,
}

/// For each query head `h` of the group (`q` and `out` are `[group, head_dim]`):
/// `out[h] = softmax(q[h]·Kᵀ · scale) · V`.
pub fn attend(q: &[f32], kv: PagedKv<'_>, span: KvSpan<'_>, scale: f32, scratch: &mut Scratch, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::matmul::avx2::available() {
        // SAFETY: the CPU supports AVX2 and FMA.
        return unsafe { attend_avx2(q, kv, span, scale, scratch, out) };
    }
    attend_body(q, kv, span, scale, &mut scratch.scores, out)
}

/// AVX2 version for head dims that are a multiple of 8: scores four positions at a time
/// (four independent FMA chains instead of one), and the weighted sum of V in registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_avx2(
    q: &[f32],
    kv: PagedKv<'_>,
    span: KvSpan<'_>,
    scale: f32,
    scratch: &mut Scratch,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let hd = kv.head_dim;
    if !hd.is_multiple_of(8) {
        return attend_body(q, kv, span, scale, &mut scratch.scores, out);
    }
    let group = q.len() / hd;
    let n = span.last_pos + 1;
    let Scratch { scores, offsets } = scratch;
    offsets.clear();
    offsets.extend(kv.offsets(span.block_table, n, span.kv_head));
    scores.clear();
    scores.resize(group * n, 0.0);
    let kp = kv.k.as_ptr();
    for (h, qh) in q.chunks_exact(hd).enumerate() {
        let row = &mut scores[h * n..(h + 1) * n];
        let mut p = 0;
        while p + 4 <= n {
            let mut acc = [_mm256_setzero_ps(); 4];
            for c in (0..hd).step_by(8) {
                let qv = _mm256_loadu_ps(qh.as_ptr().add(c));
                for (j, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kp.add(offsets[p + j] + c)), *a);
                }
            }
            for (j, a) in acc.iter().enumerate() {
                row[p + j] = hsum(*a) * scale;
            }
            p += 4;
        }
        for (r, &o) in row[p..].iter_mut().zip(&offsets[p..]) {
            *r = dot_lanes(qh, &kv.k[o..o + hd]) * scale;
        }
    }
    softmax_rows(scores, n);
    let vp = kv.v.as_ptr();
    for (h, oh) in out.chunks_exact_mut(hd).enumerate() {
        let w = &scores[h * n..(h + 1) * n];
        // Up to 64 floats of the output at a time stay in eight registers.
        for c0 in (0..hd).step_by(64) {
            let lanes = ((hd - c0) / 8).min(8);
            let mut acc = [_mm256_setzero_ps(); 8];
            for (&o, &wp) in offsets.iter().zip(w) {
                let wv = _mm256_set1_ps(wp);
                for (i, a) in acc[..lanes].iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(wv, _mm256_loadu_ps(vp.add(o + c0 + 8 * i)), *a);
                }
            }
            for (i, a) in acc[..lanes].iter().enumerate() {
                _mm256_storeu_ps(oh.as_mut_ptr().add(c0 + 8 * i), *a);
            }
        }
    }
}

/// Horizontal sum in the same order as `dot_lanes`: ((0+4)+(2+6)) + ((1+5)+(3+7)).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn hsum(v: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps::<0b01>(s2, s2)))
}

/// Each row of `n` scores becomes its softmax.
#[inline(always)]
fn softmax_rows(scores: &mut [f32], n: usize) {
    for row in scores.chunks_exact_mut(n) {
        let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for s in row.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        let inv = 1.0 / sum;
        row.iter_mut().for_each(|s| *s *= inv);
    }
}

#[inline(always)]
fn attend_body(q: &[f32], kv: PagedKv<'_>, span: KvSpan<'_>, scale: f32, scores: &mut Vec<f32>, out: &mut [f32]) {
    let hd = kv.head_dim;
    let group = q.len() / hd;
    let n = span.last_pos + 1;
    scores.clear();
    scores.resize(group * n, 0.0);
    for (p, o) in kv.offsets(span.block_table, n, span.kv_head).enumerate() {
        let k = &kv.k[o..o + hd];
        for (h, qh) in q.chunks_exact(hd).enumerate() {
            scores[h * n + p] = dot_lanes(qh, k) * scale;
        }
    }
    softmax_rows(scores, n);
    out.fill(0.0);
    for (p, o) in kv.offsets(span.block_table, n, span.kv_head).enumerate() {
        let v = &kv.v[o..o + hd];
        for (h, oh) in out.chunks_exact_mut(hd).enumerate() {
            axpy_lanes(oh, scores[h * n + p], v);
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
        check_against_naive(6);
        check_against_naive(16);
        check_against_naive(72);
    }

    fn check_against_naive(hd: usize) {
        let (bs, kvh, blocks, group) = (4, 2, 8, 3);
        let k = random_vec(blocks * bs * kvh * hd, 1);
        let v = random_vec(blocks * bs * kvh * hd, 2);
        let kv = PagedKv { k: &k, v: &v, block_size: bs, kv_heads: kvh, head_dim: hd };
        let table = [5u32, 0, 7, 2];
        let q = random_vec(group * hd, 3);
        let (g, scale) = (1, 0.4f32);
        for last in [0, 3, 13, 15] {
            let mut out = vec![0f32; group * hd];
            let span = KvSpan { block_table: &table, kv_head: g, last_pos: last };
            attend(&q, kv, span, scale, &mut Scratch::default(), &mut out);

            let at = |pool: &[f32], p: usize| {
                let o = ((table[p / bs] as usize * bs + p % bs) * kvh + g) * hd;
                pool[o..o + hd].to_vec()
            };
            for h in 0..group {
                let qh = &q[h * hd..(h + 1) * hd];
                let s: Vec<f64> = (0..=last)
                    .map(|p| at(&k, p).iter().zip(qh).map(|(a, b)| (*a * *b) as f64).sum::<f64>() * scale as f64)
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                let mut want = vec![0f64; hd];
                for (p, ep) in e.iter().enumerate() {
                    for (w, vv) in want.iter_mut().zip(at(&v, p)) {
                        *w += ep / z * vv as f64;
                    }
                }
                let want: Vec<f32> = want.into_iter().map(|x| x as f32).collect();
                assert_close(&out[h * hd..(h + 1) * hd], &want, 1e-5, &format!("hd {hd} last {last} head {h}"));
            }
        }
    }

    #[test]
    fn offsets_walk_blocks_in_position_order() {
        let kv = PagedKv { k: &[], v: &[], block_size: 2, kv_heads: 3, head_dim: 4 };
        let table = [4u32, 1];
        let got: Vec<usize> = kv.offsets(&table, 3, 2).collect();
        let want: Vec<usize> = (0..3).map(|p| kv.offset(&table, p, 2)).collect();
        assert_eq!(got, want);
    }
}
