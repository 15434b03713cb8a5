//! Hugging Face safetensors (one file or shards): f32 tensors, and f16/bf16 ones kept
//! 16-bit, are borrowed from the memory map; f16/bf16 asked for as f32 are widened once
//! at load.

use super::{check_shape, le_u16s, HalfRows, Tensor, WeightSource};
use crate::kernels::matmul::Half;
use crate::kernels::quant::GgmlType;
use crate::kernels::ternary;
use crate::model::tensor::MappedFile;
use anyhow::{bail, Context, Result};
use safetensors::{Dtype, SafeTensors};
use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

struct Entry {
    file: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    offset: usize,
    len_bytes: usize,
}

pub struct SafetensorsWeights {
    files: Vec<(PathBuf, Arc<MappedFile>)>,
    entries: HashMap<String, Entry>,
}

impl SafetensorsWeights {
    /// Opens every `*.safetensors` file of a model directory.
    pub fn open_dir(dir: &Path) -> Result<Self> {
        let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
            .with_context(|| format!("reading {}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect();
        if paths.is_empty() {
            bail!("{}: no *.safetensors files", dir.display());
        }
        paths.sort();
        let mut files = Vec::new();
        let mut entries = HashMap::new();
        for (i, path) in paths.into_iter().enumerate() {
            let map = Arc::new(MappedFile::open(&path).with_context(|| format!("opening {}", path.display()))?);
            let st = SafeTensors::deserialize(&map)
                .with_context(|| format!("{}: invalid or truncated safetensors file", path.display()))?;
            for (name, view) in st.tensors() {
                let offset = view.data().as_ptr() as usize - map.as_ptr() as usize;
                entries.insert(
                    name,
                    Entry {
                        file: i,
                        dtype: view.dtype(),
                        shape: view.shape().to_vec(),
                        offset,
                        len_bytes: view.data().len(),
                    },
                );
            }
            files.push((path, map));
        }
        Ok(SafetensorsWeights { files, entries })
    }
}

impl SafetensorsWeights {
    /// Every tensor's name and shape, in name order: a packed ternary matrix with its
    /// unpacked shape (its `_scale` folded into it, [`Self::packed_ternary`]).
    pub fn shapes(&self) -> Vec<(&str, Vec<usize>)> {
        let packed = |n: &str, e: &Entry| self.is_packed(n, e);
        let scale_of_packed =
            |n: &str| n.strip_suffix("_scale").is_some_and(|w| self.entries.get(w).is_some_and(|e| packed(w, e)));
        let mut all: Vec<_> = self
            .entries
            .iter()
            .filter(|(n, _)| !scale_of_packed(n))
            .map(|(n, e)| match (packed(n, e), e.shape.as_slice()) {
                (true, &[rows, k]) => (n.as_str(), vec![4 * rows, k]),
                _ => (n.as_str(), e.shape.clone()),
            })
            .collect();
        all.sort_unstable();
        all
    }

    /// The entry `name` and its file (path and map), checked to have `shape`.
    fn entry(&self, name: &str, shape: &[usize]) -> Result<(&Entry, &Path, &Arc<MappedFile>)> {
        let Some(e) = self.entries.get(name) else {
            let dir = self.files[0].0.parent().unwrap_or(Path::new("."));
            bail!("{}: tensor {name} not found in any *.safetensors file", dir.display());
        };
        let (path, map) = &self.files[e.file];
        check_shape(path, name, shape, &e.shape)?;
        Ok((e, path, map))
    }
}

impl SafetensorsWeights {
    /// Whether entry `e` (named `name`) is a ternary matrix packed as BitNet b1.58 is
    /// released: uint8, with a `<name>_scale` beside it.
    fn is_packed(&self, name: &str, e: &Entry) -> bool {
        e.dtype == Dtype::U8 && self.entries.contains_key(&format!("{name}_scale"))
    }

    /// A ternary matrix `[rows, k]` packed as BitNet b1.58 is released (uint8 `[rows / 4,
    /// k]`, four codes a byte, and a one-value `<name>_scale` beside it): its codes and
    /// scale, or `None` when `name` is not stored so.
    fn packed_ternary(&self, name: &str, shape: &[usize]) -> Result<Option<(Vec<u8>, f32)>> {
        let (Some(e), [rows, k]) = (self.entries.get(name), shape) else { return Ok(None) };
        if !self.is_packed(name, e) {
            return Ok(None);
        }
        let scale_name = format!("{name}_scale");
        let (path, map) = &self.files[e.file];
        let fail = |why: String| anyhow::anyhow!("{}: tensor {name}: {why}", path.display());
        if e.shape != [rows / 4, *k] || !rows.is_multiple_of(4) {
            return Err(fail(format!("packed shape {:?}, expected [{}, {k}] for [{rows}, {k}]", e.shape, rows / 4)));
        }
        let codes = ternary::unpack_hf(&map[e.offset..e.offset + e.len_bytes], *rows, *k).map_err(fail)?;
        let scale = self.load(&scale_name, &[1])?.data()[0];
        if !scale.is_finite() {
            return Err(fail(format!("its weight_scale is {scale}")));
        }
        Ok(Some((codes, scale)))
    }

    /// A matrix stack `[.., rows, k]` stored in MXFP4 as gpt-oss is released (uint8
    /// `<name>_blocks` `[.., rows, k / 32, 16]`, two E2M1 codes a byte, the earlier value
    /// in the low nibble, and `<name>_scales` `[.., rows, k / 32]`, E8M0): its rows as
    /// GGUF's MXFP4 blocks (a scale byte, then value `j` in the low nibble of byte `j` and
    /// value `j + 16` in its high one), or `None` when `name` is not stored so.
    fn mxfp4(&self, name: &str, shape: &[usize]) -> Result<Option<Vec<u8>>> {
        let (Some(b), Some(s)) =
            (self.entries.get(&format!("{name}_blocks")), self.entries.get(&format!("{name}_scales")))
        else {
            return Ok(None);
        };
        let (path, map) = &self.files[b.file];
        let fail = |why: String| anyhow::anyhow!("{}: tensor {name}: {why}", path.display());
        let Some((&k, outer)) = shape.split_last().filter(|(&k, _)| k > 0 && k.is_multiple_of(32)) else {
            return Err(fail(format!("MXFP4 blocks for shape {shape:?}, whose rows are not whole blocks of 32")));
        };
        let blocks_shape = [outer, &[k / 32, 16]].concat();
        let scales_shape = [outer, &[k / 32]].concat();
        if b.dtype != Dtype::U8 || s.dtype != Dtype::U8 || b.shape != blocks_shape || s.shape != scales_shape {
            return Err(fail(format!(
                "MXFP4 blocks {:?} {:?} and scales {:?} {:?}, expected U8 {blocks_shape:?} and {scales_shape:?}",
                b.dtype, b.shape, s.dtype, s.shape
            )));
        }
        let codes = &map[b.offset..b.offset + b.len_bytes];
        let scales = &self.files[s.file].1[s.offset..s.offset + s.len_bytes];
        if let Some(i) = scales.iter().position(|&e| e == 0xFF) {
            return Err(fail(format!("MXFP4 block {i} has scale byte 0xFF (NaN in E8M0)")));
        }
        let mut out = Vec::with_capacity(scales.len() * 17);
        for (&e, hf) in scales.iter().zip(codes.chunks_exact(16)) {
            let code = |v: usize| hf[v / 2] >> (4 * (v % 2)) & 0xF;
            out.push(e);
            out.extend((0..16).map(|j| code(j) | code(j + 16) << 4));
        }
        Ok(Some(out))
    }
}

impl WeightSource for SafetensorsWeights {
    fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    fn load_blocks(&self, name: &str, shape: &[usize]) -> Result<Option<(GgmlType, Cow<'_, [u8]>)>> {
        if let Some(raw) = self.mxfp4(name, shape)? {
            return Ok(Some((GgmlType::Mxfp4, Cow::Owned(raw))));
        }
        let Some((codes, scale)) = self.packed_ternary(name, shape)? else { return Ok(None) };
        Ok(ternary::codes_to_tq2_0(&codes, shape[1], scale).map(|b| (GgmlType::Tq2_0, Cow::Owned(b))))
    }

    fn load_half(&self, name: &str, shape: &[usize]) -> Result<Option<HalfRows>> {
        // A packed ternary matrix is not 16-bit (and is unpacked only by the other loads).
        if self.entries.get(name).is_some_and(|e| self.is_packed(name, e)) {
            return Ok(None);
        }
        let (e, _, map) = self.entry(name, shape)?;
        let format = match e.dtype {
            Dtype::F16 => Half::F16,
            Dtype::BF16 => Half::Bf16,
            _ => return Ok(None),
        };
        let cols = shape[1..].iter().product();
        let mapped = HalfRows::mapped(format, cols, map.clone(), e.offset, e.len_bytes / 2);
        Ok(Some(
            mapped.unwrap_or_else(|| HalfRows::owned(format, cols, le_u16s(&map[e.offset..e.offset + e.len_bytes]))),
        ))
    }

    fn load(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        if let Some((codes, scale)) = self.packed_ternary(name, shape)? {
            // W = t · weight_scale (`autobitlinear`), as the f32 path computes it.
            let data = codes.iter().map(|&c| (c as i32 - 1) as f32 * scale).collect();
            return Ok(Tensor::owned(shape.to_vec(), data));
        }
        let (e, path, map) = self.entry(name, shape)?;
        let n: usize = shape.iter().product();
        let bytes = &map[e.offset..e.offset + e.len_bytes];
        let data = match e.dtype {
            Dtype::F32 => {
                if let Some(t) = Tensor::mapped(shape.to_vec(), map.clone(), e.offset, n) {
                    return Ok(t);
                }
                bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
            }
            Dtype::F16 => le_u16s(bytes).into_iter().map(|b| Half::F16.to_f32(b)).collect(),
            Dtype::BF16 => le_u16s(bytes).into_iter().map(|b| Half::Bf16.to_f32(b)).collect(),
            other => bail!("{}: tensor {name} has dtype {other:?}; supported: F32, F16, BF16", path.display()),
        };
        Ok(Tensor::owned(shape.to_vec(), data))
    }
}
