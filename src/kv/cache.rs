//! The K/V pools: one array each for K and V per layer, of `num_blocks · kv_heads` slabs of
//! `block_size · head_dim` values (each layer its own kv heads and head size: Gemma 4's
//! global layers differ from its sliding ones), V's position-major and K's dim-major (see
//! [`crate::kernels::attention`]). Head-major blocks keep one head's positions together,
//! the order attention reads them in. Elements are f32 (the cached path computes exactly
//! what the reference does), f16 (half the memory, and half the bytes a decode step reads
//! from the cache) or FP8 E4M3 (half again, as vLLM's `fp8` cache).

use super::StateCache;
use crate::kernels::attention::{KvElem, PagedKv, Pools};
use crate::kernels::buffer::Buf;
use crate::kernels::fp8::E4M3;

/// The element type of the pools, as asked for: `auto` is f16 for a model whose matrices
/// are in a block format (already approximate, as llama.cpp's default cache) and f32 for
/// float weights, which then compute exactly as the reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvCacheDtype {
    #[default]
    Auto,
    F32,
    F16,
    /// FP8 E4M3 (vLLM's `fp8` and `fp8_e4m3`), unscaled: values round to 3 mantissa bits
    /// and saturate at ±448.
    Fp8,
}

impl std::str::FromStr for KvCacheDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(KvCacheDtype::Auto),
            "f32" => Ok(KvCacheDtype::F32),
            "f16" => Ok(KvCacheDtype::F16),
            "fp8" | "fp8_e4m3" => Ok(KvCacheDtype::Fp8),
            other => Err(format!("unknown KV cache dtype {other:?} (auto, f32, f16, fp8 or fp8_e4m3)")),
        }
    }
}

impl KvCacheDtype {
    /// The element type for a model whose matrices are (`quantized`) or are not in a block
    /// format.
    pub fn resolve(self, quantized: bool) -> KvDtype {
        match self {
            KvCacheDtype::F32 => KvDtype::F32,
            KvCacheDtype::F16 => KvDtype::F16,
            KvCacheDtype::Fp8 => KvDtype::Fp8,
            KvCacheDtype::Auto if quantized => KvDtype::F16,
            KvCacheDtype::Auto => KvDtype::F32,
        }
    }
}

/// The element type the pools are allocated in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvDtype {
    F32,
    F16,
    Fp8,
}

impl KvDtype {
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 => 2,
            KvDtype::Fp8 => 1,
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Fp8 => "fp8_e4m3",
        })
    }
}

/// Every layer's (K, V) pools in one element type.
enum Layers {
    F32(Vec<(Buf<f32>, Buf<f32>)>),
    F16(Vec<(Buf<u16>, Buf<u16>)>),
    Fp8(Vec<(Buf<E4M3>, Buf<E4M3>)>),
}

/// One layer's K/V geometry: kv heads and their size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvShape {
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl KvShape {
    /// Values of one position (all kv heads) in K or in V.
    fn width(self) -> usize {
        self.kv_heads.saturating_mul(self.head_dim)
    }
}

pub struct KvCache {
    layers: Layers,
    num_blocks: usize,
    block_size: usize,
    shapes: Vec<KvShape>,
    /// The recurrent layers' per-sequence state (none for a model that attends everywhere).
    pub states: StateCache,
}

impl KvCache {
    /// Pools of `num_blocks` blocks for layers of the given `shapes`.
    pub fn new(dtype: KvDtype, shapes: &[KvShape], num_blocks: usize, block_size: usize) -> Self {
        let lens: Vec<usize> = shapes.iter().map(|s| num_blocks * block_size * s.width()).collect();
        // Layers in parallel: making a pool resident is mostly the kernel zeroing its
        // pages, which both cores can do.
        fn pools<E: KvElem>(lens: &[usize]) -> Vec<(Buf<E>, Buf<E>)> {
            use rayon::prelude::*;
            lens.par_iter().map(|&len| (Buf::zeroed_resident(len), Buf::zeroed_resident(len))).collect()
        }
        let layers = match dtype {
            KvDtype::F32 => Layers::F32(pools(&lens)),
            KvDtype::F16 => Layers::F16(pools(&lens)),
            KvDtype::Fp8 => Layers::Fp8(pools(&lens)),
        };
        KvCache { layers, num_blocks, block_size, shapes: shapes.to_vec(), states: StateCache::new(0) }
    }

    /// With a recurrent state of `floats` per sequence slot (hybrid models).
    pub fn with_states(mut self, floats: usize) -> Self {
        self.states = StateCache::new(floats);
        self
    }

    /// Bytes one block takes over all layers, K and V.
    pub fn bytes_per_block(dtype: KvDtype, shapes: &[KvShape], block_size: usize) -> usize {
        let values = shapes.iter().fold(0usize, |a, s| a.saturating_add(s.width()));
        [block_size, values, dtype.bytes()].iter().fold(2usize, |a, &b| a.saturating_mul(b))
    }

    pub fn dtype(&self) -> KvDtype {
        match self.layers {
            Layers::F32(_) => KvDtype::F32,
            Layers::F16(_) => KvDtype::F16,
            Layers::Fp8(_) => KvDtype::Fp8,
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn layer(&self, layer: usize) -> PagedKv<'_> {
        let pools = match &self.layers {
            Layers::F32(l) => Pools::F32 { k: &l[layer].0, v: &l[layer].1 },
            Layers::F16(l) => Pools::F16 { k: &l[layer].0, v: &l[layer].1 },
            Layers::Fp8(l) => Pools::Fp8 { k: &l[layer].0, v: &l[layer].1 },
        };
        let s = self.shapes[layer];
        PagedKv::new(pools, self.block_size, s.kv_heads, s.head_dim)
    }

    /// Copies block `src` into block `dst` in every layer (copy-on-write for forks).
    pub fn copy_block(&mut self, src: u32, dst: u32) {
        let ns: Vec<usize> = self.shapes.iter().map(|s| self.block_size * s.width()).collect();
        fn copy<E: KvElem>(layers: &mut [(Buf<E>, Buf<E>)], ns: &[usize], src: usize, dst: usize) {
            for ((k, v), &n) in layers.iter_mut().zip(ns) {
                let (s, d) = (src * n, dst * n);
                k.copy_within(s..s + n, d);
                v.copy_within(s..s + n, d);
            }
        }
        match &mut self.layers {
            Layers::F32(l) => copy(l, &ns, src as usize, dst as usize),
            Layers::F16(l) => copy(l, &ns, src as usize, dst as usize),
            Layers::Fp8(l) => copy(l, &ns, src as usize, dst as usize),
        }
    }

    /// Stores all kv heads of one position: `k` and `v` are `[kv_heads * head_dim]`.
    pub fn write(&mut self, layer: usize, block_table: &[u32], pos: usize, k: &[f32], v: &[f32]) {
        let (hd, bs) = (self.shapes[layer].head_dim, self.block_size);
        let (first, slot) = self.layer(layer).slab(block_table, pos, 0);
        fn store<E: KvElem>(pools: &mut (Buf<E>, Buf<E>), at: (usize, usize, usize, usize), k: &[f32], v: &[f32]) {
            let (first, slot, bs, hd) = at;
            // K narrowed a chunk at a time into a buffer, then scattered dim by dim.
            const CHUNK: usize = 64;
            let mut narrow = [E::default(); CHUNK];
            for (h, (k, v)) in k.chunks_exact(hd).zip(v.chunks_exact(hd)).enumerate() {
                let slab = first + h * bs * hd;
                for (c, k) in k.chunks(CHUNK).enumerate() {
                    E::narrow(k, &mut narrow[..k.len()]);
                    for (d, &x) in narrow[..k.len()].iter().enumerate() {
                        pools.0[slab + (c * CHUNK + d) * bs + slot] = x;
                    }
                }
                let row = slab + slot * hd;
                E::narrow(v, &mut pools.1[row..row + hd]);
            }
        }
        let at = (first, slot, bs, hd);
        match &mut self.layers {
            Layers::F32(l) => store(&mut l[layer], at, k, v),
            Layers::F16(l) => store(&mut l[layer], at, k, v),
            Layers::Fp8(l) => store(&mut l[layer], at, k, v),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_lands_in_the_mapped_block_and_slot() {
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Fp8] {
            // 2 layers, 3 blocks of 2 slots, 3 kv heads of dim 2.
            let mut c = KvCache::new(dtype, &[KvShape { kv_heads: 3, head_dim: 2 }; 2], 3, 2);
            let k: Vec<f32> = (0..6).map(|x| x as f32).collect();
            let v: Vec<f32> = (10..16).map(|x| x as f32 / 2.0 + 0.5).collect();
            c.write(1, &[2, 0], 1, &k, &v);
            // (K, V) of a slot in a slab of 2 slots of dim 2: K dim-major, V position-major.
            let read = |pools: Pools<'_>, slab: usize, slot: usize| -> (Vec<f32>, Vec<f32>) {
                let (ko, vo) = ([slab + slot, slab + 2 + slot], [slab + 2 * slot, slab + 2 * slot + 1]);
                match pools {
                    Pools::F32 { k, v } => (ko.map(|i| k[i]).to_vec(), vo.map(|i| v[i]).to_vec()),
                    Pools::F16 { k, v } => (ko.map(|i| k[i].to_f32()).to_vec(), vo.map(|i| v[i].to_f32()).to_vec()),
                    Pools::Fp8 { k, v } => (ko.map(|i| k[i].to_f32()).to_vec(), vo.map(|i| v[i].to_f32()).to_vec()),
                }
            };
            let view = c.layer(1);
            for h in 0..3 {
                let (slab, slot) = view.slab(&[2, 0], 1, h);
                assert_eq!((slab, slot), ((2 * 3 + h) * 2 * 2, 1));
                // Small integers, and halves below 8, are exact in f16 and E4M3 too.
                assert_eq!(read(view.pools, slab, slot), (k[2 * h..2 * h + 2].to_vec(), v[2 * h..2 * h + 2].to_vec()));
            }
            let slabs = 3 * 3;
            let zero = (vec![0.0; 2], vec![0.0; 2]);
            assert!((0..slabs).all(|b| (0..2).all(|slot| read(c.layer(0).pools, 4 * b, slot) == zero)));
            let shapes = [KvShape { kv_heads: 3, head_dim: 2 }; 2];
            assert_eq!(KvCache::bytes_per_block(dtype, &shapes, 2), 2 * 2 * 2 * 3 * 2 * dtype.bytes());
        }
    }

    #[test]
    fn layers_of_different_shapes_keep_their_own_geometry() {
        // Layer 0: 2 kv heads of 4; layer 1: 1 kv head of 8 (Gemma 4's global layer).
        let shapes = [KvShape { kv_heads: 2, head_dim: 4 }, KvShape { kv_heads: 1, head_dim: 8 }];
        let mut c = KvCache::new(KvDtype::F32, &shapes, 3, 2);
        assert_eq!(KvCache::bytes_per_block(KvDtype::F32, &shapes, 2), 2 * 2 * (8 + 8) * 4);
        let k: Vec<f32> = (0..8).map(|x| x as f32).collect();
        let v: Vec<f32> = (0..8).map(|x| 10.0 + x as f32).collect();
        c.write(1, &[2, 0], 1, &k, &v);
        c.copy_block(2, 1);
        for block in [1usize, 2] {
            let Pools::F32 { k: kp, v: vp } = c.layer(1).pools else { unreachable!() };
            let slab = block * 2 * 8;
            // V position-major: slot 1's row; K dim-major: dim d at slab + 2d + 1.
            assert_eq!(&vp[slab + 8..slab + 16], &v[..]);
            assert_eq!((0..8).map(|d| kp[slab + 2 * d + 1]).collect::<Vec<_>>(), k);
        }
        assert_eq!(c.layer(0).head_dim, 4);
        assert_eq!(c.layer(1).kv_heads, 1);
    }
}
