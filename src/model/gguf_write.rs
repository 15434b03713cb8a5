//! Writing GGUF v3 files: typed metadata entries, the tensor directory, then each tensor's
//! data streamed one at a time, so writing holds one tensor in memory whatever the model.

use super::gguf::GgmlType;
use anyhow::{ensure, Context, Result};
use std::borrow::Cow;
use std::io::Write;
use std::path::Path;

/// The alignment of tensor data when the metadata does not set `general.alignment`.
pub const ALIGNMENT: usize = 32;

/// A metadata value, in the GGUF types converters write.
#[derive(Debug, Clone, PartialEq)]
pub enum Meta {
    U32(u32),
    F32(f32),
    Bool(bool),
    Str(String),
    Strs(Vec<String>),
    I32s(Vec<i32>),
    U32s(Vec<u32>),
    F32s(Vec<f32>),
    Bools(Vec<bool>),
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// Appends one metadata entry (key, type id, value) as GGUF stores it.
pub fn put_entry(out: &mut Vec<u8>, key: &str, value: &Meta) {
    put_str(out, key);
    let array = |out: &mut Vec<u8>, ty: u32, n: usize| {
        out.extend(9u32.to_le_bytes());
        out.extend(ty.to_le_bytes());
        out.extend((n as u64).to_le_bytes());
    };
    match value {
        Meta::U32(v) => {
            out.extend(4u32.to_le_bytes());
            out.extend(v.to_le_bytes());
        }
        Meta::F32(v) => {
            out.extend(6u32.to_le_bytes());
            out.extend(v.to_le_bytes());
        }
        Meta::Bool(v) => {
            out.extend(7u32.to_le_bytes());
            out.push(*v as u8);
        }
        Meta::Str(s) => {
            out.extend(8u32.to_le_bytes());
            put_str(out, s);
        }
        Meta::Strs(v) => {
            array(out, 8, v.len());
            v.iter().for_each(|s| put_str(out, s));
        }
        Meta::I32s(v) => {
            array(out, 5, v.len());
            v.iter().for_each(|x| out.extend(x.to_le_bytes()));
        }
        Meta::U32s(v) => {
            array(out, 4, v.len());
            v.iter().for_each(|x| out.extend(x.to_le_bytes()));
        }
        Meta::F32s(v) => {
            array(out, 6, v.len());
            v.iter().for_each(|x| out.extend(x.to_le_bytes()));
        }
        Meta::Bools(v) => {
            array(out, 7, v.len());
            out.extend(v.iter().map(|&b| b as u8));
        }
    }
}

/// A tensor of the file to write: its name, row-major shape and type.
pub struct OutTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: GgmlType,
}

impl OutTensor {
    fn bytes(&self) -> usize {
        let (per, bytes) = self.dtype.block();
        self.shape.iter().product::<usize>() / per * bytes
    }
}

/// Writes `path`: `n_entries` metadata entries (already encoded by [`put_entry`] or copied
/// from another file), the directory of `tensors`, then `data(i)` for each tensor in order,
/// each at a multiple of `align` (which the metadata must state unless it is 32).
/// Returns the bytes written.
pub fn write_file<'a>(
    path: &Path,
    entries: &[u8],
    n_entries: usize,
    align: usize,
    tensors: &[OutTensor],
    mut data: impl FnMut(usize) -> Result<Cow<'a, [u8]>>,
) -> Result<u64> {
    let mut head = b"GGUF".to_vec();
    head.extend(3u32.to_le_bytes());
    head.extend((tensors.len() as u64).to_le_bytes());
    head.extend((n_entries as u64).to_le_bytes());
    head.extend(entries);
    let mut offset = 0u64;
    for t in tensors {
        put_str(&mut head, &t.name);
        head.extend((t.shape.len() as u32).to_le_bytes());
        for d in t.shape.iter().rev() {
            head.extend((*d as u64).to_le_bytes());
        }
        head.extend(t.dtype.id().to_le_bytes());
        head.extend(offset.to_le_bytes());
        offset = (offset + t.bytes() as u64).next_multiple_of(align as u64);
    }
    head.resize(head.len().next_multiple_of(align), 0);

    let file = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut w = std::io::BufWriter::new(file);
    w.write_all(&head)?;
    let mut written = head.len() as u64;
    for (i, t) in tensors.iter().enumerate() {
        let bytes = data(i).with_context(|| format!("tensor {}", t.name))?;
        ensure!(bytes.len() == t.bytes(), "tensor {}: {} bytes, expected {}", t.name, bytes.len(), t.bytes());
        w.write_all(&bytes).with_context(|| format!("writing tensor {}", t.name))?;
        let padded = bytes.len().next_multiple_of(align);
        w.write_all(&vec![0u8; padded - bytes.len()])?;
        written += padded as u64;
    }
    w.flush()?;
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::gguf::{GgufFile, Value};

    /// Every metadata type reads back as written, and tensors land at their offsets.
    #[test]
    fn writes_what_the_reader_reads() {
        let dir = crate::model::gguf::tests::tempdir();
        let path = dir.path().join("w.gguf");
        let meta = [
            ("a.u32", Meta::U32(7)),
            ("a.f32", Meta::F32(0.5)),
            ("a.bool", Meta::Bool(true)),
            ("a.str", Meta::Str("hé".into())),
            ("a.strs", Meta::Strs(vec!["x".into(), "".into()])),
            ("a.i32s", Meta::I32s(vec![-1, 3])),
            ("a.f32s", Meta::F32s(vec![1.5, -2.0])),
        ];
        let mut entries = Vec::new();
        meta.iter().for_each(|(k, v)| put_entry(&mut entries, k, v));
        let tensors = [
            OutTensor { name: "v".into(), shape: vec![3], dtype: GgmlType::F32 },
            OutTensor { name: "m".into(), shape: vec![2, 32], dtype: GgmlType::Q8_0 },
        ];
        let v: Vec<u8> = [1f32, 2.0, 3.0].iter().flat_map(|x| x.to_le_bytes()).collect();
        let q = crate::kernels::quantize::quantize(GgmlType::Q8_0, &[0.25; 64]);
        let blobs = [v, q];
        write_file(&path, &entries, meta.len(), ALIGNMENT, &tensors, |i| Ok(Cow::Borrowed(&blobs[i][..]))).unwrap();

        let f = GgufFile::open(&path).unwrap();
        assert_eq!(f.get("a.u32"), Some(&Value::Int(7)));
        assert_eq!(f.get("a.f32"), Some(&Value::Float(0.5)));
        assert_eq!(f.get("a.bool"), Some(&Value::Bool(true)));
        assert_eq!(f.get("a.str"), Some(&Value::Str("hé".into())));
        assert_eq!(f.get("a.strs"), Some(&Value::Array(vec![Value::Str("x".into()), Value::Str("".into())])));
        assert_eq!(f.get("a.i32s"), Some(&Value::Array(vec![Value::Int(-1), Value::Int(3)])));
        assert_eq!(f.get("a.f32s"), Some(&Value::Array(vec![Value::Float(1.5), Value::Float(-2.0)])));
        assert_eq!(f.dequantize(&f.tensors["v"]), [1.0, 2.0, 3.0]);
        assert_eq!(f.tensors["m"].shape, [2, 32]);
        assert_eq!(f.raw(&f.tensors["m"]), &blobs[1][..]);
        let short =
            write_file(&dir.path().join("x.gguf"), &[], 0, ALIGNMENT, &tensors[..1], |_| Ok(Cow::Owned(vec![0; 4])));
        assert!(short.is_err(), "a tensor of the wrong size was written");
    }
}
