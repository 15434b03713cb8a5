//! The K/V pools: one array each for K and V per layer, of `num_blocks · kv_heads` slabs of
//! `block_size · head_dim` values (each layer its own kv heads and head size: Gemma 4's
//! global layers differ from its sliding ones), V's position-major and K's dim-major (see
//! [`crate::kernels::attention`]). Head-major blocks keep one head's positions together,
//! the order attention reads them in. Elements are f32 (the cached path computes exactly
//! what the reference does), f16 (half the memory, and half the bytes a decode step reads
//! from the cache), FP8 E4M3 (half again, as vLLM's `fp8` cache) or int8 with a scale per
//! row (as small, and several times more accurate).

use super::StateCache;
use crate::kernels::attention::{KvElem, PagedKv, Pools, RowScales};
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
    /// int8 with an f32 scale per row (one position's values of one kv head): its absmax
    /// over 127.
    Int8,
}

impl std::str::FromStr for KvCacheDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(KvCacheDtype::Auto),
            "f32" => Ok(KvCacheDtype::F32),
            "f16" => Ok(KvCacheDtype::F16),
            "fp8" | "fp8_e4m3" => Ok(KvCacheDtype::Fp8),
            "int8" => Ok(KvCacheDtype::Int8),
            other => Err(format!("unknown KV cache dtype {other:?} (auto, f32, f16, fp8, fp8_e4m3 or int8)")),
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
            KvCacheDtype::Int8 => KvDtype::Int8,
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
    Int8,
}

impl KvDtype {
    /// Bytes of one element.
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 => 2,
            KvDtype::Fp8 | KvDtype::Int8 => 1,
        }
    }

    /// Bytes of one row's scale (a position's values of one kv head), if rows have one.
    pub fn scale_bytes(self) -> usize {
        match self {
            KvDtype::Int8 => 4,
            _ => 0,
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Fp8 => "fp8_e4m3",
            KvDtype::Int8 => "int8",
        })
    }
}

/// One layer's pools: K and V, and the scales of their rows where elements are scaled.
struct LayerPools<E: KvElem> {
    k: Buf<E>,
    v: Buf<E>,
    /// K's and V's, one per (block, kv head, slot); empty for unscaled elements.
    scales: (Buf<f32>, Buf<f32>),
}

/// Every layer's pools in one element type.
enum Layers {
    F32(Vec<LayerPools<f32>>),
    F16(Vec<LayerPools<u16>>),
    Fp8(Vec<LayerPools<E4M3>>),
    Int8(Vec<LayerPools<i8>>),
}

/// One layer's K/V geometry: kv heads and their size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvShape {
    pub kv_heads: usize,
    pub head_dim: usize,
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
        // Rows (a position's values of one kv head) per layer, and their length.
        let rows: Vec<(usize, usize)> =
            shapes.iter().map(|s| (num_blocks * block_size * s.kv_heads, s.head_dim)).collect();
        // Layers in parallel: making a pool resident is mostly the kernel zeroing its
        // pages, which both cores can do.
        fn pools<E: KvElem>(rows: &[(usize, usize)]) -> Vec<LayerPools<E>> {
            use rayon::prelude::*;
            rows.par_iter()
                .map(|&(rows, hd)| {
                    let (values, scales) = (rows * hd, if E::SCALED { rows } else { 0 });
                    LayerPools {
                        k: Buf::zeroed_resident(values),
                        v: Buf::zeroed_resident(values),
                        scales: (Buf::zeroed_resident(scales), Buf::zeroed_resident(scales)),
                    }
                })
                .collect()
        }
        let layers = match dtype {
            KvDtype::F32 => Layers::F32(pools(&rows)),
            KvDtype::F16 => Layers::F16(pools(&rows)),
            KvDtype::Fp8 => Layers::Fp8(pools(&rows)),
            KvDtype::Int8 => Layers::Int8(pools(&rows)),
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
        let row = |s: &KvShape| s.head_dim.saturating_mul(dtype.bytes()).saturating_add(dtype.scale_bytes());
        let slot = shapes.iter().fold(0usize, |a, s| a.saturating_add(s.kv_heads.saturating_mul(row(s))));
        slot.saturating_mul(block_size).saturating_mul(2)
    }

    pub fn dtype(&self) -> KvDtype {
        match self.layers {
            Layers::F32(_) => KvDtype::F32,
            Layers::F16(_) => KvDtype::F16,
            Layers::Fp8(_) => KvDtype::Fp8,
            Layers::Int8(_) => KvDtype::Int8,
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
            Layers::F32(l) => Pools::F32 { k: &l[layer].k, v: &l[layer].v },
            Layers::F16(l) => Pools::F16 { k: &l[layer].k, v: &l[layer].v },
            Layers::Fp8(l) => Pools::Fp8 { k: &l[layer].k, v: &l[layer].v },
            Layers::Int8(l) => {
                let p = &l[layer];
                Pools::Int8 { k: &p.k, v: &p.v, scales: RowScales { k: &p.scales.0, v: &p.scales.1 } }
            }
        };
        let s = self.shapes[layer];
        PagedKv::new(pools, self.block_size, s.kv_heads, s.head_dim)
    }

    /// Copies block `src` into block `dst` in every layer (copy-on-write for forks).
    pub fn copy_block(&mut self, src: u32, dst: u32) {
        // A block's rows per layer, and their length.
        let ns: Vec<(usize, usize)> = self.shapes.iter().map(|s| (self.block_size * s.kv_heads, s.head_dim)).collect();
        fn copy<E: KvElem>(layers: &mut [LayerPools<E>], ns: &[(usize, usize)], src: usize, dst: usize) {
            for (p, &(rows, hd)) in layers.iter_mut().zip(ns) {
                let (s, d, n) = (src * rows * hd, dst * rows * hd, rows * hd);
                p.k.copy_within(s..s + n, d);
                p.v.copy_within(s..s + n, d);
                if E::SCALED {
                    p.scales.0.copy_within(src * rows..(src + 1) * rows, dst * rows);
                    p.scales.1.copy_within(src * rows..(src + 1) * rows, dst * rows);
                }
            }
        }
        match &mut self.layers {
            Layers::F32(l) => copy(l, &ns, src as usize, dst as usize),
            Layers::F16(l) => copy(l, &ns, src as usize, dst as usize),
            Layers::Fp8(l) => copy(l, &ns, src as usize, dst as usize),
            Layers::Int8(l) => copy(l, &ns, src as usize, dst as usize),
        }
    }

    /// Stores all kv heads of one position: `k` and `v` are `[kv_heads * head_dim]`.
    pub fn write(&mut self, layer: usize, block_table: &[u32], pos: usize, k: &[f32], v: &[f32]) {
        let (hd, bs) = (self.shapes[layer].head_dim, self.block_size);
        let (first, slot) = self.layer(layer).slab(block_table, pos, 0);
        fn store<E: KvElem>(pools: &mut LayerPools<E>, at: (usize, usize, usize, usize), k: &[f32], v: &[f32]) {
            let (first, slot, bs, hd) = at;
            // K narrowed a chunk at a time into a buffer, then scattered dim by dim.
            const CHUNK: usize = 64;
            let mut narrow = [E::default(); CHUNK];
            for (h, (k, v)) in k.chunks_exact(hd).zip(v.chunks_exact(hd)).enumerate() {
                let slab = first + h * bs * hd;
                let (ks, vs) = (E::row_scale(k), E::row_scale(v));
                if E::SCALED {
                    let at = RowScales::index(slab, hd, slot);
                    (pools.scales.0[at], pools.scales.1[at]) = (ks, vs);
                }
                for (c, k) in k.chunks(CHUNK).enumerate() {
                    E::narrow(k, &mut narrow[..k.len()], ks);
                    for (d, &x) in narrow[..k.len()].iter().enumerate() {
                        pools.k[slab + (c * CHUNK + d) * bs + slot] = x;
                    }
                }
                let row = slab + slot * hd;
                E::narrow(v, &mut pools.v[row..row + hd], vs);
            }
        }
        let at = (first, slot, bs, hd);
        match &mut self.layers {
            Layers::F32(l) => store(&mut l[layer], at, k, v),
            Layers::F16(l) => store(&mut l[layer], at, k, v),
            Layers::Fp8(l) => store(&mut l[layer], at, k, v),
            Layers::Int8(l) => store(&mut l[layer], at, k, v),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_lands_in_the_mapped_block_and_slot() {
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Fp8, KvDtype::Int8] {
            // 2 layers, 3 blocks of 2 slots, 3 kv heads of dim 2.
            let mut c = KvCache::new(dtype, &[KvShape { kv_heads: 3, head_dim: 2 }; 2], 3, 2);
            let k: Vec<f32> = (0..6).map(|x| x as f32).collect();
            let v: Vec<f32> = (10..16).map(|x| x as f32 / 2.0 + 0.5).collect();
            c.write(1, &[2, 0], 1, &k, &v);
            // (K, V) of a slot in a slab of 2 slots of dim 2: K dim-major, V position-major;
            // scaled rows times their scales.
            let read = |pools: Pools<'_>, slab: usize, slot: usize| -> (Vec<f32>, Vec<f32>) {
                let (ko, vo) = ([slab + slot, slab + 2 + slot], [slab + 2 * slot, slab + 2 * slot + 1]);
                match pools {
                    Pools::F32 { k, v } => (ko.map(|i| k[i]).to_vec(), vo.map(|i| v[i]).to_vec()),
                    Pools::F16 { k, v } => (ko.map(|i| k[i].to_f32()).to_vec(), vo.map(|i| v[i].to_f32()).to_vec()),
                    Pools::Fp8 { k, v } => (ko.map(|i| k[i].to_f32()).to_vec(), vo.map(|i| v[i].to_f32()).to_vec()),
                    Pools::Int8 { k, v, scales } => {
                        let row = slab / 2 + slot;
                        let (ks, vs) = (scales.k[row], scales.v[row]);
                        (ko.map(|i| k[i] as f32 * ks).to_vec(), vo.map(|i| v[i] as f32 * vs).to_vec())
                    }
                }
            };
            // Small integers, and halves below 8, are exact in f16 and E4M3 too; int8 rows
            // are within half a step of their largest value.
            let near = |got: Vec<f32>, want: &[f32]| {
                let step =
                    if dtype == KvDtype::Int8 { want.iter().fold(0f32, |m, x| m.max(x.abs())) / 127.0 } else { 0.0 };
                got.len() == want.len() && got.iter().zip(want).all(|(g, w)| (g - w).abs() <= step / 2.0 * 1.0001)
            };
            let view = c.layer(1);
            for h in 0..3 {
                let (slab, slot) = view.slab(&[2, 0], 1, h);
                assert_eq!((slab, slot), ((2 * 3 + h) * 2 * 2, 1));
                let (gk, gv) = read(view.pools, slab, slot);
                assert!(
                    near(gk.clone(), &k[2 * h..2 * h + 2]) && near(gv.clone(), &v[2 * h..2 * h + 2]),
                    "{dtype} {gk:?} {gv:?}"
                );
            }
            let slabs = 3 * 3;
            let zero = (vec![0.0; 2], vec![0.0; 2]);
            assert!((0..slabs).all(|b| (0..2).all(|slot| read(c.layer(0).pools, 4 * b, slot) == zero)));
            let shapes = [KvShape { kv_heads: 3, head_dim: 2 }; 2];
            let row = 2 * dtype.bytes() + dtype.scale_bytes();
            assert_eq!(KvCache::bytes_per_block(dtype, &shapes, 2), 2 * 2 * 2 * 3 * row);
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

        // Scaled rows take their scales along: layer 1's block 2 holds its rows' scales at
        // 4..6 (two slots of one kv head), block 1 at 2..4.
        let mut c = KvCache::new(KvDtype::Int8, &shapes, 3, 2);
        c.write(1, &[2, 0], 1, &k, &v);
        c.copy_block(2, 1);
        let Pools::Int8 { k: kp, v: vp, scales } = c.layer(1).pools else { unreachable!() };
        assert_eq!((kp[32..48].to_vec(), vp[32..48].to_vec()), (kp[16..32].to_vec(), vp[16..32].to_vec()));
        assert_eq!((scales.k[5], scales.v[5]), (7.0 / 127.0, 17.0 / 127.0));
        assert_eq!((&scales.k[2..4], &scales.v[2..4]), (&scales.k[4..6], &scales.v[4..6]));
        assert_eq!(vp[16 + 8..32], [75, 82, 90, 97, 105, 112, 120, 127]);
    }
}
