//! `weft quantize` for GGUF input: a copy of the file with its matrices in another block
//! format. Metadata entries are copied byte for byte (so every key keeps its exact type)
//! except `general.file_type`, which is rewritten; tensors keep their order and names.
//! Each matrix is dequantized exactly to f32 and quantized again, one tensor at a time, so
//! memory stays at one tensor whatever the file's size.

use super::gguf::{GgufFile, TensorInfo};
use crate::kernels::quant::{dequantize, GgmlType};
use crate::kernels::quantize::{fitting, quantize, TARGETS};
use anyhow::{ensure, Context, Result};
use rayon::prelude::*;
use std::borrow::Cow;
use std::io::Write;
use std::path::Path;

/// llama.cpp's `general.file_type` for a file mostly of `dtype`.
fn file_type(dtype: GgmlType) -> u32 {
    match dtype {
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

/// Writes `out`: `input` with its matrices in `target`. Returns (tensors requantized, bytes).
pub fn requantize(input: &Path, out: &Path, target: GgmlType) -> Result<(usize, u64)> {
    ensure!(TARGETS.contains(&target), "cannot quantize to {target:?} (supported: {TARGETS:?})");
    // Writing over the input would truncate the map being read.
    let same = |a: &Path, b: &Path| a.canonicalize().ok().zip(b.canonicalize().ok()).is_some_and(|(a, b)| a == b);
    ensure!(!same(input, out), "{}: the output must not be the input file", out.display());
    let file = GgufFile::open(input)?;
    let layout = &file.layout;
    let align = layout.alignment;
    let tensors: Vec<(&str, &TensorInfo, GgmlType)> = layout
        .order
        .iter()
        .map(|n| {
            let info = &file.tensors[n];
            (n.as_str(), info, output_type(n, info, target))
        })
        .collect();

    let put_str = |out: &mut Vec<u8>, s: &str| {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    };
    let mut head = b"GGUF".to_vec();
    head.extend(layout.version.to_le_bytes());
    head.extend((tensors.len() as u64).to_le_bytes());
    let kept: Vec<_> = layout.entries.iter().filter(|(k, _)| k != "general.file_type").collect();
    head.extend((kept.len() as u64 + 1).to_le_bytes());
    for (_, range) in &kept {
        head.extend(file.bytes(range.clone()));
    }
    put_str(&mut head, "general.file_type");
    head.extend(4u32.to_le_bytes());
    head.extend(file_type(target).to_le_bytes());
    let mut offset = 0u64;
    for (name, info, dtype) in &tensors {
        put_str(&mut head, name);
        head.extend((info.shape.len() as u32).to_le_bytes());
        for d in info.shape.iter().rev() {
            head.extend((*d as u64).to_le_bytes());
        }
        head.extend(dtype.id().to_le_bytes());
        head.extend(offset.to_le_bytes());
        let elems: usize = info.shape.iter().product();
        offset = (offset + (elems / dtype.block().0 * dtype.block().1) as u64).next_multiple_of(align as u64);
    }
    head.resize(head.len().next_multiple_of(align), 0);

    let mut w =
        std::io::BufWriter::new(std::fs::File::create(out).with_context(|| format!("creating {}", out.display()))?);
    w.write_all(&head)?;
    let mut written = head.len() as u64;
    let mut changed = 0;
    for (name, info, dtype) in &tensors {
        let raw = file.raw(info);
        let data = if *dtype == info.dtype {
            Cow::Borrowed(raw)
        } else {
            changed += 1;
            let k = info.shape[1];
            let (in_row, out_row) = (raw.len() / info.shape[0], k / dtype.block().0 * dtype.block().1);
            let mut data = vec![0u8; info.shape[0] * out_row];
            data.par_chunks_mut(out_row * 64).zip(raw.par_chunks(in_row * 64)).for_each(|(o, r)| {
                o.copy_from_slice(&quantize(*dtype, &dequantize(info.dtype, r)));
            });
            Cow::Owned(data)
        };
        w.write_all(&data).with_context(|| format!("writing tensor {name}"))?;
        file.release(info);
        let padded = (data.len() as u64).next_multiple_of(align as u64);
        w.write_all(&vec![0u8; (padded - data.len() as u64) as usize])?;
        written += padded;
    }
    w.flush()?;
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
