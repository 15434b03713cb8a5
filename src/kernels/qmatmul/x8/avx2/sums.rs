//! The 16-bit sums of two groups' decoded values against four activation rows, written
//! in assembly so that the compiler cannot hoist the weight loads and spill them.

use super::*;

/// One chunk of [`sums_4x2`]: the two groups' 32 bytes at offset `$w`, the four rows'
/// activations at offset `$x`.
macro_rules! chunk_4x2 {
    ($w:literal, $x:literal) => {
        concat!(
            "vmovdqu {a}, ymmword ptr [{w0} + ",
            $w,
            "]\n",
            "vmovdqu {b}, ymmword ptr [{w1} + ",
            $w,
            "]\n",
            "vpbroadcastd {x}, dword ptr [{x0} + ",
            $x,
            "]\n",
            "vpmaddubsw {t}, {a}, {x}\n",
            "vpaddw {s00}, {s00}, {t}\n",
            "vpmaddubsw {t}, {b}, {x}\n",
            "vpaddw {s01}, {s01}, {t}\n",
            "vpbroadcastd {x}, dword ptr [{x0} + {row} + ",
            $x,
            "]\n",
            "vpmaddubsw {t}, {a}, {x}\n",
            "vpaddw {s10}, {s10}, {t}\n",
            "vpmaddubsw {t}, {b}, {x}\n",
            "vpaddw {s11}, {s11}, {t}\n",
            "vpbroadcastd {x}, dword ptr [{x0} + {row} * 2 + ",
            $x,
            "]\n",
            "vpmaddubsw {t}, {a}, {x}\n",
            "vpaddw {s20}, {s20}, {t}\n",
            "vpmaddubsw {t}, {b}, {x}\n",
            "vpaddw {s21}, {s21}, {t}\n",
            "vpbroadcastd {x}, dword ptr [{x0} + {row3} + ",
            $x,
            "]\n",
            "vpmaddubsw {t}, {a}, {x}\n",
            "vpaddw {s30}, {s30}, {t}\n",
            "vpmaddubsw {t}, {b}, {x}\n",
            "vpaddw {s31}, {s31}, {t}\n",
        )
    };
}

/// The 16-bit sums of `N` (4 or 8) chunks of two groups' decoded values (at `w0`,
/// `w1`, 32 bytes a chunk) against four activation rows (from `x`, `row` bytes apart,
/// 4 bytes a chunk), from `init` (per row): `[row][group]`. Each broadcast of
/// activations feeds both groups. Written out in assembly because LLVM hoists the
/// weight loads of a whole run ahead of the multiply-adds and spills them; unrolled, as
/// a run is only ever four or eight chunks, so that no loop counter or exit branch
/// sits between the multiply-adds. The sums are those of the intrinsic loop, since 16-bit adds
/// that wrap give the same result in any order.
///
/// # Safety
/// AVX2 must be available; `w0` and `w1` hold `N` chunks of 32 bytes and `x` four rows'
/// activations, `row` bytes apart.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn sums_4x2<const N: usize>(
    w0: *const u8,
    w1: *const u8,
    x: *const i8,
    row: usize,
    init: [__m256i; 4],
) -> [[__m256i; 2]; 4] {
    unsafe {
        const { assert!(N == 4 || N == 8, "runs of 4 or 8 chunks") };
        let [mut s00, mut s10, mut s20, mut s30] = init;
        let [mut s01, mut s11, mut s21, mut s31] = init;
        macro_rules! run {
        ($($w:literal $x:literal),*) => {
            std::arch::asm!(
                $(chunk_4x2!($w, $x),)*
                w0 = in(reg) w0,
                w1 = in(reg) w1,
                x0 = in(reg) x,
                row = in(reg) row,
                row3 = in(reg) row * 3,
                s00 = inout(ymm_reg) s00,
                s01 = inout(ymm_reg) s01,
                s10 = inout(ymm_reg) s10,
                s11 = inout(ymm_reg) s11,
                s20 = inout(ymm_reg) s20,
                s21 = inout(ymm_reg) s21,
                s30 = inout(ymm_reg) s30,
                s31 = inout(ymm_reg) s31,
                a = out(ymm_reg) _,
                b = out(ymm_reg) _,
                x = out(ymm_reg) _,
                t = out(ymm_reg) _,
                options(pure, readonly, nostack),
            )
        };
    }
        match N {
            4 => run!(0 0, 32 4, 64 8, 96 12),
            8 => run!(0 0, 32 4, 64 8, 96 12, 128 16, 160 20, 192 24, 224 28),
            _ => unreachable!(),
        }
        [[s00, s01], [s10, s11], [s20, s21], [s30, s31]]
    }
}
