//! Large f32 buffers (weights, KV pools) in anonymous memory advised for transparent huge
//! pages: far fewer page faults when first touched and fewer TLB misses while weights
//! stream through the kernels. Falls back to ordinary pages where the advice is refused.

use memmap2::MmapMut;
use std::ops::{Deref, DerefMut};

pub struct F32Buf {
    map: Option<MmapMut>,
    len: usize,
}

impl F32Buf {
    /// `len` zeros.
    pub fn zeroed(len: usize) -> Self {
        if len == 0 {
            return F32Buf { map: None, len };
        }
        let map = MmapMut::map_anon(len * std::mem::size_of::<f32>()).expect("allocating anonymous memory");
        #[cfg(target_os = "linux")]
        let _ = map.advise(memmap2::Advice::HugePage);
        F32Buf { map: Some(map), len }
    }

    /// `len` zeros with every page already mapped, so the first writes into it (a KV pool's,
    /// during serving) do not each stop for a page fault.
    pub fn zeroed_resident(len: usize) -> Self {
        let mut buf = Self::zeroed(len);
        const PAGE_FLOATS: usize = 4096 / std::mem::size_of::<f32>();
        for i in (0..len).step_by(PAGE_FLOATS) {
            // A volatile write, so the store that faults the page in is not optimised away.
            // SAFETY: `i < len`, inside the buffer.
            unsafe { std::ptr::write_volatile(buf.as_mut_ptr().add(i), 0.0) };
        }
        buf
    }
}

impl Deref for F32Buf {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match &self.map {
            // SAFETY: the map is page-aligned, `len` floats long, and zero-initialised.
            Some(m) => unsafe { std::slice::from_raw_parts(m.as_ptr().cast::<f32>(), self.len) },
            None => &[],
        }
    }
}

impl DerefMut for F32Buf {
    fn deref_mut(&mut self) -> &mut [f32] {
        match &mut self.map {
            // SAFETY: as in `deref`, and `&mut self` makes the access exclusive.
            Some(m) => unsafe { std::slice::from_raw_parts_mut(m.as_mut_ptr().cast::<f32>(), self.len) },
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
    }
}
