//! RMSNorm and the gated MLP activations (SwiGLU, GeGLU), row by row.

use super::exp::exp;

/// `1 / sqrt(mean(x²) + eps)`.
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    1.0 / (ss / x.len() as f32 + eps).sqrt()
}

/// `out[r] = x[r] / sqrt(mean(x[r]²) + eps) * weight` for each row of width `weight.len()`.
pub fn rmsnorm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let scale = inv_rms(xr, eps);
        for ((o, v), g) in or.iter_mut().zip(xr).zip(weight) {
            *o = v * scale * g;
        }
    }
}

/// [`rmsnorm`] of each row of `x` into itself, with the same arithmetic.
pub fn rmsnorm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    for xr in x.chunks_exact_mut(weight.len()) {
        let scale = inv_rms(xr, eps);
        xr.iter_mut().zip(weight).for_each(|(v, g)| *v = *v * scale * g);
    }
}

/// SwiGLU: each row of `gate_up` is `[gate (f) | up (f)]`; `out` row = silu(gate) · up.
pub fn silu_mul(gate_up: &[f32], f: usize, out: &mut [f32]) {
    for (gu, or) in gate_up.chunks_exact(2 * f).zip(out.chunks_exact_mut(f)) {
        let (g, u) = gu.split_at(f);
        #[allow(unused_mut)]
        let mut done = 0;
        #[cfg(target_arch = "x86_64")]
        if super::matmul::avx2::available() {
            // SAFETY: the CPU supports AVX2 and FMA.
            done = unsafe { silu_mul_avx2(g, u, or) };
        }
        for ((o, g), u) in or[done..].iter_mut().zip(&g[done..]).zip(&u[done..]) {
            *o = g / (1.0 + exp(-g)) * u;
        }
    }
}

/// GeGLU with tanh-approximated GELU, as PyTorch's `gelu(approximate="tanh")`: each row of
/// `gate_up` is `[gate (f) | up (f)]`; `out` row = gelu(gate) · up.
pub fn gelu_tanh_mul(gate_up: &[f32], f: usize, out: &mut [f32]) {
    const BETA: f32 = (std::f64::consts::SQRT_2 * std::f64::consts::FRAC_2_SQRT_PI * 0.5) as f32;
    const KAPPA: f32 = 0.044715;
    for (gu, or) in gate_up.chunks_exact(2 * f).zip(out.chunks_exact_mut(f)) {
        let (g, u) = gu.split_at(f);
        for ((o, &x), u) in or.iter_mut().zip(g).zip(u) {
            let inner = BETA * (x + KAPPA * x * x * x);
            *o = 0.5 * x * (1.0 + inner.tanh()) * u;
        }
    }
}

/// `out = relu(gate)² · up` per row (BitNet b1.58's MLP), in transformers' order: the
/// square, then the product. Plain arithmetic that vectorizes as it stands.
pub fn relu2_mul(gate_up: &[f32], f: usize, out: &mut [f32]) {
    for (gu, or) in gate_up.chunks_exact(2 * f).zip(out.chunks_exact_mut(f)) {
        let (g, u) = gu.split_at(f);
        for ((o, &x), u) in or.iter_mut().zip(g).zip(u) {
            let r = if x > 0.0 { x } else { 0.0 };
            *o = r * r * u;
        }
    }
}

/// gpt-oss's clamped SwiGLU, with its published limit and alpha: `gate = min(gate, 7)`,
/// `up = clamp(up, −7, 7)`, `out = (up + 1) · gate · σ(1.702 · gate)`; rows as [`silu_mul`].
pub fn swiglu_oai_mul(gate_up: &[f32], f: usize, out: &mut [f32]) {
    const LIMIT: f32 = 7.0;
    const ALPHA: f32 = 1.702;
    for (gu, or) in gate_up.chunks_exact(2 * f).zip(out.chunks_exact_mut(f)) {
        let (g, u) = gu.split_at(f);
        for ((o, &g), &u) in or.iter_mut().zip(g).zip(u) {
            let (g, u) = (g.min(LIMIT), u.clamp(-LIMIT, LIMIT));
            *o = (u + 1.0) * (g / (1.0 + exp(-(g * ALPHA))));
        }
    }
}

/// The vector part of one row of [`silu_mul`], the same operations 8 lanes at a time;
/// returns how many elements it wrote.
///
/// # Safety
/// AVX2 and FMA must be available; `g` and `u` are at least as long as `out`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn silu_mul_avx2(g: &[f32], u: &[f32], out: &mut [f32]) -> usize {
    unsafe {
        use std::arch::x86_64::*;
        let n8 = out.len() / 8 * 8;
        for i in (0..n8).step_by(8) {
            let gv = _mm256_loadu_ps(g.as_ptr().add(i));
            let e = super::exp::avx2::exp(_mm256_xor_ps(gv, _mm256_set1_ps(-0.0)));
            let s = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0), e));
            _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_mul_ps(s, _mm256_loadu_ps(u.as_ptr().add(i))));
        }
        n8
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::{assert_close, random_vec};

    #[test]
    fn rmsnorm_matches_naive() {
        let (rows, d) = (3, 13);
        let x = random_vec(rows * d, 1);
        let w = random_vec(d, 2);
        let mut out = vec![0f32; rows * d];
        rmsnorm(&x, &w, 1e-5, &mut out);
        for r in 0..rows {
            let row = &x[r * d..(r + 1) * d];
            let ms: f64 = row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / d as f64;
            let want: Vec<f32> =
                row.iter().zip(&w).map(|(v, g)| (*v as f64 / (ms + 1e-5).sqrt() * *g as f64) as f32).collect();
            assert_close(&out[r * d..(r + 1) * d], &want, 1e-5, "rmsnorm");
        }
    }

    /// A gated activation `act(gate) · up` against its naive f64 form `f(gate, up)`.
    fn check_gated(act: fn(&[f32], usize, &mut [f32]), naive: fn(f64, f64) -> f64, tol: f32, what: &str) {
        let (rows, f) = (3, 21);
        let gu: Vec<f32> = random_vec(rows * 2 * f, 3).iter().map(|x| x * 4.0).collect();
        let mut out = vec![0f32; rows * f];
        act(&gu, f, &mut out);
        let want: Vec<f32> = (0..rows * f)
            .map(|i| {
                let (r, c) = (i / f, i % f);
                naive(gu[r * 2 * f + c] as f64, gu[r * 2 * f + f + c] as f64) as f32
            })
            .collect();
        assert_close(&out, &want, tol, what);
    }

    #[test]
    fn gelu_tanh_mul_matches_naive() {
        let gelu = |x: f64, u: f64| {
            0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh()) * u
        };
        check_gated(gelu_tanh_mul, gelu, 1e-5, "gelu_tanh_mul");
    }

    #[test]
    fn relu2_mul_matches_naive() {
        check_gated(relu2_mul, |g, u| g.max(0.0).powi(2) * u, 1e-5, "relu2_mul");
    }

    #[test]
    fn silu_mul_matches_naive() {
        check_gated(silu_mul, |g, u| g / (1.0 + (-g).exp()) * u, 1e-5, "silu_mul");
    }
}
