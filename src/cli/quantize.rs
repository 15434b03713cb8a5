//! `weft quantize IN OUT --type T`: a GGUF file's matrices rewritten in another type, or a
//! Hugging Face directory converted to a GGUF file with its matrices in that type.

use crate::model::convert::hf_to_gguf;
use crate::model::file_type::{parse_file_type_name, FileType};
use crate::model::requantize::requantize;
use crate::tokenizer::gguf_metadata;
use anyhow::Result;
use clap::Args;
use std::path::PathBuf;

#[derive(Args)]
pub struct QuantizeArgs {
    /// The GGUF file or Hugging Face directory (config.json, *.safetensors, tokenizer) to read.
    pub input: PathBuf,
    /// The GGUF file to write.
    pub output: PathBuf,
    /// The file type, as llama-quantize names them: q4_k_m, q4_k_s, q5_k_m, q5_k_s, q6_k, q8_0,
    /// q4_0, q4_1, q5_0, q5_1, iq4_nl, iq4_xs, f16, bf16, f32, and for ternary (BitNet) models tq1_0
    /// and tq2_0 (weights that are not ternary are refused; the embedding stays f16). The output
    /// matrix gets Q6_K (unless the type is q8_0 or wider), and the _m mixes Q6_K on some
    /// layers' attn_v and ffn_down.
    #[arg(long = "type", value_parser = parse_file_type_name)]
    pub file_type: FileType,
    /// Every matrix in the type's base format, with no mix (llama-quantize's --pure).
    #[arg(long)]
    pub pure: bool,
}

pub fn run(args: QuantizeArgs) -> Result<()> {
    let t0 = std::time::Instant::now();
    let ft = if args.pure { args.file_type.pure() } else { args.file_type };
    let (done, what) = if args.input.is_dir() {
        (hf_to_gguf(&args.input, &args.output, ft, |vocab| gguf_metadata(&args.input, vocab))?, "converted")
    } else {
        (requantize(&args.input, &args.output, ft)?, "requantized")
    };
    let (changed, bytes) = done;
    eprintln!(
        "weft: wrote {} ({changed} matrices {what}, {ft}, {} MB) in {:.1} s",
        args.output.display(),
        bytes / 1_000_000,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
