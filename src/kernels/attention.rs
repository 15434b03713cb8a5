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

/// For each query head `h` of the group (`q` and `out` are `[group, head_dim]`):
/// `out[h] = softmax(q[h]·Kᵀ · scale) · V`. `scores` is scratch space, grown as needed.
pub fn attend(q: &[f32], kv: PagedKv<'_>, span: KvSpan<'_>, scale: f32, scores: &mut Vec<f32>, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::matmul::avx2::available() {
        // SAFETY: the CPU supports AVX2 and FMA.
        return unsafe { attend_avx2(q, kv, span, scale, scores, out) };
    }
    attend_body(q, kv, span, scale, scores, out)
}

/// The same code compiled for AVX2 + FMA, so the per-position vector work inlines.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_avx2(
    q: &[f32],
    kv: PagedKv<'_>,
    span: KvSpan<'_>,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    attend_body(q, kv, span, scale, scores, out)
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

    #[test]
    fn matches_naive_over_scattered_blocks() {
        let (bs, kvh, hd, blocks, group) = (4, 2, 6, 8, 3);
        let k = random_vec(blocks * bs * kvh * hd, 1);
        let v = random_vec(blocks * bs * kvh * hd, 2);
        let kv = PagedKv { k: &k, v: &v, block_size: bs, kv_heads: kvh, head_dim: hd };
        let table = [5u32, 0, 7, 2];
        let q = random_vec(group * hd, 3);
        let (g, scale) = (1, 0.4f32);
        for last in [0, 3, 13, 15] {
            let mut out = vec![0f32; group * hd];
            let span = KvSpan { block_table: &table, kv_head: g, last_pos: last };
            attend(&q, kv, span, scale, &mut Vec::new(), &mut out);

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
                assert_close(&out[h * hd..(h + 1) * hd], &want, 1e-5, &format!("last {last} head {h}"));
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
