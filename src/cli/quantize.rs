//! `weft quantize IN OUT --type T`: a GGUF file's matrices rewritten in another type, or a
//! Hugging Face directory converted to a GGUF file with its matrices in that type.

use crate::kernels::quant::GgmlType;
use crate::kernels::quantize::parse_file_type;
use crate::model::convert::hf_to_gguf;
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
    /// The type of the output's matrices: q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k, f16, f32.
    #[arg(long = "type", value_parser = parse_file_type)]
    pub dtype: GgmlType,
}

pub fn run(args: QuantizeArgs) -> Result<()> {
    let t0 = std::time::Instant::now();
    let (changed, bytes) = if args.input.is_dir() {
        hf_to_gguf(&args.input, &args.output, args.dtype, |vocab| gguf_metadata(&args.input, vocab))?
    } else {
        requantize(&args.input, &args.output, args.dtype)?
    };
    eprintln!(
        "weft: wrote {} ({changed} matrices as {}, {} MB) in {:.1} s",
        args.output.display(),
        args.dtype,
        bytes / 1_000_000,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
