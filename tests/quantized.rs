//! The quantized path (`--dtype auto`: block-format weights, int8 activations) against the
//! exact f32 path on the same file: per-step KL divergence and top-1 agreement over the
//! reference cases, teacher-forced; and batching still changes nothing.

mod common;

use common::{assert_batch_invariant, kl_and_agreement, model_as, reference, shared_models};
use weft::kernels::quant::GgmlType;
use weft::kv::KvCacheDtype;
use weft::model::WeightDtype;

/// (mean KL(f32 ‖ quantized), top-1 agreement) over every step of every case.
fn compare(path: &str, refs: &str) -> (f64, f64) {
    compare_as(path, refs, WeightDtype::Auto)
}

/// As [`compare`], the second model loaded as `dtype`.
fn compare_as(path: &str, refs: &str, dtype: WeightDtype) -> (f64, f64) {
    kl_and_agreement(&model_as(path, WeightDtype::F32), &model_as(path, dtype), refs)
}

#[test]
fn quantized_path_stays_close_to_f32_for_every_format() {
    if shared_models().is_none() {
        return;
    }
    // The weights are the same on both paths, so this measures the int8 activations alone.
    // (Random weights: many steps are near-ties, hence the lower bar than SmolLM2's.)
    for t in ["Q8_0", "Q4_0", "Q4_1", "Q4_K_M", "Q5_K_M", "Q6_K"] {
        let path = format!("tiny-llama3-q/tiny-llama3-q.{t}.gguf");
        let (kl, agree) = compare(&path, &format!("tiny-llama3-q/reference.{t}.json"));
        eprintln!("tiny-llama3-q {t}: mean KLD {kl:.5}, top-1 agreement {:.1}%", agree * 100.0);
        assert!(agree >= 0.9 && kl < 0.02, "{t}: KLD {kl}, agreement {agree}");
    }
    let smol = "smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf";
    let (kl, agree) = compare(smol, "smollm2-135m-instruct");
    eprintln!("SmolLM2 Q4_1: mean KLD {kl:.5}, top-1 agreement {:.1}%", agree * 100.0);
    assert!(agree >= 0.95 && kl < 0.01, "SmolLM2: KLD {kl}, agreement {agree}");
}

/// `--quantize T` on a Hugging Face directory of f32 weights (a trained model): the matrices
/// are quantized at load (Q4_K falls back to Q5_0, its rows being 64 values; IQ4_NL runs on
/// the interleaved kernels that IQ4_XS shares), and the result stays close to the f32 path.
#[test]
fn quantizing_at_load_stays_close_to_the_float_weights() {
    if shared_models().is_none() {
        return;
    }
    let stored = model_as("stories260k", WeightDtype::Auto).model.weight_bytes();
    for (t, min_agree, max_kl) in [
        (GgmlType::Q8_0, 0.97, 0.002),
        (GgmlType::Q4_0, 0.8, 0.1),
        (GgmlType::Q4K, 0.9, 0.03),
        (GgmlType::Iq4Nl, 0.8, 0.1),
    ] {
        let (kl, agree) = compare_as("stories260k", "stories260k", WeightDtype::Quantize(t));
        let bytes = model_as("stories260k", WeightDtype::Quantize(t)).model.weight_bytes();
        eprintln!(
            "stories260k --quantize {t:?}: {bytes} bytes (as stored: {stored}), mean KLD {kl:.5}, top-1 {:.1}%",
            agree * 100.0
        );
        assert!(bytes < stored, "{t:?}: {bytes} bytes, as stored {stored}");
        assert!(agree >= min_agree && kl < max_kl, "{t:?}: KLD {kl}, agreement {agree}");
    }
}

/// On the quantized path too (with its f16 KV cache), the reference prompts give the same
/// greedy ids alone and in one ragged batch.
#[test]
fn quantized_batching_changes_nothing() {
    if shared_models().is_none() {
        return;
    }
    let path = "smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf";
    assert_batch_invariant(model_as(path, WeightDtype::Auto), "smollm2-135m-instruct");
}

/// `weft bench`'s ceiling counts every matrix product once, under the format it is stored in.
#[test]
fn products_by_format_cover_every_matrix_once() {
    if shared_models().is_none() {
        return;
    }
    let path = "tiny-llama3-q/tiny-llama3-q.Q4_K_M.gguf";
    let quant = model_as(path, WeightDtype::Auto);
    let by = quant.model.products_by_format();
    let total: usize = by.iter().map(|(_, n)| n).sum();
    assert_eq!(total, quant.model.config.matmul_params(), "{by:?}");
    let formats: Vec<_> = by.iter().map(|(t, _)| *t).collect();
    assert!(formats.contains(&Some(GgmlType::Q4K)) && formats.contains(&Some(GgmlType::Q6K)), "{formats:?}");
    assert_eq!(model_as(path, WeightDtype::F32).model.products_by_format(), vec![(None, total)]);
}

/// `weft perplexity`'s evaluation: a model against itself is a perfect match; the quantized
/// path against f32 is close, with a finite perplexity, and so are f16 and 8-bit KV caches.
#[test]
fn perplexity_and_kl_against_a_base_model() {
    if shared_models().is_none() {
        return;
    }
    use weft::cli::perplexity::evaluate;
    let path = "stories260k/stories260k.gguf";
    let m = model_as(path, WeightDtype::F32);
    let text: String = reference("stories260k").iter().map(|c| c.prompt.clone() + " ").collect::<String>().repeat(3);
    let tokens = m.tokenizer.encode(&text).unwrap();
    let same = evaluate(&m, Some(&m), &tokens, 32, KvCacheDtype::Auto).unwrap();
    assert!(same.scored > 0 && same.perplexity.is_finite() && same.perplexity > 1.0, "{same:?}");
    assert_eq!((same.base_perplexity, same.top1_agreement), (Some(same.perplexity), Some(1.0)));
    assert!(same.mean_kld.unwrap().abs() < 1e-12, "{same:?}");

    let q = "tiny-llama3-q/tiny-llama3-q.Q8_0.gguf";
    let (exact, quant) = (model_as(q, WeightDtype::F32), model_as(q, WeightDtype::Auto));
    let r = evaluate(&quant, Some(&exact), &tokens, 32, KvCacheDtype::Auto).unwrap();
    assert!(r.mean_kld.unwrap() < 0.02 && r.top1_agreement.unwrap() > 0.9, "{r:?}");
    assert!((r.perplexity / r.base_perplexity.unwrap() - 1.0).abs() < 0.05, "{r:?}");

    // An f16 KV cache under exact weights: close to the f32 cache (the default's
    // approximation on quantized models).
    let r = evaluate(&exact, Some(&exact), &tokens, 32, KvCacheDtype::F16).unwrap();
    assert!(r.mean_kld.unwrap() < 1e-3 && r.top1_agreement.unwrap() > 0.97, "{r:?}");
    assert!(r.mean_kld.unwrap() > 0.0, "the cache was f16: {r:?}");

    // FP8 E4M3 rounds to 3 mantissa bits: further (KLD 0.054, agreement 85 % here).
    let r8 = evaluate(&exact, Some(&exact), &tokens, 32, KvCacheDtype::Fp8).unwrap();
    assert!(r8.mean_kld.unwrap() < 0.1 && r8.top1_agreement.unwrap() > 0.8, "{r8:?}");
    assert!(r8.mean_kld.unwrap() > r.mean_kld.unwrap(), "the cache was fp8: {r8:?}");
    // int8 rows with their own scales: between the two.
    let ri = evaluate(&exact, Some(&exact), &tokens, 32, KvCacheDtype::Int8).unwrap();
    eprintln!("f16 {r:?}\nfp8 {r8:?}\nint8 {ri:?}");
    assert!(ri.mean_kld.unwrap() < r8.mean_kld.unwrap() && ri.mean_kld.unwrap() > r.mean_kld.unwrap(), "{ri:?}");
}
