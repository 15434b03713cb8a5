//! Large buffers of numbers (weights, KV pools) in anonymous memory advised for transparent
//! huge pages: far fewer page faults when first touched and fewer TLB misses while weights
//! stream through the kernels. Falls back to ordinary pages where the advice is refused.
//!
//! A huge page covers only a 2 MB-aligned span inside one mapping, so a matrix mapped alone
//! and smaller than a few MB (a mixture's experts, a 1B model's attention) got none and
//! streamed at about 0.85 of the rate of one that did. Buffers below [`OWN`] are carved
//! one after another out of shared regions that start on a huge page instead.

use memmap2::MmapMut;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, Weak};

/// Element types for which all-zero bytes are the value zero.
///
/// # Safety
/// Implementors must be plain data with no padding, valid for every bit pattern.
pub unsafe trait Zeroable: Copy + Default {}
// SAFETY: f32, u16 (f16 bits), u8 (GGML blocks) and i8 (a KV cache's) are plain data,
// valid for every bit pattern.
unsafe impl Zeroable for f32 {}
unsafe impl Zeroable for u16 {}
unsafe impl Zeroable for u8 {}
unsafe impl Zeroable for i8 {}

/// A transparent huge page on x86-64 Linux.
const HUGE: usize = 2 << 20;
/// Bytes of a shared region: large, since the huge page holding the end of the last
/// buffer in a region is resident whole.
const REGION: usize = 256 << 20;
/// Bytes from which a buffer gets a region of its own.
const OWN: usize = 32 << 20;
/// Where each buffer in a shared region starts: a whole number of cache lines.
const ALIGN: usize = 64;

/// One anonymous mapping advised for huge pages, its usable bytes starting at a huge-page
/// boundary. Only ever handed out in disjoint spans, and never reused: a span freed
/// stays unused until the region's last buffer drops it, so buffers carved from it
/// should live as long as one another (a model's weights do).
struct Region {
    map: MmapMut,
    /// The first huge-page boundary in the map, `cap` bytes before its end or more.
    base: *mut u8,
    cap: usize,
}

// SAFETY: the region is plain memory; each buffer writes only its own span of it.
unsafe impl Send for Region {}
unsafe impl Sync for Region {}

impl Region {
    fn new(cap: usize) -> Arc<Region> {
        let mut map = MmapMut::map_anon(cap + HUGE).expect("allocating anonymous memory");
        #[cfg(target_os = "linux")]
        let _ = map.advise(memmap2::Advice::HugePage);
        let at = map.as_mut_ptr();
        let base = at.wrapping_add(at.align_offset(HUGE));
        Arc::new(Region { map, base, cap })
    }
}

/// The shared region being filled, while a buffer still holds it, and the bytes of it
/// handed out.
static FILLING: Mutex<Option<(Weak<Region>, usize)>> = Mutex::new(None);

/// `bytes` of zeros: a span of the region being filled, or of a fresh one.
fn carve(bytes: usize) -> (Arc<Region>, *mut u8) {
    if bytes >= OWN {
        let region = Region::new(bytes);
        let at = region.base;
        return (region, at);
    }
    let mut filling = FILLING.lock().unwrap_or_else(|e| e.into_inner());
    let (region, used) = match filling.as_ref().and_then(|(r, used)| Some((r.upgrade()?, *used))) {
        Some((r, used)) if used + bytes <= r.cap => (r, used),
        _ => (Region::new(REGION), 0),
    };
    let at = region.base.wrapping_add(used);
    *filling = Some((Arc::downgrade(&region), (used + bytes).next_multiple_of(ALIGN)));
    (region, at)
}

/// `len` values of `T` in huge-page-advised memory, zeros when made.
pub struct Buf<T: Zeroable> {
    /// The region holding `ptr..ptr + len` (kept for its lifetime), none when empty.
    _region: Option<Arc<Region>>,
    ptr: *mut T,
    len: usize,
    kind: PhantomData<T>,
}

// SAFETY: a buffer is the only one to reach its span of its region, and `T` is plain data.
unsafe impl<T: Zeroable + Send> Send for Buf<T> {}
unsafe impl<T: Zeroable + Sync> Sync for Buf<T> {}

pub type F32Buf = Buf<f32>;

impl<T: Zeroable> Buf<T> {
    /// `len` zeros.
    pub fn zeroed(len: usize) -> Self {
        if len == 0 {
            return Buf { _region: None, ptr: std::ptr::NonNull::dangling().as_ptr(), len, kind: PhantomData };
        }
        let (region, at) = carve(len * std::mem::size_of::<T>());
        Buf { _region: Some(region), ptr: at.cast(), len, kind: PhantomData }
    }

    /// A copy of `src`.
    pub fn copied(src: &[T]) -> Self {
        let mut buf = Self::zeroed(src.len());
        buf.copy_from_slice(src);
        buf
    }

    /// `len` zeros in a region of their own with every page already mapped, so the first
    /// writes into it (a KV pool's, during serving) do not each stop for a page fault. The
    /// kernel populates the pages in one call where it can (Linux 5.14+), else each page
    /// is written once.
    pub fn zeroed_resident(len: usize) -> Self {
        if len == 0 {
            return Self::zeroed(0);
        }
        let bytes = len * std::mem::size_of::<T>();
        let region = Region::new(bytes);
        #[cfg(target_os = "linux")]
        let populated = {
            let offset = region.base as usize - region.map.as_ptr() as usize;
            region.map.advise_range(memmap2::Advice::PopulateWrite, offset, bytes).is_ok()
        };
        #[cfg(not(target_os = "linux"))]
        let populated = false;
        let mut buf = Buf { ptr: region.base.cast(), _region: Some(region), len, kind: PhantomData };
        if populated {
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
        // SAFETY: `ptr` is aligned for `T` (regions start on a page, spans on a cache line)
        // and `len` elements of its region that only this buffer reaches, zero-initialised
        // at first, which `Zeroable` makes valid values; dangling but aligned when empty.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl<T: Zeroable> DerefMut for Buf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::{Buf, F32Buf, ALIGN, HUGE, OWN};

    #[test]
    fn buffers_carved_side_by_side_are_each_their_own() {
        let mut bufs: Vec<Buf<u8>> = (1..300).map(|i| Buf::zeroed(i * 997)).collect();
        // Neighbours differ: each buffer's own nonzero byte.
        let mark = |i: usize| (i % 255) as u8 + 1;
        for (i, b) in bufs.iter_mut().enumerate() {
            assert!(b.iter().all(|&x| x == 0), "buffer {i} is not zeroed");
            assert_eq!(b.as_ptr() as usize % ALIGN, 0, "buffer {i} starts inside a cache line");
            b.fill(mark(i));
        }
        for (i, b) in bufs.iter().enumerate() {
            assert!(b.iter().all(|&x| x == mark(i)), "buffer {i} was written by another");
        }
        let own = Buf::<u8>::zeroed(OWN);
        let pool = F32Buf::zeroed_resident(5000);
        assert!([own.as_ptr() as usize, pool.as_ptr() as usize].iter().all(|p| p % HUGE == 0));
    }

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
