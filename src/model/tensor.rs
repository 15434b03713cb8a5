//! Weights that either borrow the memory-mapped file or own converted data: f32 tensors
//! and 16-bit float rows.

use crate::kernels::matmul::Half;
use memmap2::Mmap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

/// A weights file, mapped for reading whole tensors and open for reading single rows: rows
/// read now and then while serving (an embedding, a few logits recomputed exactly) are read
/// into a buffer, since a fault through the map maps the pages around it too and a
/// vocabulary's worth of such faults would map the whole matrix into the process.
pub struct MappedFile {
    file: File,
    map: Mmap,
}

impl MappedFile {
    pub fn open(path: &Path) -> std::io::Result<Self> {
        let file = File::open(path)?;
        // SAFETY: the file is opened read-only; weights files are not modified while served.
        let map = unsafe { Mmap::map(&file) }?;
        Ok(MappedFile { file, map })
    }

    /// Fills `buf` from byte `offset` of the file with a read (through the map if the read
    /// fails).
    pub fn read_at(&self, buf: &mut [u8], offset: usize) {
        if self.file.read_exact_at(buf, offset as u64).is_err() {
            buf.copy_from_slice(&self.map[offset..offset + buf.len()]);
        }
    }

    /// Drops the pages of `len` bytes at `offset` from this process once they have been
    /// read through: they stay in the page cache and come back from the file if read again.
    pub fn release(&self, offset: usize, len: usize) {
        // SAFETY: the map is read-only, so dropping its pages loses nothing: a later read
        // faults them in again from the file. Failing to release is harmless.
        let _ = unsafe { self.map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, offset, len) };
    }
}

impl std::ops::Deref for MappedFile {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.map
    }
}

pub struct Tensor {
    pub shape: Vec<usize>,
    data: Data,
}

enum Data {
    Owned(Vec<f32>),
    Mapped { map: Arc<MappedFile>, offset: usize, len: usize },
}

impl Tensor {
    pub fn owned(shape: Vec<usize>, data: Vec<f32>) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        Tensor { shape, data: Data::Owned(data) }
    }

    /// Borrows `len` f32 values at `offset` of the map, if they are aligned for f32 reads.
    pub fn mapped(shape: Vec<usize>, map: Arc<MappedFile>, offset: usize, len: usize) -> Option<Self> {
        let aligned = (map.as_ptr() as usize + offset).is_multiple_of(std::mem::align_of::<f32>());
        (aligned && cfg!(target_endian = "little")).then_some(Tensor { shape, data: Data::Mapped { map, offset, len } })
    }

    pub fn data(&self) -> &[f32] {
        match &self.data {
            Data::Owned(v) => v,
            Data::Mapped { map, offset, len } => {
                let bytes = &map[*offset..*offset + len * 4];
                // SAFETY: alignment was checked in `mapped`; the map lives as long as self.
                unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<f32>(), *len) }
            }
        }
    }
}

/// A matrix's 16-bit float rows (f16 or bf16 bit patterns, little-endian), left in the
/// file where they are stored in order, so that rows read now and then (an embedding, a
/// few logits recomputed exactly) cost pages of the page cache, not a copy.
pub struct HalfRows {
    pub format: Half,
    cols: usize,
    data: Bits,
}

enum Bits {
    Owned(Vec<u16>),
    Mapped { map: Arc<MappedFile>, offset: usize, len: usize },
}

impl HalfRows {
    pub fn owned(format: Half, cols: usize, bits: Vec<u16>) -> Self {
        debug_assert!(cols > 0 && bits.len().is_multiple_of(cols));
        HalfRows { format, cols, data: Bits::Owned(bits) }
    }

    /// Borrows `len` values at `offset` of the map, if they are aligned for 16-bit reads.
    pub fn mapped(format: Half, cols: usize, map: Arc<MappedFile>, offset: usize, len: usize) -> Option<Self> {
        let aligned = (map.as_ptr() as usize + offset).is_multiple_of(std::mem::align_of::<u16>());
        let fits = offset.checked_add(2 * len).is_some_and(|end| end <= map.len());
        (aligned && fits && cfg!(target_endian = "little") && cols > 0 && len.is_multiple_of(cols))
            .then_some(HalfRows { format, cols, data: Bits::Mapped { map, offset, len } })
    }

    /// Every row's bit patterns, row-major, through the map: for reading the whole matrix
    /// at load (then [`MappedFile::release`] it); single rows are read by `row_into`.
    pub fn bits(&self) -> &[u16] {
        match &self.data {
            Bits::Owned(v) => v,
            Bits::Mapped { map, offset, len } => {
                let bytes = &map[*offset..*offset + 2 * len];
                // SAFETY: alignment and bounds were checked in `mapped`; the map lives as
                // long as self.
                unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<u16>(), *len) }
            }
        }
    }

    pub fn rows(&self) -> usize {
        self.bits().len() / self.cols
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes this holds in anonymous memory (a mapped matrix holds none).
    pub fn owned_bytes(&self) -> usize {
        match &self.data {
            Bits::Owned(v) => 2 * v.len(),
            Bits::Mapped { .. } => 0,
        }
    }

    /// Row `r` as f32, read from the file when it was left there.
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        let (cols, format) = (self.cols, self.format);
        match &self.data {
            Bits::Owned(v) => {
                out.iter_mut().zip(&v[r * cols..(r + 1) * cols]).for_each(|(o, &b)| *o = format.to_f32(b))
            }
            Bits::Mapped { map, offset, .. } => {
                let mut buf = vec![0u8; 2 * cols];
                map.read_at(&mut buf, offset + 2 * r * cols);
                let bits = buf.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]]));
                out.iter_mut().zip(bits).for_each(|(o, b)| *o = format.to_f32(b));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn mapped_half_rows_read_as_owned_ones_and_refuse_what_does_not_fit() {
        let values: Vec<f32> = (0..3 * 40).map(|i| (i as f32 - 60.0) / 8.0).collect();
        let bits: Vec<u16> = values.iter().map(|&v| half::f16::from_f32(v).to_bits()).collect();
        let mut file = tempfile::NamedTempFile::new().unwrap();
        file.write_all(&[0u8; 2]).unwrap();
        file.write_all(&bits.iter().flat_map(|b| b.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
        let map = Arc::new(MappedFile::open(file.path()).unwrap());
        let mapped = HalfRows::mapped(Half::F16, 40, map.clone(), 2, bits.len()).unwrap();
        let owned = HalfRows::owned(Half::F16, 40, bits.clone());
        assert_eq!((mapped.rows(), mapped.cols(), mapped.owned_bytes(), owned.owned_bytes()), (3, 40, 0, 240));
        for r in 0..3 {
            let (mut a, mut b) = (vec![0f32; 40], vec![0f32; 40]);
            mapped.row_into(r, &mut a);
            owned.row_into(r, &mut b);
            assert_eq!((a.as_slice(), b.as_slice()), (&values[r * 40..(r + 1) * 40], &values[r * 40..(r + 1) * 40]));
        }
        assert!(HalfRows::mapped(Half::F16, 40, map.clone(), 1, 40).is_none(), "misaligned");
        assert!(HalfRows::mapped(Half::F16, 40, map.clone(), 2, bits.len() + 40).is_none(), "past the end");
        assert!(HalfRows::mapped(Half::F16, 40, map, 2, 60).is_none(), "not whole rows");
    }
}
