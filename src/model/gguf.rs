//! A GGUF (v2/v3) file reader: metadata and tensor directory, every count, length and offset
//! checked against the file. Tensor data stays in the file's block formats
//! ([`crate::kernels::quant`]).

use super::tensor::MappedFile;
pub use crate::kernels::quant::GgmlType;
use crate::kernels::quant::{dequantize, TYPES};
use anyhow::{bail, ensure, Context, Result};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
}

impl Value {
    pub fn as_u64(&self) -> Option<u64> {
        match self {
            Value::Int(i) => u64::try_from(*i).ok(),
            _ => None,
        }
    }
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Value::Float(f) => Some(*f),
            Value::Int(i) => Some(*i as f64),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Value::Bool(b) => Some(*b),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

impl GgmlType {
    /// The type's id in GGUF files.
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q2K => 10,
            GgmlType::Q3K => 11,
            GgmlType::Q4K => 12,
            GgmlType::Q5K => 13,
            GgmlType::Q6K => 14,
            GgmlType::Iq4Nl => 20,
            GgmlType::Iq4Xs => 23,
            GgmlType::Bf16 => 30,
            GgmlType::Tq1_0 => 34,
            GgmlType::Tq2_0 => 35,
            // bitnet.cpp's id; upstream ggml retired 36 (IQ4_NL_4_4) and never writes it.
            GgmlType::I2s => 36,
            GgmlType::Mxfp4 => 39,
        }
    }

    fn from_id(id: u32) -> Result<Self> {
        match TYPES.into_iter().find(|t| t.id() == id) {
            Some(t) => Ok(t),
            None => bail!(
                "unsupported GGML tensor type {id} (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0, I2_S, MXFP4)"
            ),
        }
    }
}

/// Where a tensor lives in the file.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    /// Row-major shape (GGUF lists dimensions fastest-first; this is reversed).
    pub shape: Vec<usize>,
    pub dtype: GgmlType,
    /// Absolute byte offset in the file.
    pub offset: usize,
    pub len_bytes: usize,
}

pub struct GgufFile {
    pub path: PathBuf,
    pub metadata: HashMap<String, Value>,
    pub tensors: HashMap<String, TensorInfo>,
    /// The file's layout, for writing a copy ([`super::requantize`]).
    pub layout: Layout,
    mmap: Arc<MappedFile>,
}

/// Where things are in the file, beyond what reading the model needs.
#[derive(Debug, Clone)]
pub struct Layout {
    /// Each metadata entry's key and its bytes (key, type and value, as stored).
    pub entries: Vec<(String, std::ops::Range<usize>)>,
    /// Tensor names in file order.
    pub order: Vec<String>,
    pub alignment: usize,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        let mmap = MappedFile::open(path).with_context(|| format!("opening {}", path.display()))?;
        Self::parse(path, mmap).with_context(|| format!("reading GGUF file {}", path.display()))
    }

    fn parse(path: &Path, mmap: MappedFile) -> Result<Self> {
        let mut r = Reader { buf: &mmap, pos: 0, values_left: MAX_VALUES };
        ensure!(r.bytes(4)? == b"GGUF", "not a GGUF file (bad magic)");
        let version = r.u32()?;
        ensure!(version == 2 || version == 3, "unsupported GGUF version {version} (need 2 or 3)");
        // Every count is checked against the bytes left before anything is allocated for it:
        // a key/value takes at least 13 bytes, a tensor entry at least 24.
        let n_tensors = r.count(24).context("tensor count")?;
        let n_kv = r.count(13).context("metadata count")?;
        let mut metadata = HashMap::new();
        let mut entries = Vec::with_capacity(n_kv);
        for _ in 0..n_kv {
            let start = r.pos;
            let key = r.string()?;
            let ty = r.u32()?;
            let value = r.value(ty, 0).with_context(|| format!("metadata key {key}"))?;
            entries.push((key.clone(), start..r.pos));
            metadata.insert(key, value);
        }
        let mut infos = Vec::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = r.string()?;
            let n_dims = r.u32()? as usize;
            ensure!(n_dims <= 4, "tensor {name}: {n_dims} dimensions");
            let mut dims = (0..n_dims).map(|_| r.u64().map(|d| d as usize)).collect::<Result<Vec<_>>>()?;
            dims.reverse();
            let dtype = GgmlType::from_id(r.u32()?).with_context(|| format!("tensor {name}"))?;
            let offset = r.u64()? as usize;
            infos.push((name, dims, dtype, offset));
        }
        let align = metadata.get("general.alignment").and_then(Value::as_u64).unwrap_or(32) as usize;
        ensure!(align.is_power_of_two(), "general.alignment {align} is not a power of two");
        let data_start = r.pos.next_multiple_of(align);
        let mut tensors = HashMap::new();
        let order = infos.iter().map(|i| i.0.clone()).collect();
        for (name, shape, dtype, rel) in infos {
            let elems = shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
            let Some(elems) = elems else { bail!("tensor {name}: shape {shape:?} overflows") };
            let (per_block, block_bytes) = dtype.block();
            ensure!(
                elems.is_multiple_of(per_block),
                "tensor {name}: {elems} elements, not whole blocks of {per_block}"
            );
            let trailer = if dtype == GgmlType::I2s { crate::kernels::quant::I2S_TRAILER } else { 0 };
            let len_bytes = (elems / per_block).checked_mul(block_bytes).and_then(|l| l.checked_add(trailer));
            let placed = len_bytes.zip(data_start.checked_add(rel));
            let fits = |&(l, o): &(usize, usize)| o.checked_add(l).is_some_and(|end| end <= mmap.len());
            let Some((len_bytes, offset)) = placed.filter(fits) else {
                bail!(
                    "tensor {name} ({shape:?} of {dtype:?} at offset {rel}) ends past the {} bytes of the file (truncated?)",
                    mmap.len()
                );
            };
            tensors.insert(name, TensorInfo { shape, dtype, offset, len_bytes });
        }
        let layout = Layout { entries, order, alignment: align };
        Ok(GgufFile { path: path.to_path_buf(), metadata, tensors, layout, mmap: Arc::new(mmap) })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// The bytes of the file in `range` (a metadata entry, say).
    pub fn bytes(&self, range: std::ops::Range<usize>) -> &[u8] {
        &self.mmap[range]
    }

    /// The file's map, for weights that borrow it past loading.
    pub fn map(&self) -> &Arc<MappedFile> {
        &self.mmap
    }

    /// Raw bytes of a tensor, still in its on-disk type.
    pub fn raw(&self, info: &TensorInfo) -> &[u8] {
        &self.mmap[info.offset..info.offset + info.len_bytes]
    }

    /// Drops a tensor's pages from this process's memory once it has been copied out: they
    /// stay in the page cache and come back from the file if read again, so loading holds
    /// at most one tensor of the file beside the weights built from it.
    pub fn release(&self, info: &TensorInfo) {
        self.mmap.release(info.offset, info.len_bytes);
    }

    /// A tensor dequantized to f32, row-major.
    pub fn dequantize(&self, info: &TensorInfo) -> Vec<f32> {
        dequantize(info.dtype, self.raw(info))
    }
}

/// Arrays of arrays are legal GGUF, but no model needs more than this.
const MAX_NESTING: usize = 4;

/// The fewest bytes a metadata value of type `ty` can take.
fn min_value_bytes(ty: u32) -> Result<usize> {
    Ok(match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 | 10..=12 => 8,
        9 => 12,
        other => bail!("unknown metadata value type {other}"),
    })
}

/// Metadata values (array elements included) a file may hold in all: about 20 times what
/// the largest real vocabularies need, and at most 128 MiB of parsed values.
const MAX_VALUES: usize = 1 << 22;

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    /// Array elements still allowed, so parsed metadata stays bounded whatever the file.
    values_left: usize,
}

impl<'a> Reader<'a> {
    fn bytes(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        let Some(end) = end else { bail!("unexpected end of file at byte {} (truncated header?)", self.pos) };
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.bytes(4)?.try_into()?))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.bytes(8)?.try_into()?))
    }
    fn string(&mut self) -> Result<String> {
        let n = self.u64()?;
        let n = usize::try_from(n).ok().filter(|&n| n <= self.remaining());
        let Some(n) = n else { bail!("string at byte {} is longer than the rest of the file", self.pos) };
        Ok(String::from_utf8_lossy(self.bytes(n)?).into_owned())
    }
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    /// A u64 count of items that each take at least `min_bytes`, checked to fit in the rest
    /// of the file, so nothing is allocated for items that cannot be there.
    fn count(&mut self, min_bytes: usize) -> Result<usize> {
        let n = self.u64()?;
        let fits = usize::try_from(n).ok().filter(|&n| n.checked_mul(min_bytes).is_some_and(|b| b <= self.remaining()));
        fits.with_context(|| format!("{n} items cannot fit in the {} bytes left in the file", self.remaining()))
    }
    fn value(&mut self, ty: u32, depth: usize) -> Result<Value> {
        let b = |r: &mut Self, n| r.bytes(n).map(|s| s.to_vec());
        Ok(match ty {
            0 => Value::Int(b(self, 1)?[0] as i64),
            1 => Value::Int(b(self, 1)?[0] as i8 as i64),
            2 => Value::Int(u16::from_le_bytes(b(self, 2)?.try_into().unwrap()) as i64),
            3 => Value::Int(i16::from_le_bytes(b(self, 2)?.try_into().unwrap()) as i64),
            4 => Value::Int(self.u32()? as i64),
            5 => Value::Int(self.u32()? as i32 as i64),
            6 => Value::Float(f32::from_bits(self.u32()?) as f64),
            7 => Value::Bool(b(self, 1)?[0] != 0),
            8 => Value::Str(self.string()?),
            9 => {
                ensure!(depth < MAX_NESTING, "metadata arrays nested deeper than {MAX_NESTING}");
                let ety = self.u32()?;
                let n = self.count(min_value_bytes(ety)?)?;
                self.values_left = self
                    .values_left
                    .checked_sub(n)
                    .with_context(|| format!("more than {MAX_VALUES} metadata values in all (an array of {n})"))?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(ety, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::Int(self.u64()? as i64),
            11 => Value::Int(self.u64()? as i64),
            12 => Value::Float(f64::from_bits(self.u64()?)),
            other => bail!("unknown metadata value type {other}"),
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::model::gguf_write::{put_entry, write_file, Meta, OutTensor, ALIGNMENT};

    /// Writes a minimal GGUF v3 file: metadata, then tensors given as (name, dims fastest-first, type id, data).
    pub fn write_gguf(path: &Path, meta: &[(&str, Value)], tensors: &[(&str, Vec<u64>, u32, Vec<u8>)]) {
        let mut entries = Vec::new();
        for (k, v) in meta {
            let v = match v {
                Value::Int(i) => Meta::U32(*i as u32),
                Value::Float(f) => Meta::F32(*f as f32),
                Value::Bool(b) => Meta::Bool(*b),
                Value::Str(x) => Meta::Str(x.clone()),
                Value::Array(a) => {
                    Meta::Strs(a.iter().map(|x| x.as_str().expect("string arrays only").into()).collect())
                }
            };
            put_entry(&mut entries, k, &v);
        }
        let outs: Vec<OutTensor> = tensors
            .iter()
            .map(|(name, dims, ty, _)| OutTensor {
                name: name.to_string(),
                shape: dims.iter().rev().map(|&d| d as usize).collect(),
                dtype: GgmlType::from_id(*ty).unwrap(),
            })
            .collect();
        write_file(path, &entries, meta.len(), ALIGNMENT, &outs, |i| Ok(std::borrow::Cow::Borrowed(&tensors[i].3[..])))
            .unwrap();
    }

    #[test]
    fn reads_metadata_and_tensors_and_rejects_truncation() {
        let dir = tempdir();
        let path = dir.path().join("t.gguf");
        let data: Vec<u8> = [1f32, 2.0, 3.0, 4.0, 5.0, 6.0].iter().flat_map(|x| x.to_le_bytes()).collect();
        write_gguf(
            &path,
            &[("general.architecture", Value::Str("llama".into())), ("llama.block_count", Value::Int(2))],
            &[("w", vec![3, 2], 0, data)],
        );
        let g = GgufFile::open(&path).unwrap();
        assert_eq!(g.get("llama.block_count").and_then(Value::as_u64), Some(2));
        let info = &g.tensors["w"];
        assert_eq!(info.shape, vec![2, 3]);
        assert_eq!(g.dequantize(info), vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);

        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 16]).unwrap();
        let err = format!("{:#}", GgufFile::open(&path).err().unwrap());
        assert!(err.contains("truncated"), "{err}");
        std::fs::write(&path, b"GGUX0000").unwrap();
        let err = format!("{:#}", GgufFile::open(&path).err().unwrap());
        assert!(err.contains("bad magic"), "{err}");
    }

    /// A scratch directory, removed when dropped.
    pub fn tempdir() -> tempfile::TempDir {
        tempfile::Builder::new().prefix("weft-test-").tempdir().unwrap()
    }
}
