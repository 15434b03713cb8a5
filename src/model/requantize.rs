//! `weft quantize` for GGUF input: a copy of the file with its matrices in another block
//! format. Metadata entries are copied byte for byte (so every key keeps its exact type)
//! except `general.file_type`, which is rewritten; tensors keep their order and names.
//! Each matrix is dequantized exactly to f32 and quantized again, one tensor at a time, so
//! memory stays at one tensor whatever the file's size.

use super::file_type::FileType;
use super::gguf::{GgufFile, TensorInfo};
use super::gguf_write::{put_entry, write_file, Meta, OutTensor};
use crate::kernels::quant::{dequantize, GgmlType};
use crate::kernels::quantize::quantize_matrix;
use crate::kernels::ternary;
use anyhow::{bail, ensure, Result};
use std::borrow::Cow;
use std::path::Path;

/// The number of layers: one past the highest `blk.N.` of the tensor names.
fn block_count<'a>(names: impl Iterator<Item = &'a str>) -> usize {
    let layer = |n: &str| n.strip_prefix("blk.")?.split('.').next()?.parse::<usize>().ok();
    names.filter_map(layer).max().map_or(0, |l| l + 1)
}

/// `raw` (the rows of `info`) in `dtype`, through exact f32; into a ternary
/// format only if the values are ternary.
fn requantize_rows(raw: &[u8], info: &TensorInfo, dtype: GgmlType) -> Result<Vec<u8>> {
    // Rows of the last dimension (a mixture's experts stack theirs in a third).
    let k = info.shape[info.shape.len() - 1];
    let rows = info.shape.iter().product::<usize>() / k;
    if matches!(dtype, GgmlType::Tq1_0 | GgmlType::Tq2_0) {
        // Checked whole, so quantized from the same values rather than dequantized again.
        let values = dequantize(info.dtype, raw);
        if let Some(why) = ternary::not_ternary(&values, k) {
            bail!("cannot be written as {dtype}: {why}");
        }
        return Ok(quantize_matrix(dtype, k, rows, |r| Cow::Borrowed(&values[r.start * k..r.end * k])));
    }
    let in_row = raw.len() / rows;
    Ok(quantize_matrix(dtype, k, rows, |r| Cow::Owned(dequantize(info.dtype, &raw[r.start * in_row..r.end * in_row]))))
}

/// Writes `out`: `input` with its matrices in the types of `ft`. Returns (tensors
/// requantized, bytes).
pub fn requantize(input: &Path, out: &Path, ft: FileType) -> Result<(usize, u64)> {
    // Writing over the input would truncate the map being read.
    let same = |a: &Path, b: &Path| a.canonicalize().ok().zip(b.canonicalize().ok()).is_some_and(|(a, b)| a == b);
    ensure!(!same(input, out), "{}: the output must not be the input file", out.display());
    let file = GgufFile::open(input)?;
    let layout = &file.layout;
    let layers = block_count(layout.order.iter().map(String::as_str));
    let tied = !file.tensors.contains_key("output.weight");
    let tensors: Vec<(&str, &TensorInfo, GgmlType)> = layout
        .order
        .iter()
        .map(|n| {
            let info = &file.tensors[n];
            // Norms, biases and matrices no format fits are kept as stored.
            (n.as_str(), info, ft.tensor_type(n, &info.shape, layers, tied).unwrap_or(info.dtype))
        })
        .collect();

    let mut entries = Vec::new();
    let kept: Vec<_> = layout.entries.iter().filter(|(k, _)| k != "general.file_type").collect();
    for (_, range) in &kept {
        entries.extend(file.bytes(range.clone()));
    }
    put_entry(&mut entries, "general.file_type", &Meta::U32(ft.id()));
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
            Cow::Owned(requantize_rows(raw, info, dtype)?)
        };
        file.release(info);
        Ok(data)
    })?;
    Ok((changed, written))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::file_type::parse_file_type_name;
    use crate::model::gguf::tests::write_gguf;
    use crate::model::gguf::Value;

    /// A requantized file reads back with the same metadata, names and shapes, its matrix
    /// in the new type and close to the original values, its vector untouched.
    #[test]
    fn writes_a_readable_copy() {
        let dir = tempfile::tempdir().unwrap();
        let (src, dst) = (dir.path().join("in.gguf"), dir.path().join("out.gguf"));
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
        let (changed, _) = requantize(&src, &dst, parse_file_type_name("q8_0").unwrap()).unwrap();
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
        assert!(requantize(&dst, &dst, parse_file_type_name("q4_0").unwrap()).is_err(), "overwrote its own input");
    }
}
