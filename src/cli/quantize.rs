//! `weft quantize IN OUT --type T`: a GGUF file's matrices rewritten in another block format.

use crate::kernels::quant::GgmlType;
use crate::kernels::quantize::parse_target;
use crate::model::requantize::requantize;
use anyhow::{bail, Result};
use clap::Args;
use std::path::PathBuf;

#[derive(Args)]
pub struct QuantizeArgs {
    /// The GGUF file to read.
    pub input: PathBuf,
    /// The GGUF file to write.
    pub output: PathBuf,
    /// The block format of the output's matrices: q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k.
    #[arg(long = "type", value_parser = parse_target)]
    pub dtype: GgmlType,
}

pub fn run(args: QuantizeArgs) -> Result<()> {
    if args.input.is_dir() {
        bail!(
            "{}: weft quantize reads GGUF files; a Hugging Face directory is quantized at load with --quantize {}",
            args.input.display(),
            args.dtype.to_string().to_lowercase()
        );
    }
    let t0 = std::time::Instant::now();
    let (changed, bytes) = requantize(&args.input, &args.output, args.dtype)?;
    eprintln!(
        "weft: wrote {} ({changed} matrices requantized for {}, {} MB) in {:.1} s",
        args.output.display(),
        args.dtype,
        bytes / 1_000_000,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
