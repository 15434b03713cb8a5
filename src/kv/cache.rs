//! The K/V pools: one `[num_blocks, kv_heads, block_size, head_dim]` array each for K and V
//! per layer, f32 so the cached path computes exactly what the reference does. Head-major
//! blocks keep one head's positions contiguous, the order attention reads them in.

use crate::kernels::attention::PagedKv;
use crate::kernels::buffer::F32Buf;

pub struct KvCache {
    layers: Vec<(F32Buf, F32Buf)>,
    num_blocks: usize,
    block_size: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl KvCache {
    pub fn new(num_layers: usize, num_blocks: usize, block_size: usize, kv_heads: usize, head_dim: usize) -> Self {
        let len = num_blocks * block_size * kv_heads * head_dim;
        let layers = (0..num_layers).map(|_| (F32Buf::zeroed_resident(len), F32Buf::zeroed_resident(len))).collect();
        KvCache { layers, num_blocks, block_size, kv_heads, head_dim }
    }

    /// Bytes one block takes over all layers, K and V.
    pub fn bytes_per_block(num_layers: usize, block_size: usize, kv_heads: usize, head_dim: usize) -> usize {
        [num_layers, block_size, kv_heads, head_dim, std::mem::size_of::<f32>()]
            .iter()
            .fold(2usize, |a, &b| a.saturating_mul(b))
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn layer(&self, layer: usize) -> PagedKv<'_> {
        let (k, v) = &self.layers[layer];
        PagedKv::new(k, v, self.block_size, self.kv_heads, self.head_dim)
    }

    /// Copies block `src` into block `dst` in every layer (copy-on-write for forks).
    pub fn copy_block(&mut self, src: u32, dst: u32) {
        let n = self.block_size * self.kv_heads * self.head_dim;
        let (s, d) = (src as usize * n, dst as usize * n);
        for (k, v) in &mut self.layers {
            k.copy_within(s..s + n, d);
            v.copy_within(s..s + n, d);
        }
    }

    /// Stores all kv heads of one position: `k` and `v` are `[kv_heads * head_dim]`.
    pub fn write(&mut self, layer: usize, block_table: &[u32], pos: usize, k: &[f32], v: &[f32]) {
        let hd = self.head_dim;
        let first = self.layer(layer).offset(block_table, pos, 0);
        let (kp, vp) = &mut self.layers[layer];
        for h in 0..self.kv_heads {
            let o = first + h * self.block_size * hd;
            kp[o..o + hd].copy_from_slice(&k[h * hd..(h + 1) * hd]);
            vp[o..o + hd].copy_from_slice(&v[h * hd..(h + 1) * hd]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_lands_in_the_mapped_block_and_slot() {
        // 2 layers, 3 blocks of 2 slots, 3 kv heads of dim 2.
        let mut c = KvCache::new(2, 3, 2, 3, 2);
        let k: Vec<f32> = (0..6).map(|x| x as f32).collect();
        let v: Vec<f32> = (10..16).map(|x| x as f32).collect();
        c.write(1, &[2, 0], 1, &k, &v);
        let view = c.layer(1);
        for h in 0..3 {
            let o = view.offset(&[2, 0], 1, h);
            assert_eq!(o, ((2 * 3 + h) * 2 + 1) * 2);
            assert_eq!(view.k[o..o + 2], k[2 * h..2 * h + 2]);
            assert_eq!(view.v[o..o + 2], v[2 * h..2 * h + 2]);
        }
        assert!(c.layer(0).k.iter().all(|x| *x == 0.0));
        assert_eq!(KvCache::bytes_per_block(2, 2, 3, 2), 2 * 2 * 2 * 3 * 2 * 4);
    }
}
