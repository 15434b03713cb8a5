//! Attention of one query head over a sequence's paged K/V.
//!
//! A layer's cache pool is `[num_blocks, block_size, kv_heads, head_dim]` for K and for V; a
//! sequence's position `p` lives in block `block_table[p / block_size]`, slot
//! `p % block_size`. Scores are formed over positions in order, so a query's result does not
//! depend on how its prompt was chunked or what else ran in the step.

use super::dot;

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
        ((block * self.block_size + pos % self.block_size) * self.kv_heads + kv_head)
            * self.head_dim
    }
}

/// `out = softmax(q·Kᵀ · scale) · V` over positions `0..=last_pos` of kv head `kv_head`.
/// `scores` is scratch space, grown as needed.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    q: &[f32],
    kv: PagedKv<'_>,
    block_table: &[u32],
    kv_head: usize,
    last_pos: usize,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let hd = kv.head_dim;
    let n = last_pos + 1;
    scores.clear();
    let mut max = f32::NEG_INFINITY;
    for p in 0..n {
        let o = kv.offset(block_table, p, kv_head);
        let s = dot(q, &kv.k[o..o + hd]) * scale;
        max = max.max(s);
        scores.push(s);
    }
    let mut sum = 0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    out.fill(0.0);
    for (p, &w) in scores.iter().enumerate() {
        let o = kv.offset(block_table, p, kv_head);
        for (acc, v) in out.iter_mut().zip(&kv.v[o..o + hd]) {
            *acc += w * v;
        }
    }
    let inv = 1.0 / sum;
    out.iter_mut().for_each(|v| *v *= inv);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::{assert_close, random_vec};

    #[test]
    fn matches_naive_over_scattered_blocks() {
        let (bs, kvh, hd, blocks) = (4, 2, 6, 8);
        let k = random_vec(blocks * bs * kvh * hd, 1);
        let v = random_vec(blocks * bs * kvh * hd, 2);
        let kv = PagedKv {
            k: &k,
            v: &v,
            block_size: bs,
            kv_heads: kvh,
            head_dim: hd,
        };
        let table = [5u32, 0, 7, 2];
        let q = random_vec(hd, 3);
        let (g, last, scale) = (1, 13, 0.4f32);
        let mut out = vec![0f32; hd];
        attend(&q, kv, &table, g, last, scale, &mut Vec::new(), &mut out);

        let at = |pool: &[f32], p: usize| {
            let o = ((table[p / bs] as usize * bs + p % bs) * kvh + g) * hd;
            pool[o..o + hd].to_vec()
        };
        let s: Vec<f64> = (0..=last)
            .map(|p| {
                at(&k, p)
                    .iter()
                    .zip(&q)
                    .map(|(a, b)| (*a * *b) as f64)
                    .sum::<f64>()
                    * scale as f64
            })
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
        assert_close(&out, &want, 1e-5, "attention");
    }
}
