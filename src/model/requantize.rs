//! `weft quantize` for GGUF input: a copy of the file with its matrices in another block
//! format. Metadata entries are copied byte for byte (so every key keeps its exact type)
//! except `general.file_type`, which is rewritten; tensors keep their order and names.
//! Each matrix is dequantized exactly to f32 and quantized again, one tensor at a time, so
//! memory stays at one tensor whatever the file's size.

use super::gguf::{GgufFile, TensorInfo};
use super::gguf_write::{put_entry, write_file, Meta, OutTensor};
use crate::kernels::quant::{dequantize, GgmlType};
use crate::kernels::quantize::{fitting, quantize, writable};
use anyhow::{ensure, Result};
use rayon::prelude::*;
use std::borrow::Cow;
use std::path::Path;

/// llama.cpp's `general.file_type` for a file mostly of `dtype`.
pub fn file_type(dtype: GgmlType) -> u32 {
    match dtype {
        GgmlType::F32 => 0,
        GgmlType::F16 => 1,
        GgmlType::Q4_0 => 2,
        GgmlType::Q4_1 => 3,
        GgmlType::Q8_0 => 7,
        GgmlType::Q5_0 => 8,
        GgmlType::Q5_1 => 9,
        GgmlType::Q4K => 14,
        GgmlType::Q5K => 16,
        GgmlType::Q6K => 18,
        other => unreachable!("{other:?} is not a quantization target"),
    }
}

/// The type tensor `info` is written in: `target` for matrices (or its fallback when the
/// rows are not whole blocks of it), else as stored (norms, biases, empty tensors).
fn output_type(name: &str, info: &TensorInfo, target: GgmlType) -> GgmlType {
    let matrix = info.shape.len() == 2 && info.shape.iter().all(|&d| d > 0) && name.ends_with(".weight");
    let fit = if matrix { fitting(target, info.shape[1]) } else { None };
    fit.unwrap_or(info.dtype)
}

/// `raw` (the rows of `info`) in `dtype`, through exact f32.
fn requantize_rows(raw: &[u8], info: &TensorInfo, dtype: GgmlType) -> Vec<u8> {
    let k = info.shape[1];
    let (in_row, out_row) = (raw.len() / info.shape[0], k / dtype.block().0 * dtype.block().1);
    let mut data = vec![0u8; info.shape[0] * out_row];
    data.par_chunks_mut(out_row * 64).zip(raw.par_chunks(in_row * 64)).for_each(|(o, r)| {
        o.copy_from_slice(&quantize(dtype, &dequantize(info.dtype, r)));
    });
    data
}

/// Writes `out`: `input` with its matrices in `target`. Returns (tensors requantized, bytes).
pub fn requantize(input: &Path, out: &Path, target: GgmlType) -> Result<(usize, u64)> {
    ensure!(writable(target), "cannot write matrices as {target:?}");
    // Writing over the input would truncate the map being read.
    let same = |a: &Path, b: &Path| a.canonicalize().ok().zip(b.canonicalize().ok()).is_some_and(|(a, b)| a == b);
    ensure!(!same(input, out), "{}: the output must not be the input file", out.display());
    let file = GgufFile::open(input)?;
    let layout = &file.layout;
    let tensors: Vec<(&str, &TensorInfo, GgmlType)> = layout
        .order
        .iter()
        .map(|n| {
            let info = &file.tensors[n];
            (n.as_str(), info, output_type(n, info, target))
        })
        .collect();

    let mut entries = Vec::new();
    let kept: Vec<_> = layout.entries.iter().filter(|(k, _)| k != "general.file_type").collect();
    for (_, range) in &kept {
        entries.extend(file.bytes(range.clone()));
    }
    put_entry(&mut entries, "general.file_type", &Meta::U32(file_type(target)));
    let out_tensors: Vec<OutTensor> = tensors
        .iter()
        .map(|(name, info, dtype)| OutTensor { name: name.to_string(), shape: info.shape.clone(), dtype: *dtype })
        .collect();
    let mut changed = 0;
    let written = write_file(out, &entries, kept.len() + 1, layout.alignment, &out_tensors, |i| {
        let (_, info, dtype) = tensors[i];
        let raw = file.raw(info);
        let data = if dtype == info.dtype {
            Cow::Borrowed(raw)
        } else {
            changed += 1;
            Cow::Owned(requantize_rows(raw, info, dtype))
        };
        file.release(info);
        Ok(data)
    })?;
    Ok((changed, written))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::gguf::tests::write_gguf;
    use crate::model::gguf::Value;

    /// A requantized file reads back with the same metadata, names and shapes, its matrix
    /// in the new type and close to the original values, its vector untouched.
    #[test]
    fn writes_a_readable_copy() {
        let dir = std::env::temp_dir().join(format!("weft-requant-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (src, dst) = (dir.join("in.gguf"), dir.join("out.gguf"));
        let w: Vec<f32> = (0..4 * 256).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
        let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let meta = [("general.architecture", Value::Str("llama".into())), ("llama.block_count", Value::Int(1))];
        write_gguf(
            &src,
            &meta,
            &[
                ("blk.0.ffn_up.weight", vec![256, 4], 0, bytes(&w)),
                ("blk.0.attn_norm.weight", vec![3], 0, bytes(&[1.0, 2.0, 3.0])),
            ],
        );
        let (changed, _) = requantize(&src, &dst, GgmlType::Q8_0).unwrap();
        assert_eq!(changed, 1);
        let f = GgufFile::open(&dst).unwrap();
        assert_eq!(f.get("general.architecture"), Some(&Value::Str("llama".into())));
        assert_eq!(f.get("llama.block_count"), Some(&Value::Int(1)));
        assert_eq!(f.get("general.file_type").and_then(Value::as_u64), Some(7));
        assert_eq!(f.layout.order, ["blk.0.ffn_up.weight", "blk.0.attn_norm.weight"]);
        let up = &f.tensors["blk.0.ffn_up.weight"];
        assert_eq!((up.dtype, up.shape.clone()), (GgmlType::Q8_0, vec![4, 256]));
        let back = f.dequantize(up);
        assert!(back.iter().zip(&w).all(|(a, b)| (a - b).abs() < 0.01), "Q8_0 values drifted");
        assert_eq!(f.dequantize(&f.tensors["blk.0.attn_norm.weight"]), [1.0, 2.0, 3.0]);
        assert!(requantize(&dst, &dst, GgmlType::Q4_0).is_err(), "overwrote its own input");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
