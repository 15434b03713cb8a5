//! A linear layer's weight in the form it is computed in: f32 packed panels (the exact
//! reference path), or the file's GGML block formats computed with int8 activations.

use super::loader::WeightSource;
use super::tensor::HalfRows;
use crate::kernels::matmul::Half;
use crate::kernels::qmatmul::{qmatmul, QActs, QMatrix};
use crate::kernels::quant::GgmlType;
use crate::kernels::quantize::{fitting, quantize_matrix};
use crate::kernels::ternary;
use crate::kernels::{matmul, PackedMatrix};
use anyhow::Result;
use rayon::prelude::*;
use std::borrow::Cow;
use std::ops::Range;

/// Which form weights are computed in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightDtype {
    /// Block-format weights stay in their format; float weights are computed in f32 or
    /// 16 bits as stored, except a 16-bit LM head beside block-format layers, computed
    /// from a Q8_0 copy with its leading logits from the stored rows ([`Weight::load_head`]).
    Auto,
    /// As `Auto`, but the LM head too is computed as stored.
    Stored,
    /// Everything widened to f32 at load: the exact reference path.
    F32,
    /// As `Auto`, but float matrices are quantized to this block format at load.
    Quantize(GgmlType),
}

impl WeightDtype {
    /// Whether weights stored in a block format or in 16 bits stay so.
    fn keeps_stored(self) -> bool {
        self != WeightDtype::F32
    }
}

impl std::str::FromStr for WeightDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(WeightDtype::Auto),
            "stored" => Ok(WeightDtype::Stored),
            "f32" => Ok(WeightDtype::F32),
            other => Err(format!("unknown dtype {other:?} (auto, stored or f32)")),
        }
    }
}

pub enum Weight {
    F32(PackedMatrix),
    Quant(QMatrix),
    /// A 16-bit LM head computed from a Q8_0 copy ([`Weight::load_head`]).
    Refined {
        coarse: QMatrix,
        exact: HalfRows,
    },
}

impl Weight {
    /// Stacks `parts` (tensor names with their `[rows, k]` shapes) along the output
    /// dimension: unless `dtype` is `F32`, kept in their block formats when every part is
    /// stored in one, else quantized when `dtype` asks for a format, else kept 16-bit when
    /// every part is stored so; otherwise widened to f32 and packed.
    pub fn load(src: &dyn WeightSource, parts: &[(&str, [usize; 2])], dtype: WeightDtype) -> Result<Self> {
        if let Some(q) = Self::load_blocks(src, parts, dtype)? {
            return Ok(Weight::Quant(q));
        }
        if let Some(q) = Self::quantize_at_load(src, parts, dtype)? {
            return Ok(Weight::Quant(q));
        }
        if let Some(half) = Self::load_half(src, parts, dtype)? {
            let packed = PackedMatrix::pack_half(half.bits(), half.format, half.rows(), half.cols());
            parts.iter().for_each(|(name, _)| src.release(name));
            return Ok(Weight::F32(packed));
        }
        let k = parts[0].1[1];
        let rows: usize = parts.iter().map(|(_, s)| s[0]).sum();
        if let [(name, shape)] = parts {
            return Ok(Weight::F32(PackedMatrix::pack(src.load(name, shape)?.data(), rows, k)));
        }
        let mut all = Vec::with_capacity(rows * k);
        for (name, shape) in parts {
            all.extend_from_slice(src.load(name, shape)?.data());
        }
        Ok(Weight::F32(PackedMatrix::pack(&all, rows, k)))
    }

    /// The LM head `[vocab, k]` (with tied embeddings, also the embeddings' rows). Stored in
    /// 16 bits beside layers computed in block formats (`quantized`), with `dtype` auto,
    /// its logits come from a Q8_0 copy and [`Weight::refine_top`] recomputes the leading
    /// ones from the stored rows, which stay in the mapped file: BitNet b1.58's f16 head is
    /// over half of the bytes a token reads, and a Q8_0 copy reads 53 % of them. Otherwise
    /// as [`Weight::load`].
    pub fn load_head(
        src: &dyn WeightSource,
        name: &str,
        shape: [usize; 2],
        dtype: WeightDtype,
        quantized: bool,
    ) -> Result<Self> {
        let k = shape[1];
        let copied = dtype == WeightDtype::Auto && quantized && fitting(GgmlType::Q8_0, k).is_some();
        let Some(exact) = (if copied { src.load_half(name, &shape)? } else { None }) else {
            return Self::load(src, &[(name, shape)], dtype);
        };
        let widened = |r: Range<usize>| {
            let bits = &exact.bits()[r.start * k..r.end * k];
            Cow::Owned(bits.iter().map(|&b| exact.format.to_f32(b)).collect())
        };
        let raw = quantize_matrix(GgmlType::Q8_0, k, shape[0], widened);
        src.release(name);
        let coarse = QMatrix::new(k, vec![(GgmlType::Q8_0, shape[0], raw.into())])?;
        Ok(Weight::Refined { coarse, exact })
    }

    /// A `[rows, k]` matrix from values computed at load (experts cut from a fused
    /// tensor): quantized when `dtype` asks for a format that fits, else f32.
    pub fn from_values(values: &[f32], rows: usize, k: usize, dtype: WeightDtype) -> Result<Self> {
        if let WeightDtype::Quantize(target) = dtype {
            if let Some(t) = fitting(target, k) {
                let raw = quantize_matrix(t, k, rows, |r| Cow::Borrowed(&values[r.start * k..r.end * k]));
                return Ok(Weight::Quant(QMatrix::new(k, vec![(t, rows, raw.into())])?));
            }
        }
        Ok(Weight::F32(PackedMatrix::pack(values, rows, k)))
    }

    /// A `[rows, k]` matrix from block-format rows cut at load (experts from a fused
    /// tensor): kept in the format unless `dtype` is f32, then dequantized.
    pub fn from_blocks(t: GgmlType, raw: Cow<'_, [u8]>, rows: usize, k: usize, dtype: WeightDtype) -> Result<Self> {
        if dtype.keeps_stored() {
            return Ok(Weight::Quant(QMatrix::new(k, vec![(t, rows, raw)])?));
        }
        Ok(Weight::F32(PackedMatrix::pack(&crate::kernels::quant::dequantize(t, &raw), rows, k)))
    }

    /// BitNet's ternary projections: with `dtype` auto or stored, TQ1_0 or TQ2_0 blocks computed with
    /// per-row int8 activations, as the model was trained, from whatever ternary form the
    /// file holds (sources give I2_S and packed Hugging Face weights as TQ2_0) or from
    /// float weights that are ternary. Otherwise, and for weights that are not ternary
    /// (said in the log), as [`Weight::load`].
    pub fn load_ternary(src: &dyn WeightSource, parts: &[(&str, [usize; 2])], dtype: WeightDtype) -> Result<Self> {
        if !matches!(dtype, WeightDtype::Auto | WeightDtype::Stored) {
            return Self::load(src, parts, dtype);
        }
        let k = parts[0].1[1];
        let mut blocks = Vec::with_capacity(parts.len());
        for (name, shape) in parts {
            if let Some((t, raw)) = src.load_blocks(name, shape)? {
                blocks.push((t, shape[0], raw));
                continue;
            }
            match ternary::from_floats(src.load(name, shape)?.data(), k) {
                Some(raw) => blocks.push((GgmlType::Tq2_0, shape[0], Cow::Owned(raw))),
                None => {
                    eprintln!("weft: {name} is not ternary in 256-value blocks; computed as stored");
                    return Self::load(src, parts, dtype);
                }
            }
        }
        let m = QMatrix::new(k, blocks);
        parts.iter().for_each(|(name, _)| src.release(name));
        Ok(Weight::Quant(m?))
    }

    /// `parts` stacked in their block formats, when `dtype` keeps stored forms and every
    /// part is stored in one; `None` otherwise.
    pub fn load_blocks(
        src: &dyn WeightSource,
        parts: &[(&str, [usize; 2])],
        dtype: WeightDtype,
    ) -> Result<Option<QMatrix>> {
        if !dtype.keeps_stored() {
            return Ok(None);
        }
        let mut blocks = Vec::with_capacity(parts.len());
        for (name, shape) in parts {
            match src.load_blocks(name, shape)? {
                Some((t, raw)) => blocks.push((t, shape[0], raw)),
                None => break,
            }
        }
        let stacked = (blocks.len() == parts.len()).then(|| QMatrix::new(parts[0].1[1], blocks)).transpose();
        parts.iter().for_each(|(name, _)| src.release(name));
        stacked
    }

    /// `parts` read as f32 and quantized to the format `dtype` asks for, when it asks for
    /// one and the rows are whole blocks of it.
    fn quantize_at_load(
        src: &dyn WeightSource,
        parts: &[(&str, [usize; 2])],
        dtype: WeightDtype,
    ) -> Result<Option<QMatrix>> {
        let WeightDtype::Quantize(target) = dtype else { return Ok(None) };
        let k = parts[0].1[1];
        let Some(target) = fitting(target, k) else { return Ok(None) };
        let mut blocks = Vec::with_capacity(parts.len());
        for (name, shape) in parts {
            let t = src.load(name, shape)?;
            let data = t.data();
            blocks.push((
                target,
                shape[0],
                quantize_matrix(target, k, shape[0], |r| Cow::Borrowed(&data[r.start * k..r.end * k])).into(),
            ));
        }
        Ok(Some(QMatrix::new(k, blocks)?))
    }

    /// `parts` stacked as 16-bit floats, when `dtype` keeps stored forms and every part is
    /// stored in the same 16-bit format; `None` otherwise.
    pub fn load_half(
        src: &dyn WeightSource,
        parts: &[(&str, [usize; 2])],
        dtype: WeightDtype,
    ) -> Result<Option<HalfRows>> {
        if !dtype.keeps_stored() {
            return Ok(None);
        }
        if let [(name, shape)] = parts {
            return src.load_half(name, shape);
        }
        let mut all: Option<(Half, Vec<u16>)> = None;
        for (name, shape) in parts {
            match (src.load_half(name, shape)?, &mut all) {
                (Some(h), None) => all = Some((h.format, h.bits().to_vec())),
                (Some(h), Some((g, acc))) if h.format == *g => acc.extend_from_slice(h.bits()),
                _ => return Ok(None),
            }
            src.release(name);
        }
        Ok(all.map(|(format, bits)| HalfRows::owned(format, parts[0].1[1], bits)))
    }

    /// Multiply-adds one activation row costs, by block format (`None`: computed in f32).
    pub fn products(&self) -> Vec<(Option<GgmlType>, usize)> {
        match self {
            Weight::F32(w) => vec![(None, w.products())],
            Weight::Quant(w) | Weight::Refined { coarse: w, .. } => w.products().map(|(t, n)| (Some(t), n)).collect(),
        }
    }

    /// Bytes of weights one pass over the matrix reads.
    pub fn bytes(&self) -> usize {
        match self {
            Weight::F32(w) => w.bytes(),
            Weight::Quant(w) | Weight::Refined { coarse: w, .. } => w.bytes(),
        }
    }

    /// Bytes the weight holds in memory (rows left in the mapped file hold none).
    pub fn resident_bytes(&self) -> usize {
        match self {
            Weight::Refined { coarse, exact } => coarse.bytes() + exact.owned_bytes(),
            _ => self.bytes(),
        }
    }

    /// Row `r` as f32 (an embedding lookup).
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        match self {
            Weight::F32(w) => w.row_into(r, out),
            Weight::Quant(w) => w.row_into(r, out),
            Weight::Refined { exact, .. } => exact.row_into(r, out),
        }
    }

    /// `y = x · Wᵀ` for `m` rows; `xq` is scratch for the quantized activations.
    pub fn matmul(&self, x: &[f32], xq: &mut QActs, y: &mut [f32], m: usize) {
        match self {
            Weight::F32(w) => matmul(x, w, y, m),
            Weight::Quant(w) | Weight::Refined { coarse: w, .. } => {
                w.quantize(x, m, xq);
                qmatmul(xq, w, y, m);
            }
        }
    }

    /// Recomputes the `top` largest values of each of the `m` rows of `y = x · Wᵀ` in f32
    /// against the dequantized weight rows, or a refined head's stored rows (float weights
    /// are exact already). For the LM head: int8 activations blur near-ties between the
    /// leading tokens, and on SmolLM2 Q4_1 the head's activation rounding alone cost 1.4
    /// points of top-1 agreement with the f32 path; `top` dot products per row win them
    /// back. Each row on its own, so batch invariance holds.
    pub fn refine_top(&self, x: &[f32], y: &mut [f32], m: usize, top: usize) {
        let (w, exact) = match self {
            Weight::F32(_) => return,
            Weight::Quant(w) => (w, None),
            Weight::Refined { coarse, exact } => (coarse, Some(exact)),
        };
        let (n, k) = (w.rows(), w.cols());
        x[..m * k].par_chunks(k).zip(y[..m * n].par_chunks_mut(n)).for_each_init(Vec::new, |row, (x, y)| {
            row.resize(k, 0.0);
            for j in top_indices(y, top) {
                match exact {
                    Some(rows) => rows.row_into(j, row),
                    None => w.row_into(j, row),
                }
                y[j] = exact_dot(x, row);
            }
        });
    }
}

/// `x · w` in f32: what the f32 path computes, up to the order of the sum. Plain
/// multiply-adds in eight lanes, not `mul_add`, which is a libm call outside
/// AVX2-compiled code.
fn exact_dot(x: &[f32], w: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    for (a, b) in x.chunks_exact(8).zip(w.chunks_exact(8)) {
        for l in 0..8 {
            acc[l] += a[l] * b[l];
        }
    }
    acc.iter().sum()
}

/// Indices of the `top` largest values of `v` (NaNs never among them), in no set order.
fn top_indices(v: &[f32], top: usize) -> Vec<usize> {
    if top == 0 {
        return Vec::new();
    }
    // Kept sorted, largest first; a value enters only when it beats the smallest kept.
    let mut best: Vec<(f32, usize)> = Vec::with_capacity(top + 1);
    // Once `top` are kept, a chunk whose largest value (a lane-wise maximum, which
    // vectorizes and passes over NaNs) cannot enter is skipped whole: on a vocabulary of
    // logits nearly all are.
    const CHUNK: usize = 64;
    for (c, chunk) in v.chunks(CHUNK).enumerate() {
        if best.len() == top && chunk.len() == CHUNK {
            let mut lanes = [f32::NEG_INFINITY; 8];
            for eight in chunk.chunks_exact(8) {
                for (m, &x) in lanes.iter_mut().zip(eight) {
                    *m = if x > *m { x } else { *m };
                }
            }
            if lanes.iter().all(|&m| m <= best[top - 1].0) {
                continue;
            }
        }
        for (i, &x) in (c * CHUNK..).zip(chunk) {
            if x.is_nan() || (best.len() == top && x <= best[top - 1].0) {
                continue;
            }
            let at = best.partition_point(|&(b, _)| b >= x);
            best.insert(at, (x, i));
            best.truncate(top);
        }
    }
    best.into_iter().map(|(_, i)| i).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::quant::dequantize;
    use crate::kernels::quantize::quantize;
    use crate::kernels::testing::random_vec;

    #[test]
    fn top_indices_finds_the_largest() {
        let v = [3.0, f32::NAN, 9.0, -1.0, 9.0, 7.0, 0.5];
        let mut got = top_indices(&v, 3);
        got.sort();
        assert_eq!(got, [2, 4, 5]);
        assert_eq!(top_indices(&v, 10).len(), 6, "NaN is never chosen");
        // Long enough that whole chunks are passed over once the top are found.
        let long: Vec<f32> = (0..1000).map(|i| ((i * 7919) % 1000) as f32).collect();
        let mut got = top_indices(&long, 4);
        got.sort();
        let want: Vec<usize> = (0..1000).filter(|&i| long[i] >= 996.0).collect();
        assert_eq!(got, want);
    }

    /// After `refine_top`, a quantized head's leading logits are the f32 path's (the
    /// dequantized rows times unquantized activations), and the rest are as computed.
    #[test]
    fn refine_top_makes_the_leading_logits_exact() {
        let (n, k, m, top) = (300, 64, 3, 5);
        let w = random_vec(n * k, 1);
        let raw = quantize(GgmlType::Q8_0, &w);
        let wq = dequantize(GgmlType::Q8_0, &raw);
        let q8 = || QMatrix::new(k, vec![(GgmlType::Q8_0, n, raw.clone().into())]).unwrap();
        // A refined head's leading logits come from its f16 rows instead.
        let bits: Vec<u16> = w.iter().map(|&v| half::f16::from_f32(v).to_bits()).collect();
        let wh: Vec<f32> = bits.iter().map(|&b| Half::F16.to_f32(b)).collect();
        let refined = Weight::Refined { coarse: q8(), exact: HalfRows::owned(Half::F16, k, bits) };
        for (head, wq) in [(Weight::Quant(q8()), &wq), (refined, &wh)] {
            leading_logits_exact(&head, wq, (n, k, m, top));
        }
    }

    fn leading_logits_exact(head: &Weight, wq: &[f32], (n, k, m, top): (usize, usize, usize, usize)) {
        let x = random_vec(m * k, 2);
        let mut y = vec![0.0; m * n];
        // No rows: nothing to compute, nothing written.
        head.matmul(&[], &mut QActs::default(), &mut [], 0);
        head.refine_top(&[], &mut [], 0, top);
        head.matmul(&x, &mut QActs::default(), &mut y, m);
        let before = y.clone();
        head.refine_top(&x, &mut y, m, top);
        for i in 0..m {
            let exact: Vec<f32> = (0..n).map(|j| (0..k).map(|c| x[i * k + c] * wq[j * k + c]).sum::<f32>()).collect();
            let changed: Vec<usize> = (0..n).filter(|&j| y[i * n + j] != before[i * n + j]).collect();
            let mut leading = top_indices(&before[i * n..(i + 1) * n], top);
            leading.sort();
            assert!(changed.iter().all(|j| leading.contains(j)), "row {i}: only the leading logits change");
            for j in leading {
                assert!((y[i * n + j] - exact[j]).abs() < 1e-4, "row {i} col {j}: {} vs {}", y[i * n + j], exact[j]);
            }
        }
    }
}
