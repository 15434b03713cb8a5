//! The machine's limits beside the batched table: weights read per token against a
//! streaming read, matrix throughput against the arithmetic peak, and the decode ceiling
//! that the kernels' innermost steps alone allow.

use super::measure::percentile;
use anyhow::Result;
use serde_json::{json, Value};

/// Decode next to this machine's limits, measured now: weight bytes read per token and the
/// bandwidth that makes at B=1 against a streaming read; matrix GFLOP/s at the largest
/// batch against the peak of the arithmetic the matrices use (int8 multiply-adds for block
/// formats, f32 FMA otherwise).
pub(super) fn print_limits(model: &crate::loaded::LoadedModel, rows: &[Value], threads: usize) -> Result<Value> {
    let pool = crate::engine::thread_pool(threads)?;
    let (read_gbs, fma_peak, int8_peak) = pool.install(|| {
        (crate::cli::machine::read_bandwidth(), crate::cli::machine::fma_peak(), crate::cli::machine::int8_peak())
    });
    let bytes = model.model.weight_bytes() as f64;
    let flops_per_token = 2.0 * model.model.config.matmul_params() as f64;
    let tok_s = |b: u64| rows.iter().find(|r| r["batch"] == b).and_then(|r| r["tg_tok_s"].as_f64());
    let mut out = json!({
        "weight_bytes_per_token": bytes,
        "read_gb_s": read_gbs,
        "fma_peak_gflop_s": fma_peak,
        "int8_peak_gop_s": int8_peak.map(|(p, _)| p),
    });
    println!("  weights read per decoded token at B=1: {:.1} MB", bytes / 1e6);
    if let Some(t) = tok_s(1) {
        let gbs = bytes * t / 1e9;
        // Against the read taken right after the median run, in the same phase as its decode.
        let b1 = rows.iter().find(|r| r["batch"] == 1);
        let read_gbs = b1.and_then(|r| r["read_gb_s"].as_f64()).unwrap_or(read_gbs);
        println!(
            "  B=1: {gbs:.1} GB/s of weights, {:.0}% of a streaming read right after the run ({read_gbs:.1} GB/s)",
            100.0 * gbs / read_gbs
        );
        out["b1_gb_s"] = json!(gbs);
        out["b1_read_gb_s"] = json!(read_gbs);
    }
    if let Some(r) = rows.iter().max_by_key(|r| r["batch"].as_u64()) {
        let (b, t) = (r["batch"].as_u64().unwrap_or(0), r["tg_tok_s"].as_f64().unwrap_or(0.0));
        let gflops = flops_per_token * t / 1e9;
        let (peak, what) = match int8_peak {
            Some((p, step)) if model.model.quantized() => (p, format!("int8 multiply-add peak ({step})")),
            _ => (fma_peak, "f32 FMA peak".to_string()),
        };
        println!(
            "  B={b}: {gflops:.1} GFLOP/s-equivalent in matrix multiplies, {:.0}% of the {what} ({peak:.0})",
            100.0 * gflops / peak
        );
        out["max_batch_gflop_s"] = json!(gflops);
        let ceiling =
            if model.model.quantized() { pool.install(|| step_ceiling(model, fma_peak, int8_peak)) } else { None };
        if let Some(ceiling) = ceiling {
            let parts: Vec<String> = ceiling
                .formats
                .iter()
                .map(|(name, share, rate)| format!("{name} {:.0}% of products at {rate:.1} G/s", 100.0 * share))
                .collect();
            println!(
                "  B={b}: {t:.1} tok/s is {:.0}% of what the kernels' innermost steps alone allow on this machine ({:.1} tok/s: {})",
                100.0 * t / ceiling.tok_s,
                ceiling.tok_s,
                parts.join(", ")
            );
            // The peer's median over the pairs, against the same ceiling.
            let peer = r
                .get("llama_cpp_pairs")
                .and_then(Value::as_array)
                .cloned()
                .or_else(|| r.get("llama_cpp").map(|p| vec![p.clone()]));
            if let Some(peer) = peer {
                let theirs =
                    percentile(&mut peer.iter().filter_map(|p| p["tg_tok_s"].as_f64()).collect::<Vec<_>>(), 0.5);
                println!("  B={b}: llama.cpp's {theirs:.1} tok/s is {:.0}% of it", 100.0 * theirs / ceiling.tok_s);
            }
            out["step_ceiling_tok_s"] = json!(ceiling.tok_s);
        }
    }
    Ok(out)
}

/// The matrices' decode ceiling at any batch: each format's products at the rate of its
/// kernels' innermost step ([`crate::cli::machine::avx2_step_rate`]; with VNNI every format's is
/// one 512-bit `vpdpbusd`, the int8 peak; float matrices at the FMA peak), nothing else counted.
struct StepCeiling {
    tok_s: f64,
    /// Format, share of the products, G products/s.
    formats: Vec<(String, f64, f64)>,
}

fn step_ceiling(
    model: &crate::loaded::LoadedModel,
    fma_peak: f64,
    int8_peak: Option<(f64, &str)>,
) -> Option<StepCeiling> {
    let by = model.model.products_by_format();
    let total: usize = by.iter().map(|(_, n)| n).sum();
    let vnni = crate::kernels::qmatmul::vnni();
    let mut seconds = 0.0;
    let mut formats = Vec::new();
    // Each distinct step measured once, so that formats sharing one share its rate.
    let mut steps: Vec<(crate::kernels::qmatmul::Avx2Step, f64)> = Vec::new();
    for (t, n) in by {
        // Operations count a multiply-add as two; rates here are products.
        let rate = match t {
            None => fma_peak / 2.0,
            Some(_) if vnni => int8_peak?.0 / 2.0,
            Some(t) => {
                let step = crate::kernels::qmatmul::avx2_step(t);
                match steps.iter().find(|(s, _)| *s == step) {
                    Some(&(_, rate)) => rate,
                    None => {
                        let rate = crate::cli::machine::avx2_step_rate(step)?;
                        steps.push((step, rate));
                        rate
                    }
                }
            }
        };
        // A format that takes 16-bit activations multiplies each weight by two int8 rows.
        let passes = if t.is_some_and(crate::kernels::qmatmul::takes_wide) { 2.0 } else { 1.0 };
        seconds += passes * n as f64 / (rate * 1e9);
        let name = t.map_or("float".to_string(), |t| format!("{t:?}"));
        formats.push((name, n as f64 / total as f64, rate));
    }
    (seconds > 0.0).then(|| StepCeiling { tok_s: 1.0 / seconds, formats })
}
