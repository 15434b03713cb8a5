//! `Y = X · Wᵀ` for row-major `X [m, k]` and a weight `W [n, k]`: every linear layer.
//!
//! Written by hand for two reasons:
//! - **Batch invariance.** Every output element is one sequential fused multiply-add chain
//!   over `k = 0..K`. Row tiling and K-blocking only decide where partial sums wait in
//!   registers or in `Y` (stored exactly as f32), so a sequence's logits are bit-identical
//!   alone or inside any batch — which a general BLAS does not promise.
//! - **Speed at decode batch sizes.** Weights are packed once at load into 16-column panels
//!   stored k-major ([`PackedMatrix`]), so the kernel streams them sequentially (bandwidth
//!   bound at m = 1) and a 6×16 register tile keeps both FMA units busy for m ≥ 6.
//! - **16-bit weights stay 16-bit.** Panels may hold f16 or bf16 values, widened to f32 as
//!   they are loaded into registers: half the bytes streamed per token, and, since widening
//!   is exact, results bit-identical to packing the widened values as f32.
//!
//! Work is split over panels of output columns, so at m = 1 both cores stream disjoint
//! parts of the weights. Call it from inside the engine's rayon pool: dispatch from outside
//! a pool costs ~10 µs per call (`shared/research/cpu-kernels.md`).

use super::buffer::{Buf, F32Buf};
use rayon::prelude::*;

/// Output columns per panel (two AVX2 registers).
const NP: usize = 16;
/// Rows of `X` per register tile.
const MR: usize = 6;
/// Depth of a K-block: one panel block (`KC × NP` floats, 16 KiB) stays in L1.
const KC: usize = 256;
/// Rows of `X` per M-block, kept in L2 while a K-block of weights streams past.
const MB: usize = 96;
/// Most panels one task computes: its K-block of weights (16 × 16 KiB) and an M-block of
/// its outputs then fit in L2 beside the packed rows (the LM head gains ~8% at m ≥ 32).
const MAX_TASK_PANELS: usize = 16;
/// Below this many multiply-adds a call runs on the calling thread.
const PARALLEL_MIN_WORK: usize = 1 << 16;
/// Below this many elements of `X` its packing runs on the calling thread.
const PARALLEL_MIN_PACK: usize = 1 << 15;

/// The 16-bit float formats weights can stay in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Half {
    F16,
    Bf16,
}

impl Half {
    /// The value of a bit pattern of this format.
    pub fn to_f32(self, bits: u16) -> f32 {
        match self {
            Half::F16 => half::f16::from_bits(bits).to_f32(),
            Half::Bf16 => half::bf16::from_bits(bits).to_f32(),
        }
    }
}

/// Panel storage: f32, or 16-bit bit patterns of one [`Half`] format.
enum Panels {
    F32(F32Buf),
    Half(Half, Buf<u16>),
}

/// Element kinds as the kernels see them (const generic parameters).
const KIND_F32: u8 = 0;
const KIND_F16: u8 = 1;
const KIND_BF16: u8 = 2;

/// A weight matrix `[n, k]` repacked for [`matmul`]: K-blocks of `KC` rows, each holding
/// every panel of `NP` output columns as `[kc][NP]` (the last panel zero-padded).
pub struct PackedMatrix {
    n: usize,
    k: usize,
    data: Panels,
}

impl PackedMatrix {
    /// Packs a row-major `[n, k]` matrix.
    pub fn pack(w: &[f32], n: usize, k: usize) -> Self {
        assert_eq!(w.len(), n * k, "pack: {} elements for a [{n}, {k}] matrix", w.len());
        let panels = n.div_ceil(NP);
        let mut data = F32Buf::zeroed(panels * NP * k);
        for (row, src) in w.chunks_exact(k).enumerate() {
            for (col, &v) in src.iter().enumerate() {
                data[Self::offset(panels, k, row, col)] = v;
            }
        }
        PackedMatrix { n, k, data: Panels::F32(data) }
    }

    /// Packs a row-major `[n, k]` matrix of 16-bit floats (bit patterns), keeping them 16-bit.
    pub fn pack_half(w: &[u16], format: Half, n: usize, k: usize) -> Self {
        assert_eq!(w.len(), n * k, "pack: {} elements for a [{n}, {k}] matrix", w.len());
        let panels = n.div_ceil(NP);
        let mut data = Buf::zeroed(panels * NP * k);
        for (row, src) in w.chunks_exact(k).enumerate() {
            for (col, &v) in src.iter().enumerate() {
                data[Self::offset(panels, k, row, col)] = v;
            }
        }
        PackedMatrix { n, k, data: Panels::Half(format, data) }
    }

    /// The element at a packed offset, as f32.
    fn at(&self, i: usize) -> f32 {
        match &self.data {
            Panels::F32(d) => d[i],
            Panels::Half(h, d) => h.to_f32(d[i]),
        }
    }

    /// The panels' first byte and the kernels' element kind.
    fn raw(&self) -> (*const u8, u8) {
        match &self.data {
            Panels::F32(d) => (d.as_ptr().cast(), KIND_F32),
            Panels::Half(Half::F16, d) => (d.as_ptr().cast(), KIND_F16),
            Panels::Half(Half::Bf16, d) => (d.as_ptr().cast(), KIND_BF16),
        }
    }

    #[inline]
    fn offset(panels: usize, k: usize, row: usize, col: usize) -> usize {
        let k0 = col / KC * KC;
        let kcb = KC.min(k - k0);
        k0 * panels * NP + (row / NP) * kcb * NP + (col - k0) * NP + row % NP
    }

    /// Multiply-adds one activation row costs.
    pub fn products(&self) -> usize {
        self.n * self.k
    }

    /// Bytes of weights one pass over the matrix reads.
    pub fn bytes(&self) -> usize {
        match &self.data {
            Panels::F32(d) => d.len() * 4,
            Panels::Half(_, d) => d.len() * 2,
        }
    }

    /// Copies row `r` (for example an embedding, when the LM head is tied to it).
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        let panels = self.n.div_ceil(NP);
        for (c, o) in out[..self.k].iter_mut().enumerate() {
            *o = self.at(Self::offset(panels, self.k, r, c));
        }
    }
}

/// `y[i, j] = Σ_k x[i, k] · w[j, k]` for `i < m`; `y` is `[m, n]` row-major.
pub fn matmul(x: &[f32], w: &PackedMatrix, y: &mut [f32], m: usize) {
    let (n, k) = (w.n, w.k);
    assert!(x.len() >= m * k, "matmul: x has {} elements, need {}", x.len(), m * k);
    assert!(y.len() >= m * n, "matmul: y has {} elements, need {}", y.len(), m * n);
    if m == 0 || n == 0 {
        return;
    }
    match w.raw().1 {
        KIND_F16 => run::<KIND_F16>(x, w, y, m),
        KIND_BF16 => run::<KIND_BF16>(x, w, y, m),
        _ => run::<KIND_F32>(x, w, y, m),
    }
}

/// [`matmul`] for panels of element kind `KIND`.
fn run<const KIND: u8>(x: &[f32], w: &PackedMatrix, y: &mut [f32], m: usize) {
    let (n, k) = (w.n, w.k);
    let out = SharedOut(y.as_mut_ptr());
    let panels = n.div_ceil(NP);
    PACKED_X.with_borrow_mut(|xp| {
        let tiles = pack_rows(&x[..m * k], m, k, xp);
        let (xp, tiles) = (&xp[..], &tiles[..]);
        let threads = rayon::current_num_threads();
        if threads == 1 || m * n * k < PARALLEL_MIN_WORK {
            // SAFETY: one task covers all panels of a buffer checked above.
            unsafe { panel_range::<KIND>(xp, tiles, w, out, 0, panels) };
            return;
        }
        // Several tasks per thread so uneven progress (the other core busy) balances out, a
        // multiple of the thread count of near-equal size (sizes differ by at most one panel
        // and alternate, so rayon's halving splits the work evenly), and few enough panels
        // per task that its weights and outputs stay in L2.
        let tasks = (threads * 4).max(panels.div_ceil(MAX_TASK_PANELS)).next_multiple_of(threads).min(panels);
        (0..tasks).into_par_iter().for_each(|t| {
            // SAFETY: tasks write disjoint column ranges of a buffer checked above.
            unsafe { panel_range::<KIND>(xp, tiles, w, out, t * panels / tasks, (t + 1) * panels / tasks) };
        });
    });
}

thread_local! {
    /// The calling thread's packed copy of `X`, reused so steps do not allocate.
    static PACKED_X: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A register tile: rows `start..start + rows` of `X`.
#[derive(Clone, Copy)]
struct RowTile {
    start: usize,
    rows: usize,
}

/// Splits the rows into M-blocks of at most `MB` rows, each cut into near-equal tiles of at
/// most `MR` rows (32 rows → 6+6+5+5+5+5 rather than a slow tile of 2), and packs each
/// tile as `[k][MR]` into `xp` so its values for one `k` sit together (tiles in parallel
/// when `X` is large: packing on one thread would idle the other core).
fn pack_rows(x: &[f32], m: usize, k: usize, xp: &mut Vec<f32>) -> Vec<RowTile> {
    let mut tiles = Vec::with_capacity(m.div_ceil(MR) + m.div_ceil(MB));
    for m0 in (0..m).step_by(MB) {
        let rows = MB.min(m - m0);
        let count = rows.div_ceil(MR);
        let mut start = m0;
        for t in 0..count {
            let r = rows / count + usize::from(t < rows % count);
            tiles.push(RowTile { start, rows: r });
            start += r;
        }
    }
    // Every slot is written below (rows past a tile's end as zeros), so old contents can stay.
    xp.resize(tiles.len() * MR * k, 0.0);
    let pack_tile = |(dst, tile): (&mut [f32], &RowTile)| {
        for r in 0..tile.rows {
            for (kk, &v) in x[(tile.start + r) * k..(tile.start + r + 1) * k].iter().enumerate() {
                dst[kk * MR + r] = v;
            }
        }
        for chunk in dst.chunks_exact_mut(MR) {
            chunk[tile.rows..].fill(0.0);
        }
    };
    let xp = &mut xp[..tiles.len() * MR * k];
    if m * k >= PARALLEL_MIN_PACK {
        xp.par_chunks_exact_mut(MR * k).zip(&tiles).for_each(pack_tile);
    } else {
        xp.chunks_exact_mut(MR * k).zip(&tiles).for_each(pack_tile);
    }
    tiles
}

/// Output pointer shared by tasks that write disjoint columns.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: every task writes a disjoint set of elements; see `matmul`.
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

/// Computes the columns of panels `p0..p1` for all rows; `xp` holds `tiles` packed by
/// `pack_rows`.
///
/// # Safety
/// `y` must point to `m * n` writable floats that no other thread writes in these columns.
unsafe fn panel_range<const KIND: u8>(
    xp: &[f32],
    tiles: &[RowTile],
    w: &PackedMatrix,
    y: SharedOut,
    p0: usize,
    p1: usize,
) {
    unsafe {
        let (n, k) = (w.n, w.k);
        let panels = n.div_ceil(NP);
        let (base, _) = w.raw();
        let es = elem_size(KIND);
        // An M-block's outputs stay in cache while every K-block adds to them; within a K-block
        // the block's tiles share a panel of weights while it is in L1.
        for (b0, block_tiles) in m_blocks(tiles) {
            for k0 in (0..k).step_by(KC) {
                let kcb = KC.min(k - k0);
                let mut p = p0;
                while p < p1 {
                    let wp = base.add((k0 * panels * NP + p * kcb * NP) * es);
                    // Two full panels side by side in 512-bit registers, where the CPU has them,
                    // for tiles of several rows: a single row waits on memory, and streaming one
                    // panel at a time read it faster (BitNet's F16 head at one stream: 34–40
                    // against 28 tok/s).
                    #[cfg(target_arch = "x86_64")]
                    if p + 1 < p1 && (p + 2) * NP <= n && avx2::wide() {
                        for (t, tile) in block_tiles.iter().enumerate() {
                            let xs = &xp[(b0 + t) * MR * k + k0 * MR..];
                            let yp = y.0.add(tile.start * n + p * NP);
                            if tile.rows > 1 {
                                avx2::wide_tile(tile.rows, xs.as_ptr(), wp, kcb * NP * es, kcb, yp, n, k0 == 0, KIND);
                            } else {
                                tile_kernel::<KIND>(1, xs, wp, kcb, yp, n, k0 == 0);
                                tile_kernel::<KIND>(1, xs, wp.add(kcb * NP * es), kcb, yp.add(NP), n, k0 == 0);
                            }
                        }
                        p += 2;
                        continue;
                    }
                    let cols = NP.min(n - p * NP);
                    for (t, tile) in block_tiles.iter().enumerate() {
                        let xs = &xp[(b0 + t) * MR * k + k0 * MR..];
                        let yp = y.0.add(tile.start * n + p * NP);
                        if cols == NP {
                            tile_kernel::<KIND>(tile.rows, xs, wp, kcb, yp, n, k0 == 0);
                        } else {
                            // Edge panel: run the full-width tile on a scratch copy.
                            let mut tmp = [0f32; MR * NP];
                            for r in 0..tile.rows {
                                for c in 0..cols {
                                    tmp[r * NP + c] = *yp.add(r * n + c);
                                }
                            }
                            tile_kernel::<KIND>(tile.rows, xs, wp, kcb, tmp.as_mut_ptr(), NP, k0 == 0);
                            for r in 0..tile.rows {
                                for c in 0..cols {
                                    *yp.add(r * n + c) = tmp[r * NP + c];
                                }
                            }
                        }
                    }
                    p += 1;
                }
            }
        }
    }
}

/// Groups consecutive tiles by M-block: (index of the block's first tile, its tiles).
fn m_blocks(tiles: &[RowTile]) -> impl Iterator<Item = (usize, &[RowTile])> {
    let mut first = 0;
    std::iter::from_fn(move || {
        let rest = tiles.get(first..).filter(|r| !r.is_empty())?;
        let block = rest[0].start / MB;
        let len = rest.iter().take_while(|t| t.start / MB == block).count();
        let out = (first, &rest[..len]);
        first += len;
        Some(out)
    })
}

fn elem_size(kind: u8) -> usize {
    if kind == KIND_F32 {
        4
    } else {
        2
    }
}

/// Element `i` of panels of kind `KIND` at `p`, as f32.
///
/// # Safety
/// `p` must be valid for element `i`.
#[inline]
unsafe fn read<const KIND: u8>(p: *const u8, i: usize) -> f32 {
    unsafe {
        match KIND {
            KIND_F32 => *p.cast::<f32>().add(i),
            KIND_F16 => Half::F16.to_f32(*p.cast::<u16>().add(i)),
            _ => Half::Bf16.to_f32(*p.cast::<u16>().add(i)),
        }
    }
}

/// `rows × NP` outputs at `y` (row stride `ldy`) over one K-block; `x` is the tile's packed
/// `[kcb][MR]` values, `wp` the panel's `[kcb][NP]` weights of kind `KIND`; `first` starts
/// the sums from zero, otherwise they continue from `y`.
///
/// # Safety
/// `wp` must cover `kcb × NP` elements and `y` must be valid for `rows` rows of `NP` floats
/// at stride `ldy`.
#[inline]
unsafe fn tile_kernel<const KIND: u8>(
    rows: usize,
    x: &[f32],
    wp: *const u8,
    kcb: usize,
    y: *mut f32,
    ldy: usize,
    first: bool,
) {
    unsafe {
        debug_assert!(x.len() >= kcb * MR);
        #[cfg(target_arch = "x86_64")]
        if avx2::available() {
            let x = x.as_ptr();
            match rows {
                6 => avx2::tile::<6, KIND>(x, wp, kcb, y, ldy, first),
                5 => avx2::tile::<5, KIND>(x, wp, kcb, y, ldy, first),
                4 => avx2::tile::<4, KIND>(x, wp, kcb, y, ldy, first),
                3 => avx2::tile::<3, KIND>(x, wp, kcb, y, ldy, first),
                2 => avx2::tile::<2, KIND>(x, wp, kcb, y, ldy, first),
                _ => avx2::tile::<1, KIND>(x, wp, kcb, y, ldy, first),
            }
            return;
        }
        for r in 0..rows {
            for c in 0..NP {
                let mut acc = if first { 0.0 } else { *y.add(r * ldy + c) };
                for kk in 0..kcb {
                    acc = x[kk * MR + r].mul_add(read::<KIND>(wp, kk * NP + c), acc);
                }
                *y.add(r * ldy + c) = acc;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::{KIND_BF16, KIND_F16, KIND_F32, MR, NP};

    /// How many `k` steps (64-byte lines of a panel) ahead to prefetch weights.
    const PREFETCH_AHEAD: usize = 24;
    use std::arch::x86_64::*;
    use std::sync::OnceLock;

    pub fn available() -> bool {
        static AVAILABLE: OnceLock<bool> = OnceLock::new();
        *AVAILABLE.get_or_init(|| {
            is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
        })
    }

    /// Eight weights of kind `KIND` at element `i` of `wp`, widened to f32 (exactly).
    ///
    /// # Safety
    /// AVX must be available, and `wp` hold eight weights of kind `KIND` from index `i`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn load8<const KIND: u8>(wp: *const u8, i: usize) -> __m256 {
        unsafe {
            match KIND {
                KIND_F32 => _mm256_loadu_ps(wp.cast::<f32>().add(i)),
                KIND_F16 => _mm256_cvtph_ps(_mm_loadu_si128(wp.cast::<u16>().add(i).cast())),
                // bf16 is the top half of an f32.
                _ => {
                    let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(wp.cast::<u16>().add(i).cast()));
                    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h))
                }
            }
        }
    }

    /// Whether two panels run side by side in 512-bit registers ([`wide_tile`]): AVX-512F
    /// is present and `WEFT_NO_VNNI` unset (set, the AVX2 tiles run, as the quantized
    /// kernels' AVX2 copies do). Full-width AVX-512 (Zen 5) runs a 512-bit FMA as fast
    /// as a 256-bit one.
    pub fn wide() -> bool {
        static WIDE: OnceLock<bool> = OnceLock::new();
        *WIDE.get_or_init(|| {
            std::env::var_os("WEFT_NO_VNNI").is_none_or(|v| v.is_empty())
                && available()
                && is_x86_feature_detected!("avx512f")
        })
    }

    /// [`tile`] of `rows` rows over two neighbouring panels (the second `next` bytes after
    /// `wp`), their 32 outputs a row contiguous at `y`: each lane the same fused
    /// multiply-add chain as in [`tile`], so the same bits.
    ///
    /// # Safety
    /// As [`tile`]'s for each panel, and [`wide`] must hold.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn wide_tile(
        rows: usize,
        x: *const f32,
        wp: *const u8,
        next: usize,
        kcb: usize,
        y: *mut f32,
        ldy: usize,
        first: bool,
        kind: u8,
    ) {
        macro_rules! kinds {
            ($r:literal) => {
                match kind {
                    KIND_F32 => wide_rows::<$r, KIND_F32>(x, wp, next, kcb, y, ldy, first),
                    KIND_F16 => wide_rows::<$r, KIND_F16>(x, wp, next, kcb, y, ldy, first),
                    _ => wide_rows::<$r, KIND_BF16>(x, wp, next, kcb, y, ldy, first),
                }
            };
        }
        unsafe {
            match rows {
                6 => kinds!(6),
                5 => kinds!(5),
                4 => kinds!(4),
                3 => kinds!(3),
                2 => kinds!(2),
                _ => kinds!(1),
            }
        }
    }

    /// Sixteen weights of kind `KIND` at element `i` of `wp`, widened to f32 (exactly).
    ///
    /// # Safety
    /// AVX-512F must be available, and `wp` hold sixteen weights of kind `KIND` from index `i`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    #[inline]
    unsafe fn load16<const KIND: u8>(wp: *const u8, i: usize) -> __m512 {
        unsafe {
            match KIND {
                KIND_F32 => _mm512_loadu_ps(wp.cast::<f32>().add(i)),
                KIND_F16 => _mm512_cvtph_ps(_mm256_loadu_si256(wp.cast::<u16>().add(i).cast())),
                _ => {
                    let h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(wp.cast::<u16>().add(i).cast()));
                    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(h))
                }
            }
        }
    }

    /// [`wide_tile`] for `R` rows.
    ///
    /// # Safety
    /// As [`wide_tile`]'s.
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    unsafe fn wide_rows<const R: usize, const KIND: u8>(
        x: *const f32,
        wp: *const u8,
        next: usize,
        kcb: usize,
        y: *mut f32,
        ldy: usize,
        first: bool,
    ) {
        unsafe {
            let es = super::elem_size(KIND);
            let panel = [wp, wp.add(next)];
            let mut acc = [[_mm512_setzero_ps(); 2]; R];
            if !first {
                for (r, a) in acc.iter_mut().enumerate() {
                    for (v, av) in a.iter_mut().enumerate() {
                        *av = _mm512_loadu_ps(y.add(r * ldy + NP * v));
                    }
                }
            }
            for kk in 0..kcb {
                // As in [`tile`]: several rows are compute-bound, so ask for weights early.
                if R > 1 {
                    for p in panel {
                        _mm_prefetch::<_MM_HINT_T0>(p.add((kk + PREFETCH_AHEAD) * NP * es) as *const i8);
                    }
                }
                let wv = [load16::<KIND>(panel[0], kk * NP), load16::<KIND>(panel[1], kk * NP)];
                for (r, a) in acc.iter_mut().enumerate() {
                    let xb = _mm512_set1_ps(*x.add(kk * MR + r));
                    for (av, w) in a.iter_mut().zip(&wv) {
                        *av = _mm512_fmadd_ps(xb, *w, *av);
                    }
                }
            }
            for (r, a) in acc.iter().enumerate() {
                for (v, av) in a.iter().enumerate() {
                    _mm512_storeu_ps(y.add(r * ldy + NP * v), *av);
                }
            }
        }
    }

    /// # Safety
    /// AVX2, FMA and F16C must be available; `x` covers `kcb × MR`, `wp` covers `kcb × NP`
    /// elements of kind `KIND`, and `y` covers `R` rows of `NP` at stride `ldy`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn tile<const R: usize, const KIND: u8>(
        x: *const f32,
        wp: *const u8,
        kcb: usize,
        y: *mut f32,
        ldy: usize,
        first: bool,
    ) {
        unsafe {
            let es = super::elem_size(KIND);
            const V: usize = NP / 8;
            let mut acc = [[_mm256_setzero_ps(); V]; R];
            if !first {
                for (r, a) in acc.iter_mut().enumerate() {
                    for (v, av) in a.iter_mut().enumerate() {
                        *av = _mm256_loadu_ps(y.add(r * ldy + 8 * v));
                    }
                }
            }
            for kk in 0..kcb {
                // With several rows the tile is compute-bound, so ask for the weights early; a
                // single row is bandwidth-bound and the hardware prefetcher does better alone.
                if R > 1 {
                    _mm_prefetch::<_MM_HINT_T0>(wp.add((kk + PREFETCH_AHEAD) * NP * es) as *const i8);
                }
                let mut wv = [_mm256_setzero_ps(); V];
                for (v, w) in wv.iter_mut().enumerate() {
                    *w = load8::<KIND>(wp, kk * NP + 8 * v);
                }
                for (r, a) in acc.iter_mut().enumerate() {
                    let xb = _mm256_broadcast_ss(&*x.add(kk * MR + r));
                    for (av, w) in a.iter_mut().zip(&wv) {
                        *av = _mm256_fmadd_ps(xb, *w, *av);
                    }
                }
            }
            for (r, a) in acc.iter().enumerate() {
                for (v, av) in a.iter().enumerate() {
                    _mm256_storeu_ps(y.add(r * ldy + 8 * v), *av);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::{assert_close, random_vec};

    fn naive(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
        let mut y = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let s: f64 = (0..k).map(|p| x[i * k + p] as f64 * w[j * k + p] as f64).sum();
                y[i * n + j] = s as f32;
            }
        }
        y
    }

    #[test]
    fn matches_naive_on_odd_sizes() {
        for &(m, k, n) in &[
            (1, 1, 1),
            (1, 7, 3),
            (3, 9, 5),
            (2, 64, 16),
            (5, 172, 64),
            (7, 33, 131),
            (13, 300, 40),
            (100, 520, 17),
            (1, 576, 1536),
        ] {
            let x = random_vec(m * k, 1 + m as u64);
            let w = random_vec(n * k, 2 + n as u64);
            let mut y = vec![f32::NAN; m * n];
            matmul(&x, &PackedMatrix::pack(&w, n, k), &mut y, m);
            assert_close(&y, &naive(&x, &w, m, k, n), 1e-4, &format!("m={m} k={k} n={n}"));
        }
    }

    /// Each output is one fused multiply-add chain over `k` from zero, bit for bit, whatever
    /// the tile (AVX2's, the 512-bit two-panel one, the portable loop) and the K-blocking:
    /// every row count of a tile, panels in pairs and a ragged last one, every weight kind.
    #[test]
    fn every_output_is_one_fused_chain() {
        for &(k, n) in &[(300, 80), (40, 37), (600, 16)] {
            let w = random_vec(n * k, 21);
            let f16: Vec<u16> = w.iter().map(|&v| half::f16::from_f32(v).to_bits()).collect();
            let bf16: Vec<u16> = w.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
            let kinds = [
                (PackedMatrix::pack(&w, n, k), w.clone()),
                (PackedMatrix::pack_half(&f16, Half::F16, n, k), f16.iter().map(|&b| Half::F16.to_f32(b)).collect()),
                (
                    PackedMatrix::pack_half(&bf16, Half::Bf16, n, k),
                    bf16.iter().map(|&b| Half::Bf16.to_f32(b)).collect(),
                ),
            ];
            for (packed, values) in &kinds {
                for m in 1..=13 {
                    let x = random_vec(m * k, 22 + m as u64);
                    let mut y = vec![f32::NAN; m * n];
                    matmul(&x, packed, &mut y, m);
                    for i in 0..m {
                        for j in 0..n {
                            let want = (0..k).fold(0f32, |acc, p| x[i * k + p].mul_add(values[j * k + p], acc));
                            assert_eq!(y[i * n + j].to_bits(), want.to_bits(), "k={k} n={n} m={m} [{i},{j}]");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn parallel_split_matches_naive() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        let (m, k, n) = (9, 300, 301);
        let x = random_vec(m * k, 11);
        let w = random_vec(n * k, 12);
        let mut y = vec![f32::NAN; m * n];
        pool.install(|| matmul(&x, &PackedMatrix::pack(&w, n, k), &mut y, m));
        assert_close(&y, &naive(&x, &w, m, k, n), 1e-4, "3 threads");
    }

    /// A row's result must not depend on how many other rows share the call.
    #[test]
    fn rows_are_bit_identical_whatever_the_batch() {
        let (k, n) = (603, 37);
        let w = PackedMatrix::pack(&random_vec(n * k, 5), n, k);
        let xs = random_vec(200 * k, 6);
        let mut all = vec![0f32; 200 * n];
        matmul(&xs, &w, &mut all, 200);
        for i in [0, 1, 5, 6, 33, 95, 96, 199] {
            let mut one = vec![0f32; n];
            matmul(&xs[i * k..(i + 1) * k], &w, &mut one, 1);
            assert_eq!(one, all[i * n..(i + 1) * n], "row {i}");
        }
    }

    /// Every row count from 0 to past two M-blocks, with `k` and `n` off the panel and
    /// tile sizes: each row bit-identical to its result in the largest batch, that batch
    /// close to the naive product, and nothing written past the `m` rows asked for.
    #[test]
    fn every_row_count() {
        let m_max = 2 * MB + MR + 1;
        for (k, n) in [(1, 1), (37, NP + 3), (256, 3 * NP)] {
            let w = random_vec(n * k, 13);
            let x = random_vec(m_max * k, 14);
            let packed = PackedMatrix::pack(&w, n, k);
            let run = |m: usize| {
                let mut y = vec![f32::NAN; (m + 1) * n];
                matmul(&x, &packed, &mut y, m);
                assert!(y[m * n..].iter().all(|v| v.is_nan()), "m={m} k={k} n={n}: wrote past its rows");
                y.truncate(m * n);
                y
            };
            let all = run(m_max);
            assert_close(&all, &naive(&x, &w, m_max, k, n), 1e-4, &format!("k={k} n={n}"));
            for m in 0..m_max {
                assert_eq!(run(m), all[..m * n], "m={m} k={k} n={n}");
            }
        }
    }

    /// 16-bit panels give exactly the f32 result of the widened values, on every path
    /// (edge panels, several K-blocks, one row and many).
    #[test]
    fn half_panels_match_widened_f32_bit_for_bit() {
        for format in [Half::F16, Half::Bf16] {
            for &(m, k, n) in &[(1, 300, 37), (7, 520, 16), (33, 64, 50)] {
                let bits: Vec<u16> = random_vec(n * k, 9)
                    .iter()
                    .map(|&v| match format {
                        Half::F16 => half::f16::from_f32(v).to_bits(),
                        Half::Bf16 => half::bf16::from_f32(v).to_bits(),
                    })
                    .collect();
                let wide: Vec<f32> = bits.iter().map(|&b| format.to_f32(b)).collect();
                let x = random_vec(m * k, 10);
                let (mut a, mut b) = (vec![0f32; m * n], vec![0f32; m * n]);
                let packed = PackedMatrix::pack_half(&bits, format, n, k);
                assert_eq!(packed.bytes() * 2, PackedMatrix::pack(&wide, n, k).bytes());
                matmul(&x, &packed, &mut a, m);
                matmul(&x, &PackedMatrix::pack(&wide, n, k), &mut b, m);
                assert_eq!(a, b, "{format:?} m={m} k={k} n={n}");
                let mut row = vec![0f32; k];
                packed.row_into(n - 1, &mut row);
                assert_eq!(row, wide[(n - 1) * k..]);
            }
        }
    }

    #[test]
    fn packed_rows_read_back() {
        let (n, k) = (21, 300);
        let w = random_vec(n * k, 3);
        let p = PackedMatrix::pack(&w, n, k);
        let mut row = vec![0f32; k];
        for r in [0, 15, 16, 20] {
            p.row_into(r, &mut row);
            assert_eq!(row, w[r * k..(r + 1) * k]);
        }
    }
}
