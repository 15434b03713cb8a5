#!/usr/bin/env bash
# The soak (scripts/soak.py) on a tiny fixture of each family beyond SmolLM2's dense Llama:
# gated DeltaNet with its state cache, mixtures of experts, gpt-oss (sinks, MXFP4, harmony),
# Gemma 3/4 (sliding windows), Mistral's sliding window, BitNet's ternary weights and
# Phi-3's 512-token context. Each gets a KV cache small enough that sequences are preempted
# (the soak fails if none is) and n-gram drafts on, so preemption, prefix hits, n > 1 and
# speculation meet each family's own state; two runs keep their cache in 8 bits (int8 for
# Gemma 4, whose global layers have their own head size; FP8 for Mistral), in a quarter of
# their f32 cache's bytes. Seconds per model.
#
#     bash scripts/soak_families.sh [target/release/weft]
set -euo pipefail
cd "$(dirname "$0")/.."
weft=${1:-target/release/weft}
models=${WEFT_SHARED_MODELS:-../shared/models}
drafts='{"method":"ngram","num_speculative_tokens":4}'
# model, relative to the shared models; KV cache size; KV cache dtype (default: auto)
while read -r model kv dtype; do
    python3 scripts/soak.py --weft "$weft" --model "$models/$model" --kv-cache-memory "$kv" \
        --serve-arg=--speculative-config --serve-arg="$drafts" \
        --serve-arg=--kv-cache-dtype --serve-arg="${dtype:-auto}"
done <<'LIST'
tiny-qwen35/tiny-qwen35.gguf 4M
tiny-qwen35 4M
tiny-qwen3moe/tiny-qwen3moe.gguf 2M
tiny-mixtral/tiny-mixtral.gguf 5M
tiny-gpt-oss/tiny-gpt-oss.gguf 2M
tiny-gpt-oss 4M
tiny-gemma4/tiny-gemma4.gguf 14M
tiny-gemma4/tiny-gemma4.gguf 4M int8
tiny-gemma3/tiny-gemma3.gguf 4M
tiny-mistral-swa 1M
tiny-mistral-swa 256K fp8
tiny-bitnet/tiny-bitnet.TQ2_0.gguf 4M
tiny-bitnet/tiny-bitnet.TQ1_0.gguf 4M
tiny-phi3 512K
LIST
