//! Large buffers of numbers (weights, KV pools) in anonymous memory advised for transparent
//! huge pages: far fewer page faults when first touched and fewer TLB misses while weights
//! stream through the kernels. Falls back to ordinary pages where the advice is refused.

use memmap2::MmapMut;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};

/// Element types for which all-zero bytes are the value zero.
///
/// # Safety
/// Implementors must be plain data with no padding, valid for every bit pattern.
pub unsafe trait Zeroable: Copy + Default {}
// SAFETY: f32, u16 (f16 bits) and u8 (GGML blocks) are plain data, valid for every bit
// pattern.
unsafe impl Zeroable for f32 {}
unsafe impl Zeroable for u16 {}
unsafe impl Zeroable for u8 {}

pub struct Buf<T: Zeroable> {
    map: Option<MmapMut>,
    len: usize,
    kind: PhantomData<T>,
}

pub type F32Buf = Buf<f32>;

impl<T: Zeroable> Buf<T> {
    /// `len` zeros.
    pub fn zeroed(len: usize) -> Self {
        if len == 0 {
            return Buf { map: None, len, kind: PhantomData };
        }
        let map = MmapMut::map_anon(len * std::mem::size_of::<T>()).expect("allocating anonymous memory");
        #[cfg(target_os = "linux")]
        let _ = map.advise(memmap2::Advice::HugePage);
        Buf { map: Some(map), len, kind: PhantomData }
    }

    /// A copy of `src`.
    pub fn copied(src: &[T]) -> Self {
        let mut buf = Self::zeroed(src.len());
        buf.copy_from_slice(src);
        buf
    }

    /// `len` zeros with every page already mapped, so the first writes into it (a KV pool's,
    /// during serving) do not each stop for a page fault. The kernel populates the pages in
    /// one call where it can (Linux 5.14+), else each page is written once.
    pub fn zeroed_resident(len: usize) -> Self {
        let mut buf = Self::zeroed(len);
        #[cfg(target_os = "linux")]
        if let Some(Ok(())) = buf.map.as_ref().map(|m| m.advise(memmap2::Advice::PopulateWrite)) {
            return buf;
        }
        let page = 4096 / std::mem::size_of::<T>();
        for i in (0..len).step_by(page) {
            // A volatile write, so the store that faults the page in is not optimised away.
            // SAFETY: `i < len`, inside the buffer.
            unsafe { std::ptr::write_volatile(buf.as_mut_ptr().add(i), T::default()) };
        }
        buf
    }
}

impl<T: Zeroable> Deref for Buf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match &self.map {
            // SAFETY: the map is page-aligned, `len` elements long, and zero-initialised,
            // which `Zeroable` makes valid values.
            Some(m) => unsafe { std::slice::from_raw_parts(m.as_ptr().cast::<T>(), self.len) },
            None => &[],
        }
    }
}

impl<T: Zeroable> DerefMut for Buf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.map {
            // SAFETY: as in `deref`, and `&mut self` makes the access exclusive.
            Some(m) => unsafe { std::slice::from_raw_parts_mut(m.as_mut_ptr().cast::<T>(), self.len) },
            None => &mut [],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::F32Buf;

    #[test]
    fn zeroed_reads_and_writes() {
        let mut b = F32Buf::zeroed(1000);
        assert!(b.iter().all(|x| *x == 0.0));
        b[999] = 2.5;
        assert_eq!(b[999], 2.5);
        assert!(F32Buf::zeroed(0).is_empty());
        let r = F32Buf::zeroed_resident(5000);
        assert!(r.len() == 5000 && r.iter().all(|x| *x == 0.0));
        assert_eq!(&*super::Buf::copied(&[1u8, 2, 3]), &[1, 2, 3]);
    }
}
