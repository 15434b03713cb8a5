//! An f32 weight that either borrows the memory-mapped file or owns converted data.

use memmap2::Mmap;
use std::sync::Arc;

pub struct Tensor {
    pub shape: Vec<usize>,
    data: Data,
}

enum Data {
    Owned(Vec<f32>),
    Mapped { map: Arc<Mmap>, offset: usize, len: usize },
}

impl Tensor {
    pub fn owned(shape: Vec<usize>, data: Vec<f32>) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        Tensor { shape, data: Data::Owned(data) }
    }

    /// Borrows `len` f32 values at `offset` of the map, if they are aligned for f32 reads.
    pub fn mapped(shape: Vec<usize>, map: Arc<Mmap>, offset: usize, len: usize) -> Option<Self> {
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
