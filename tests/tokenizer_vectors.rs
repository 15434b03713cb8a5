//! Tokenizers built from GGUF metadata alone against llama.cpp's tokenizer test vectors
//! (`../shared/models/vocab/`): every text of every vocabulary gives exactly its ids.

mod common;

use common::shared_models;
use weft::model::gguf::GgufFile;
use weft::tokenizer::Tokenizer;

/// (test vectors, the GGUF that carries the vocabulary), relative to the shared models.
const VOCABS: &[(&str, &str)] = &[
    ("vocab/ggml-vocab-llama-bpe.gguf", "vocab/ggml-vocab-llama-bpe.gguf"),
    ("vocab/ggml-vocab-llama-bpe.gguf", "tiny-llama3/tiny-llama3.gguf"),
    ("vocab/ggml-vocab-qwen2.gguf", "tiny-qwen2/tiny-qwen2.gguf"),
    ("vocab/ggml-vocab-qwen2.gguf", "tiny-qwen3/tiny-qwen3.gguf"),
    ("vocab/ggml-vocab-phi-3.gguf", "tiny-phi3/tiny-phi3.gguf"),
    ("vocab/ggml-vocab-llama-spm.gguf", "tiny-mistral-swa/tiny-mistral-swa.gguf"),
    ("vocab/ggml-vocab-gpt-2.gguf", "tiny-gemma2/tiny-gemma2.gguf"),
    ("vocab/ggml-vocab-gemma-4.gguf", "vocab/ggml-vocab-gemma-4.gguf"),
    ("vocab/ggml-vocab-qwen35.gguf", "vocab/ggml-vocab-qwen35.gguf"),
];

#[test]
fn gguf_tokenizers_pass_llama_cpp_test_vectors() {
    let Some(dir) = shared_models() else { return };
    let mut checked = 0;
    for (vectors, carrier) in VOCABS {
        let inp = std::fs::read_to_string(dir.join(format!("{vectors}.inp"))).unwrap();
        let out = std::fs::read_to_string(dir.join(format!("{vectors}.out"))).unwrap();
        let texts: Vec<&str> = inp.split("\n__ggml_vocab_test__\n").collect();
        let expected: Vec<Vec<u32>> =
            out.lines().map(|l| l.split_whitespace().map(|t| t.parse().unwrap()).collect()).collect();
        assert!(texts.len() >= expected.len() && !expected.is_empty(), "{vectors}: malformed test vectors");
        let g = GgufFile::open(&dir.join(carrier)).unwrap();
        // Metadata only: a tokenizer.json beside the file must not stand in for it.
        let tok = Tokenizer::from_gguf_metadata(&g, vec![], None, None).unwrap();
        let mut failures = Vec::new();
        for (text, want) in texts.iter().zip(&expected) {
            let got = tok.encode_with(text, false).unwrap();
            if &got != want {
                failures.push(format!("{text:?}: got {got:?}, want {want:?}"));
            }
            checked += 1;
        }
        assert!(failures.is_empty(), "{carrier} ({vectors}):\n{}", failures.join("\n"));
    }
    assert!(checked > 0);
}

/// llama.cpp's vocab-only Llama 3 file has no `add_bos_token` key; as in llama.cpp, BOS is
/// added anyway (Llama 3 was trained with it).
#[test]
fn llama3_vocabulary_adds_bos_without_the_key() {
    let Some(dir) = shared_models() else { return };
    let g = GgufFile::open(&dir.join("vocab/ggml-vocab-llama-bpe.gguf")).unwrap();
    assert!(g.get("tokenizer.ggml.add_bos_token").is_none(), "fixture changed: it now has the key");
    let tok = Tokenizer::from_gguf_metadata(&g, vec![], Some(128000), None).unwrap();
    assert_eq!(tok.encode("Hello").unwrap()[0], 128000);
    assert!(tok.adds_bos);
}
