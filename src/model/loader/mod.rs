//! Weight sources: anything that can hand out a named f32 tensor of an expected shape.
//! Names are Hugging Face names; each source maps them onto its own format.

mod gguf;
mod safetensors;

pub use gguf::{gguf_expert, gguf_name, permute_rows, GgufWeights};
pub use safetensors::SafetensorsWeights;

use super::tensor::{HalfRows, Tensor};
use crate::kernels::quant::GgmlType;
use anyhow::Result;
use std::borrow::Cow;

pub trait WeightSource {
    /// The tensor `name`, checked to have `shape` (row-major, `[out, in]` for linear layers).
    fn load(&self, name: &str, shape: &[usize]) -> Result<Tensor>;
    fn contains(&self, name: &str) -> bool;
    /// The tensor's raw blocks when it is stored in a GGML block format (row-major rows of
    /// whole blocks, in Hugging Face row order), so it can be computed without widening:
    /// borrowed from a mapped file where its rows need no reordering, so that repacking
    /// reads the file's pages rather than a copy of them (a copy costs as many fresh pages
    /// again, and zeroing fresh pages is most of a load). [`WeightSource::release`] it after.
    fn load_blocks(&self, _name: &str, _shape: &[usize]) -> Result<Option<(GgmlType, Cow<'_, [u8]>)>> {
        Ok(None)
    }
    /// `name`'s bytes handed out by [`WeightSource::load_blocks`] are no longer needed: a
    /// mapped source drops its pages from this process, so that loading holds at most one
    /// tensor of the file beside the weights built from it.
    fn release(&self, _name: &str) {}
    /// The tensor's 16-bit float rows (Hugging Face row order) when it is stored as f16 or
    /// bf16, so it can stay 16-bit: borrowed from a mapped file where its rows need no
    /// reordering. [`WeightSource::release`] it after reading it through.
    fn load_half(&self, _name: &str, _shape: &[usize]) -> Result<Option<HalfRows>> {
        Ok(None)
    }
    /// Whether Gemma's `(1 + w)` norm weights are stored with the 1 already added, as
    /// llama.cpp's converter writes them (Hugging Face stores `w`).
    fn norms_include_one(&self) -> bool {
        false
    }
}

/// Little-endian 16-bit values (f16/bf16 bit patterns) of raw tensor bytes.
fn le_u16s(bytes: &[u8]) -> Vec<u16> {
    bytes.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect()
}

fn check_shape(file: &std::path::Path, name: &str, want: &[usize], found: &[usize]) -> Result<()> {
    anyhow::ensure!(want == found, "{}: tensor {name} has shape {found:?}, expected {want:?}", file.display());
    Ok(())
}
