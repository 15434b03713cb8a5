//! RMSNorm and the SwiGLU activation, row by row.

/// `out[r] = x[r] / sqrt(mean(x[r]²) + eps) * weight` for each row of width `weight.len()`.
pub fn rmsnorm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ss: f32 = xr.iter().map(|v| v * v).sum();
        let scale = 1.0 / (ss / d as f32 + eps).sqrt();
        for ((o, v), g) in or.iter_mut().zip(xr).zip(weight) {
            *o = v * scale * g;
        }
    }
}

/// SwiGLU: each row of `gate_up` is `[gate (f) | up (f)]`; `out` row = silu(gate) · up.
pub fn silu_mul(gate_up: &[f32], f: usize, out: &mut [f32]) {
    for (gu, or) in gate_up.chunks_exact(2 * f).zip(out.chunks_exact_mut(f)) {
        let (g, u) = gu.split_at(f);
        for ((o, g), u) in or.iter_mut().zip(g).zip(u) {
            *o = g / (1.0 + (-g).exp()) * u;
        }
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

    #[test]
    fn silu_mul_matches_naive() {
        let (rows, f) = (2, 7);
        let gu = random_vec(rows * 2 * f, 3);
        let mut out = vec![0f32; rows * f];
        silu_mul(&gu, f, &mut out);
        let want: Vec<f32> = (0..rows * f)
            .map(|i| {
                let (r, c) = (i / f, i % f);
                let g = gu[r * 2 * f + c] as f64;
                let u = gu[r * 2 * f + f + c] as f64;
                (g / (1.0 + (-g).exp()) * u) as f32
            })
            .collect();
        assert_close(&out, &want, 1e-6, "silu_mul");
    }
}
