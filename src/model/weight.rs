//! A linear layer's weight in the form it is computed in: f32 packed panels (the exact
//! reference path), or the file's GGML block formats computed with int8 activations.

use super::loader::WeightSource;
use crate::kernels::matmul::Half;
use crate::kernels::qmatmul::{qmatmul, quantize_rows, QActs, QMatrix};
use crate::kernels::quant::GgmlType;
use crate::kernels::quantize::{fitting, quantize};
use crate::kernels::{matmul, PackedMatrix};
use anyhow::Result;

/// Which form weights are computed in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightDtype {
    /// Block-format weights stay in their format; float weights are computed in f32.
    Auto,
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
            "f32" => Ok(WeightDtype::F32),
            other => Err(format!("unknown dtype {other:?} (auto or f32)")),
        }
    }
}

pub enum Weight {
    F32(PackedMatrix),
    Quant(QMatrix),
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
        if let Some((format, bits)) = Self::load_half(src, parts, dtype)? {
            let rows: usize = parts.iter().map(|(_, s)| s[0]).sum();
            return Ok(Weight::F32(PackedMatrix::pack_half(&bits, format, rows, parts[0].1[1])));
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
                None => return Ok(None),
            }
        }
        Ok(Some(QMatrix::new(parts[0].1[1], blocks)?))
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
            blocks.push((target, shape[0], quantize(target, src.load(name, shape)?.data())));
        }
        Ok(Some(QMatrix::new(k, blocks)?))
    }

    /// `parts` stacked as 16-bit floats, when `dtype` keeps stored forms and every part is
    /// stored in the same 16-bit format; `None` otherwise.
    pub fn load_half(
        src: &dyn WeightSource,
        parts: &[(&str, [usize; 2])],
        dtype: WeightDtype,
    ) -> Result<Option<(Half, Vec<u16>)>> {
        if !dtype.keeps_stored() {
            return Ok(None);
        }
        let mut all: Option<(Half, Vec<u16>)> = None;
        for (name, shape) in parts {
            match (src.load_half(name, shape)?, &mut all) {
                (Some((f, bits)), None) => all = Some((f, bits)),
                (Some((f, bits)), Some((g, acc))) if f == *g => acc.extend(bits),
                _ => return Ok(None),
            }
        }
        Ok(all)
    }

    /// Bytes of weights one pass over the matrix reads.
    pub fn bytes(&self) -> usize {
        match self {
            Weight::F32(w) => w.bytes(),
            Weight::Quant(w) => w.bytes(),
        }
    }

    /// Row `r` as f32 (an embedding lookup).
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        match self {
            Weight::F32(w) => w.row_into(r, out),
            Weight::Quant(w) => w.row_into(r, out),
        }
    }

    /// `y = x · Wᵀ` for `m` rows; `xq` is scratch for the quantized activations.
    pub fn matmul(&self, x: &[f32], xq: &mut QActs, y: &mut [f32], m: usize) {
        match self {
            Weight::F32(w) => matmul(x, w, y, m),
            Weight::Quant(w) => {
                quantize_rows(x, m, w.cols(), xq);
                qmatmul(xq, w, y, m);
            }
        }
    }
}
