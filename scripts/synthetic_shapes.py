#!/usr/bin/env python3
"""The shared random-weight generator (../shared/tools/make_synthetic_gguf.py) with the dense
shapes it lacks, for speed and memory work at the sizes people serve:

  llama-3.1-8b: hidden 4096, 32 layers, 32 heads / 8 KV heads, FFN 14336, rope theta 5e5, untied

    python3 scripts/synthetic_shapes.py ../shared/models/vocab/ggml-vocab-llama-bpe.gguf \
        synth-llama8b.f16.gguf --shape llama-3.1-8b
    weft quantize --type q4_k_m synth-llama8b.f16.gguf synth-llama8b.Q4_K_M.gguf

Every other argument is the shared generator's.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "tools"))
import make_synthetic_gguf as gen  # noqa: E402

# hidden, layers, heads, kv_heads, ffn, rope_theta, tied: meta-llama/Llama-3.1-8B's config.json
gen.SHAPES["llama-3.1-8b"] = (4096, 32, 32, 8, 14336, 500000.0, False)

if __name__ == "__main__":
    gen.main()
