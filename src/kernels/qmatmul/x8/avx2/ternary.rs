//! The ternary formats: TQ2_0's 2-bit codes `t + 1` and TQ1_0's base-3 digits `t + 1`,
//! one scale per 256 values.

use super::*;

/// TQ2_0 (and TQ1_0 with `ONE`, its codes decoded ahead as TQ2_0's, [`decode_tq1`]):
/// eight rows' codes `u = t + 1` (0, 1 or 2, unsigned for `maddubs`) against the
/// activations, the block's activation sum taken off: `Σ t·x = Σ u·x − Σ x`. A chunk's 32
/// bytes hold 16 values of each row, four 2-bit fields a byte, and each field masked out
/// is four consecutive values of every row, against four broadcast activation bytes: no
/// table, no sign trick. AVX2's `maddubs` pairs are at most 2 · 127 · 2, so a block's 64
/// of them add in i16 (64 · 508 < 2¹⁵) before one `madd` widens; VNNI adds in i32, from
/// `−Σx`, its fields masked in place ([`tq2_block_vnni`]). Both compute the same
/// integers, so the same bits.
///
/// # Safety
/// AVX2, FMA and F16C must be available (with `V`, what [`vnni`] checks too); `src`
/// holds `blocks` records (with `ONE`, TQ1_0's and their decoded codes) and `xq` the
/// activation rows `first..first + R`, scaled at most once per 256 values.
#[inline(always)]
pub(super) unsafe fn tq2<const V: bool, const ONE: bool, const R: usize>(
    src: Src,
    xq: &QActs,
    first: usize,
    blocks: usize,
    out: &mut [[f32; GROUP]; TILE],
) {
    unsafe {
        let (rec_bytes, head) = record(if ONE { GgmlType::Tq1_0 } else { GgmlType::Tq2_0 });
        let sums = xq.block_sums();
        let three = _mm256_set1_epi8(3);
        let mut acc = [_mm256_setzero_ps(); R];
        for b in 0..blocks {
            let rec = src.rec.add(b * rec_bytes);
            let codes = if ONE { src.vals.add(b * DECODED_TQ1) } else { rec.add(head) };
            let at = |t: usize| (first + t) * blocks + b;
            let s: [__m256i; R] = if V {
                tq2_block_vnni::<R>(codes, xq.q.as_ptr(), at, sums)
            } else {
                let mut s = [_mm256_setzero_si256(); R];
                for ch in 0..16 {
                    let v = _mm256_loadu_si256(codes.add(32 * ch).cast());
                    let u = [
                        _mm256_and_si256(v, three),
                        _mm256_and_si256(_mm256_srli_epi16::<2>(v), three),
                        _mm256_and_si256(_mm256_srli_epi16::<4>(v), three),
                        _mm256_and_si256(_mm256_srli_epi16::<6>(v), three),
                    ];
                    // Field `l` of chunk `ch` is values 128·(ch / 8) + 32·l + 4·(ch % 8)...
                    let base = 128 * (ch / 8) + 4 * (ch % 8);
                    for (t, s) in s.iter_mut().enumerate() {
                        let x = xq.q.as_ptr().add(at(t) * 256 + base);
                        for (l, u) in u.iter().enumerate() {
                            *s = _mm256_add_epi16(*s, _mm256_maddubs_epi16(*u, bcast(x.add(32 * l))));
                        }
                    }
                }
                s
            };
            weigh::<R>(rec, &scaled::<V, R>(s, xq, at), &mut acc);
        }
        store(&acc, out);
    }
}

/// [`tq2`] for two groups with VNNI (TQ1_0's with `ONE`, decoded ahead), both in each
/// 512-bit register ([`two_groups`]): each broadcast of activations feeds both groups'
/// sixteen rows in one `vpdpbusd`. The same operations per lane as one group's in
/// [`tq2_block_vnni`], [`scaled`] and [`weigh`], so the same bits.
///
/// # Safety
/// As [`tq2`]'s with `V`, for two groups.
#[inline(always)]
pub(super) unsafe fn tq2_two<const ONE: bool, const R: usize>(
    src: [Src; 2],
    xq: &QActs,
    first: usize,
    blocks: usize,
    out: &mut [[[f32; GROUP]; TILE]; 2],
) {
    unsafe {
        let (rec_bytes, head) = record(if ONE { GgmlType::Tq1_0 } else { GgmlType::Tq2_0 });
        let sums = xq.block_sums();
        let x = xq.q.as_ptr();
        let mask =
            [_mm512_set1_epi8(0x03), _mm512_set1_epi8(0x0C), _mm512_set1_epi8(0x30), _mm512_set1_epi8(0xC0u8 as i8)];
        let mut acc = [_mm512_setzero_ps(); R];
        for b in 0..blocks {
            let rec = [src[0].rec.add(b * rec_bytes), src[1].rec.add(b * rec_bytes)];
            let codes: [*const u8; 2] = if ONE {
                [src[0].vals.add(b * DECODED_TQ1), src[1].vals.add(b * DECODED_TQ1)]
            } else {
                [rec[0].add(head), rec[1].add(head)]
            };
            let at = |t: usize| (first + t) * blocks + b;
            let mut s = [[_mm512_setzero_si512(); 4]; R];
            for (t, s) in s.iter_mut().enumerate() {
                s[0] = _mm512_set1_epi32(-sums.get_unchecked(at(t)));
            }
            for ch in 0..16 {
                let v = two_groups(codes[0].add(32 * ch), codes[1].add(32 * ch));
                let base = 128 * (ch / 8) + 4 * (ch % 8);
                for (l, &m) in mask.iter().enumerate() {
                    let u = _mm512_and_si512(v, m);
                    for (t, s) in s.iter_mut().enumerate() {
                        let xb = x.add(at(t) * 256 + base + 32 * l).cast::<i32>().read_unaligned();
                        s[l] = _mm512_dpbusd_epi32(s[l], u, _mm512_set1_epi32(xb));
                    }
                }
            }
            let dw = two_groups_ps(
                _mm256_cvtph_ps(_mm_loadu_si128(rec[0].cast())),
                _mm256_cvtph_ps(_mm_loadu_si128(rec[1].cast())),
            );
            for (t, (acc, s)) in acc.iter_mut().zip(&s).enumerate() {
                let high = _mm512_add_epi32(_mm512_srai_epi32::<2>(s[1]), _mm512_srai_epi32::<4>(s[2]));
                let sum = _mm512_add_epi32(_mm512_add_epi32(s[0], high), _mm512_srai_epi32::<6>(s[3]));
                let blk = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(*xq.d.get_unchecked(16 * at(t))));
                *acc = _mm512_fmadd_ps(dw, blk, *acc);
            }
        }
        let [a, b] = out;
        store_two(&acc, [a, b]);
    }
}

/// A block's integer sums `s` of the tile's rows (row `t`'s block at index `at(t)`), as
/// `Σ t·x` times the row's activation scale: with `V` they are already, else they are
/// the i16 sums of `Σ u·x`, widened and the block's activation sum taken off.
///
/// # Safety
/// AVX2 must be available; `xq` holds the blocks that `at` indexes.
#[inline(always)]
unsafe fn scaled<const V: bool, const R: usize>(
    s: [__m256i; R],
    xq: &QActs,
    at: impl Fn(usize) -> usize,
) -> [__m256; R] {
    unsafe {
        let (ones, sums) = (_mm256_set1_epi16(1), xq.block_sums());
        let mut blk = [_mm256_setzero_ps(); R];
        for (t, (blk, s)) in blk.iter_mut().zip(s).enumerate() {
            let s = if V { s } else { _mm256_sub_epi32(_mm256_madd_epi16(s, ones), _mm256_set1_epi32(sums[at(t)])) };
            *blk = _mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(*xq.d.get_unchecked(16 * at(t))));
        }
        blk
    }
}

/// One TQ2_0 block's integer sums `Σ t·x` (codes at `codes`, 16 chunks) for each of the
/// `R` activation rows (row `t`'s block at index `at(t)` of `x`, its sum in `sums`), with
/// VNNI: each 2-bit field is masked in place, not shifted down, so field `l` holds `4^l`
/// times its code and has a `vpdpbusd` chain of its own, divided back exactly at the end
/// (products at most 128 · 127, four to a lane, sixteen chunks). Four chains a row also
/// keep `vpdpbusd`'s latency off a one-row product. The same integers as [`tq2`]'s AVX2
/// sums.
///
/// # Safety
/// What [`vnni`] checks must be available; `codes` holds a block's 16 chunks and `x` the
/// blocks that `at` indexes.
#[inline(always)]
unsafe fn tq2_block_vnni<const R: usize>(
    codes: *const u8,
    x: *const i8,
    at: impl Fn(usize) -> usize,
    sums: &[i32],
) -> [__m256i; R] {
    unsafe {
        // Plain calls, not `map` (see [`k_sub`]).
        let mask =
            [_mm256_set1_epi8(0x03), _mm256_set1_epi8(0x0C), _mm256_set1_epi8(0x30), _mm256_set1_epi8(0xC0u8 as i8)];
        let mut s = [[_mm256_setzero_si256(); 4]; R];
        for (t, s) in s.iter_mut().enumerate() {
            s[0] = _mm256_set1_epi32(-sums.get_unchecked(at(t)));
        }
        for ch in 0..16 {
            let v = _mm256_loadu_si256(codes.add(32 * ch).cast());
            let base = 128 * (ch / 8) + 4 * (ch % 8);
            for (l, &m) in mask.iter().enumerate() {
                let u = _mm256_and_si256(v, m);
                for (t, s) in s.iter_mut().enumerate() {
                    s[l] = dot4(s[l], u, bcast(x.add(at(t) * 256 + base + 32 * l)));
                }
            }
        }
        let mut out = [_mm256_setzero_si256(); R];
        for (o, s) in out.iter_mut().zip(&s) {
            let high = _mm256_add_epi32(_mm256_srai_epi32::<2>(s[1]), _mm256_srai_epi32::<4>(s[2]));
            *o = _mm256_add_epi32(_mm256_add_epi32(s[0], high), _mm256_srai_epi32::<6>(s[3]));
        }
        out
    }
}

/// TQ1_0's 32-byte chunks in a record: twelve of five digits, then the `qh` bytes' one of
/// four.
const TQ1_CHUNKS: usize = 13;

/// Where the four values of each row that digit `n` of chunk `ch` holds start in the
/// block: the first 32 bytes' digits are 32-value runs, the next 16 bytes' 16-value runs
/// from 160, the `qh` bytes' 4-value runs from 240 ([`crate::kernels::quant::tq1_0_code`]).
const fn tq1_at(ch: usize, n: usize) -> usize {
    if ch < 8 {
        32 * n + 4 * ch
    } else if ch < 12 {
        160 + 16 * n + 4 * (ch - 8)
    } else {
        240 + 4 * n
    }
}

/// The five base-3 digits of a chunk's 32 TQ1_0 bytes, each a code 0, 1 or 2 a byte:
/// digit `n` is `⌊3·(q·3ⁿ mod 256) / 256⌋`, so 1 from 86 and 2 from 171. The bytes are
/// kept offset by 128 for the signed compare, which tripling carries along (`3·128 ≡ 128`).
///
/// # Safety
/// AVX2 must be available.
#[inline(always)]
unsafe fn tq1_chunk_digits(q: __m256i) -> [__m256i; 5] {
    unsafe {
        // Above 85 and above 170, offset as the bytes are.
        let (one, two) = (_mm256_set1_epi8((85u8 ^ 0x80) as i8), _mm256_set1_epi8((170u8 ^ 0x80) as i8));
        let mut t = _mm256_xor_si256(q, _mm256_set1_epi8(-128));
        let mut out = [_mm256_setzero_si256(); 5];
        for (n, out) in out.iter_mut().enumerate() {
            if n > 0 {
                t = _mm256_add_epi8(t, _mm256_add_epi8(t, t));
            }
            // Each compare is −1 where it holds: the code is minus their sum.
            *out = _mm256_abs_epi8(_mm256_add_epi8(_mm256_cmpgt_epi8(t, one), _mm256_cmpgt_epi8(t, two)));
        }
        out
    }
}

/// Runs `$body` for each of a TQ1_0 record's 64 code vectors (`$c`: four codes of each
/// of the eight rows, digit `$n` of chunk `$ch`), unpacked from the record's values at
/// `$codes`, with where in the block its values start (`$at`). The digits are written
/// out, not looped over, so that `$n` is a constant: indexed by a loop counter, the
/// digits and the sums they feed went through memory.
macro_rules! tq1_codes {
    ($codes:expr, |$at:ident, $ch:ident, $n:ident, $c:ident| $body:block) => {
        for $ch in 0..TQ1_CHUNKS {
            let digits = tq1_chunk_digits(_mm256_loadu_si256($codes.add(32 * $ch).cast()));
            tq1_codes!(@digit digits, 0, |$at, $ch, $n, $c| $body);
            tq1_codes!(@digit digits, 1, |$at, $ch, $n, $c| $body);
            tq1_codes!(@digit digits, 2, |$at, $ch, $n, $c| $body);
            tq1_codes!(@digit digits, 3, |$at, $ch, $n, $c| $body);
            // The `qh` bytes hold four digits.
            if $ch < TQ1_CHUNKS - 1 {
                tq1_codes!(@digit digits, 4, |$at, $ch, $n, $c| $body);
            }
        }
    };
    (@digit $digits:ident, $k:literal, |$at:ident, $ch:ident, $n:ident, $c:ident| $body:block) => {{
        let $n: usize = $k;
        let ($at, $c) = (tq1_at($ch, $n), $digits[$n]);
        $body
    }};
}

/// One group's TQ1_0 record's codes (at `codes`) as a TQ2_0 record holds them, for
/// [`decode`]: each 4-value run a digit vector holds is one 2-bit field of a TQ2_0 chunk,
/// for all eight rows at once ([`tq1_at`]: values `128h + 32l + 4c + i` are field `l` of
/// chunk `8h + c`), so a chunk is four digit vectors shifted and or-ed, no lane moved.
///
/// # Safety
/// AVX2 must be available; `codes` holds a record's values and `out` [`DECODED_TQ1`] bytes.
#[inline(always)]
pub(super) unsafe fn decode_tq1(codes: *const u8, out: *mut u8) {
    unsafe {
        let mut chunks = [_mm256_setzero_si256(); 16];
        tq1_codes!(codes, |at, _ch, _n, c| {
            let (chunk, field) = (8 * (at / 128) + at % 32 / 4, at % 128 / 32);
            let shifted = match field {
                0 => c,
                1 => _mm256_slli_epi16::<2>(c),
                2 => _mm256_slli_epi16::<4>(c),
                _ => _mm256_slli_epi16::<6>(c),
            };
            chunks[chunk] = _mm256_or_si256(chunks[chunk], shifted);
        });
        for (i, c) in chunks.iter().enumerate() {
            _mm256_storeu_si256(out.add(32 * i).cast(), *c);
        }
    }
}

/// TQ1_0 read from its records, for tiles of up to four rows: [`tq2`]'s sums from base-3
/// digits, five a byte, decoded in registers ([`tq1_chunk_digits`], seven vector
/// operations per 32 codes; one row reads them with `maddubs`, [`tq1_row`]; larger steps
/// decode them once per chunk, [`decode_tq1`], and run [`tq2`]). The same codes give the
/// same integers, so TQ1_0 computes exactly what the same weights give as TQ2_0. AVX2's
/// i16 sums hold a block as TQ2_0's do; VNNI's four chains a row (digit `n`'s in chain
/// `n mod 4`) start from `−Σx`.
///
/// # Safety
/// As [`tq2`]'s.
#[inline(always)]
pub(super) unsafe fn tq1<const V: bool, const R: usize>(
    src: Src,
    xq: &QActs,
    first: usize,
    blocks: usize,
    out: &mut [[f32; GROUP]; TILE],
) {
    unsafe {
        let (rec_bytes, head) = record(GgmlType::Tq1_0);
        let sums = xq.block_sums();
        let mut acc = [_mm256_setzero_ps(); R];
        for b in 0..blocks {
            let rec = src.rec.add(b * rec_bytes);
            let codes = rec.add(head);
            let at = |t: usize| (first + t) * blocks + b;
            let x = |t: usize, from: usize| bcast(xq.q.as_ptr().add(at(t) * 256 + from));
            let mut s = [_mm256_setzero_si256(); R];
            if R == 1 {
                s[0] = tq1_row::<V>(codes, xq, at(0), *sums.get_unchecked(at(0)));
            } else if V {
                let mut chains = [[_mm256_setzero_si256(); 4]; R];
                for (t, c) in chains.iter_mut().enumerate() {
                    c[0] = _mm256_set1_epi32(-sums.get_unchecked(at(t)));
                }
                tq1_codes!(codes, |from, _ch, n, c| {
                    for (t, chains) in chains.iter_mut().enumerate() {
                        chains[n % 4] = dot4(chains[n % 4], c, x(t, from));
                    }
                });
                for (s, c) in s.iter_mut().zip(&chains) {
                    *s = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
                }
            } else {
                tq1_codes!(codes, |from, _ch, _n, c| {
                    for (t, s) in s.iter_mut().enumerate() {
                        *s = _mm256_add_epi16(*s, _mm256_maddubs_epi16(c, x(t, from)));
                    }
                });
            }
            weigh::<R>(rec, &scaled::<V, R>(s, xq, at), &mut acc);
        }
        store(&acc, out);
    }
}

/// One TQ1_0 block's sums for one activation row (its block at index `at` of `xq`, the
/// block's activation sum `sum`), as [`tq1`] returns them: with `V`, `Σ t·x`; else the
/// i16 sums of `Σ u·x` (at most 64 · 2 · 2 · 127). `maddubs` by 3 of a byte in the low
/// half of an i16 lane is the next digit in its high byte and what to triple for the one
/// after in its low byte (`3t = 256·digit + (3t mod 256)`), for the even bytes and, in a
/// second register, the odd ones. The digits are multiplied where they are, against
/// activations placed in the high bytes ([`QActs::split_pairs`]): four vector operations
/// a digit vector, not seven. VNNI keeps eight chains, the first from `−Σx`.
///
/// # Safety
/// As [`tq1`]'s, for one row; `codes` holds a record's values.
#[inline(always)]
unsafe fn tq1_row<const V: bool>(codes: *const u8, xq: &QActs, at: usize, sum: i32) -> __m256i {
    unsafe {
        let split = xq.split_pairs().as_ptr().add(2 * at * 256);
        let xs = |from: usize, odd: usize| bcast(split.add(2 * from + 4 * odd));
        let (w30, w03) = (_mm256_set1_epi16(3), _mm256_set1_epi16(3 << 8));
        let mut chains = [_mm256_setzero_si256(); 8];
        if V {
            chains[0] = _mm256_set1_epi32(-sum);
        }
        macro_rules! digit {
            ($ch:expr, $n:literal, $e:ident, $o:ident) => {
                let from = tq1_at($ch, $n);
                let (xe, xo) = (xs(from, 0), xs(from, 1));
                if V {
                    chains[$n % 4] = dot4(chains[$n % 4], $e, xe);
                    chains[4 + $n % 4] = dot4(chains[4 + $n % 4], $o, xo);
                } else {
                    let two = _mm256_add_epi16(_mm256_maddubs_epi16($e, xe), _mm256_maddubs_epi16($o, xo));
                    chains[$n % 4] = _mm256_add_epi16(chains[$n % 4], two);
                }
            };
        }
        for ch in 0..TQ1_CHUNKS {
            let q = _mm256_loadu_si256(codes.add(32 * ch).cast());
            let (mut e, mut o) = (_mm256_maddubs_epi16(q, w30), _mm256_maddubs_epi16(q, w03));
            digit!(ch, 0, e, o);
            (e, o) = (_mm256_maddubs_epi16(e, w30), _mm256_maddubs_epi16(o, w30));
            digit!(ch, 1, e, o);
            (e, o) = (_mm256_maddubs_epi16(e, w30), _mm256_maddubs_epi16(o, w30));
            digit!(ch, 2, e, o);
            (e, o) = (_mm256_maddubs_epi16(e, w30), _mm256_maddubs_epi16(o, w30));
            digit!(ch, 3, e, o);
            // The `qh` bytes hold four digits.
            if ch < TQ1_CHUNKS - 1 {
                (e, o) = (_mm256_maddubs_epi16(e, w30), _mm256_maddubs_epi16(o, w30));
                digit!(ch, 4, e, o);
            }
        }
        let c = &chains;
        if V {
            let a = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
            let b = _mm256_add_epi32(_mm256_add_epi32(c[4], c[5]), _mm256_add_epi32(c[6], c[7]));
            _mm256_add_epi32(a, b)
        } else {
            _mm256_add_epi16(_mm256_add_epi16(c[0], c[1]), _mm256_add_epi16(c[2], c[3]))
        }
    }
}
