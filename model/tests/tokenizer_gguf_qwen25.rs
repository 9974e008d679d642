//! The real Qwen2.5 vocabulary (from a Qwen2.5-Coder GGUF, committed as a compact fixture) built
//! through `GgufTokenizerSpec`, checked against llama.cpp's tokenization of the same file and
//! against chat prompts rendered by Jinja2 from the file's own template. Runs without the model
//! file; `fixtures/tokenizer/make_qwen25_fixtures.py` regenerates the fixtures from it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde_json::Value;
use specula_model::gguf::GgufValue;
use specula_model::tokenizer::{ChatMessage, GgufTokenizerSpec, Tokenizer, TokenizerError};

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer")
}

fn read_json(name: &str) -> Value {
    let path = fixture_dir().join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn meta() -> &'static Value {
    static META: OnceLock<Value> = OnceLock::new();
    META.get_or_init(|| read_json("qwen25_meta.json"))
}

fn reference() -> &'static Value {
    static REFERENCE: OnceLock<Value> = OnceLock::new();
    REFERENCE.get_or_init(|| read_json("qwen25_reference.json"))
}

fn as_u32(value: &Value) -> u32 {
    value
        .as_u64()
        .and_then(|v| u32::try_from(v).ok())
        .expect("a token id")
}

fn ids_of(value: &Value) -> Vec<u32> {
    value
        .as_array()
        .expect("an id list")
        .iter()
        .map(as_u32)
        .collect()
}

/// Rebuilds the GGUF metadata map from the compact fixture (format described in
/// make_qwen25_fixtures.py), typed as a GGUF file types it.
fn qwen25_metadata() -> BTreeMap<String, GgufValue> {
    let meta = meta();
    let vocab_path = fixture_dir().join("qwen25_vocab.txt");
    let vocab = std::fs::read_to_string(&vocab_path)
        .unwrap_or_else(|e| panic!("{}: {e}", vocab_path.display()));

    let first_merged = meta["first_merged_token_id"].as_u64().unwrap() as usize;
    let mut tokens = Vec::new();
    let mut merges = Vec::new();
    for (id, line) in vocab.lines().enumerate() {
        let token = match line.split_once('\t') {
            Some((token, left_chars)) => {
                assert_eq!(
                    id,
                    first_merged + merges.len(),
                    "merged tokens must be contiguous"
                );
                let left_chars: usize = left_chars.parse().expect("a split position");
                let at = token
                    .char_indices()
                    .nth(left_chars)
                    .expect("split inside the token")
                    .0;
                merges.push(GgufValue::String(format!(
                    "{} {}",
                    &token[..at],
                    &token[at..]
                )));
                token
            }
            None => line,
        };
        tokens.push(GgufValue::String(token.to_string()));
    }
    assert_eq!(tokens.len() as u64, meta["token_count"].as_u64().unwrap());
    assert_eq!(merges.len() as u64, meta["merge_count"].as_u64().unwrap());

    let mut token_types = vec![meta["default_token_type"].as_i64().unwrap() as i32; tokens.len()];
    for (token_type, ids) in meta["token_types"].as_object().unwrap() {
        for id in ids.as_array().unwrap() {
            token_types[id.as_u64().unwrap() as usize] = token_type.parse().unwrap();
        }
    }

    let string = |key: &str| GgufValue::String(meta[key].as_str().unwrap().to_string());
    let mut md = BTreeMap::new();
    md.insert("tokenizer.ggml.model".to_string(), string("model"));
    md.insert("tokenizer.ggml.pre".to_string(), string("pre"));
    md.insert(
        "tokenizer.ggml.tokens".to_string(),
        GgufValue::Array(tokens),
    );
    md.insert(
        "tokenizer.ggml.token_type".to_string(),
        GgufValue::Array(token_types.into_iter().map(GgufValue::I32).collect()),
    );
    md.insert(
        "tokenizer.ggml.merges".to_string(),
        GgufValue::Array(merges),
    );
    for key in ["bos_token_id", "eos_token_id", "padding_token_id"] {
        md.insert(
            format!("tokenizer.ggml.{key}"),
            GgufValue::U32(as_u32(&meta[key])),
        );
    }
    md.insert(
        "tokenizer.ggml.add_bos_token".to_string(),
        GgufValue::Bool(meta["add_bos_token"].as_bool().unwrap()),
    );
    md.insert(
        "tokenizer.chat_template".to_string(),
        string("chat_template"),
    );
    md
}

fn spec() -> &'static GgufTokenizerSpec {
    static SPEC: OnceLock<GgufTokenizerSpec> = OnceLock::new();
    SPEC.get_or_init(|| GgufTokenizerSpec::from_gguf_metadata(&qwen25_metadata()).unwrap())
}

fn qwen() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| Tokenizer::from_gguf_spec(spec()).unwrap())
}

fn cases() -> impl Iterator<Item = (&'static str, Vec<u32>, &'static str)> {
    reference()["cases"].as_array().unwrap().iter().map(|case| {
        (
            case["text"].as_str().unwrap(),
            ids_of(&case["ids"]),
            case["llama_cpp_decoded"].as_str().unwrap(),
        )
    })
}

fn chat_messages(value: &Value) -> Vec<ChatMessage> {
    value
        .as_array()
        .unwrap()
        .iter()
        .map(|m| ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
        .collect()
}

#[test]
fn spec_reads_the_gguf_keys() {
    let spec = spec();
    let meta = meta();
    assert_eq!(spec.model, "gpt2");
    assert_eq!(spec.pre.as_deref(), Some("qwen2"));
    assert_eq!(spec.tokens.len(), 151_936);
    assert_eq!(spec.merges.len(), 151_387);
    assert_eq!(spec.merges[0], "Ġ Ġ");
    assert_eq!(spec.token_types.as_ref().map(Vec::len), Some(151_936));
    assert_eq!(spec.bos_token_id, Some(as_u32(&meta["bos_token_id"])));
    assert_eq!(spec.eos_token_id, Some(151_645));
    assert_eq!(spec.padding_token_id, Some(151_643));
    assert_eq!(spec.add_bos_token, Some(false));
    assert_eq!(
        spec.chat_template.as_deref(),
        meta["chat_template"].as_str()
    );
}

#[test]
fn encodes_like_llama_cpp() {
    let tokenizer = qwen();
    let mut mismatches = Vec::new();
    for (text, expected, _) in cases() {
        let ids = tokenizer.encode(text, false).unwrap();
        if ids != expected {
            mismatches.push(format!(
                "{text:?}\n  ours:      {ids:?}\n  llama.cpp: {expected:?}"
            ));
        }
        // Qwen2.5 adds no BOS, so special tokens change nothing.
        assert_eq!(tokenizer.encode(text, true).unwrap(), ids, "{text:?}");
    }
    assert!(mismatches.is_empty(), "{}", mismatches.join("\n"));
    assert!(cases().count() >= 40);
}

#[test]
fn decodes_like_llama_cpp_and_round_trips() {
    let tokenizer = qwen();
    for (text, ids, llama_cpp_decoded) in cases() {
        let decoded = tokenizer.decode(&ids, false).unwrap();
        assert_eq!(decoded, llama_cpp_decoded, "{text:?}");
        assert_eq!(decoded, text);
        let ours = tokenizer.encode(text, false).unwrap();
        assert_eq!(tokenizer.decode(&ours, false).unwrap(), text);
    }
}

#[test]
fn special_tokens_are_single_tokens() {
    let tokenizer = qwen();
    assert_eq!(tokenizer.token_to_id("<|im_start|>"), Some(151_644));
    assert_eq!(
        tokenizer.id_to_token(151_645).as_deref(),
        Some("<|im_end|>")
    );
    assert_eq!(
        tokenizer.id_to_token(151_657).as_deref(),
        Some("<tool_call>")
    );
    assert_eq!(tokenizer.id_to_token(220).as_deref(), Some("Ġ"));
    assert_eq!(tokenizer.encode("<|im_start|>", false).unwrap(), [151_644]);

    let ids = tokenizer
        .encode("<|im_start|>a<tool_call><|im_end|>", false)
        .unwrap();
    assert_eq!(ids.len(), 4);
    // Control tokens are skippable; user-defined ones such as <tool_call> are text.
    assert_eq!(tokenizer.decode(&ids, true).unwrap(), "a<tool_call>");
}

#[test]
fn special_token_ids_match_llama_cpp() {
    let tokenizer = qwen();
    assert_eq!(tokenizer.vocab_size(), 151_936);
    assert_eq!(tokenizer.bos_token_id(), Some(151_643));
    assert_eq!(
        tokenizer.eos_token_ids()[0],
        151_645,
        "the configured EOS comes first"
    );
    let mut ours = tokenizer.eos_token_ids().to_vec();
    ours.sort_unstable();
    // llama.cpp also ends generation at any token spelled "</s>", which in Qwen's vocabulary
    // is ordinary text (token type normal); that one is left out on purpose.
    let normal_type = |id: u32| spec().token_types.as_ref().unwrap()[id as usize] == 1;
    let (mut llama_cpp, text_tokens): (Vec<u32>, Vec<u32>) =
        ids_of(&reference()["end_of_generation_ids"])
            .into_iter()
            .partition(|&id| !normal_type(id));
    llama_cpp.sort_unstable();
    assert_eq!(ours, llama_cpp);
    let text_tokens: Vec<_> = text_tokens
        .into_iter()
        .filter_map(|id| tokenizer.id_to_token(id))
        .collect();
    assert_eq!(text_tokens, ["</s>"]);
    for text in ["<|endoftext|>", "<|im_end|>"] {
        assert!(
            ours.contains(&tokenizer.token_to_id(text).unwrap()),
            "{text}"
        );
    }
}

#[test]
fn html_end_tag_stays_text_unlike_llama_cpp() {
    // See `llama_cpp_eos_text_quirks` in make_qwen25_fixtures.py: recent llama.cpp makes "</s>"
    // a control token; the model's own tokenizer (and this one) treat it as text.
    let tokenizer = qwen();
    for quirk in reference()["llama_cpp_eos_text_quirks"].as_array().unwrap() {
        let text = quirk["text"].as_str().unwrap();
        let ids = tokenizer.encode(text, false).unwrap();
        assert_eq!(ids, ids_of(&quirk["ids_plain_text"]), "{text:?}");
        assert_ne!(ids, ids_of(&quirk["ids_parse_special"]), "{text:?}");
    }
}

#[test]
fn decode_rejects_unknown_ids() {
    let tokenizer = qwen();
    let err = tokenizer.decode(&[9, 151_936], false).unwrap_err();
    assert!(
        matches!(err, TokenizerError::UnknownTokenId { id: 151_936, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("151936"), "{err}");
    assert!(tokenizer.decode_stream().push(u32::MAX).is_err());
}

#[test]
fn chat_template_matches_jinja_rendering() {
    let tokenizer = qwen();
    assert!(tokenizer.has_chat_template());
    for chat in reference()["chats"].as_array().unwrap() {
        let messages = chat_messages(&chat["messages"]);
        let add_generation_prompt = chat["add_generation_prompt"].as_bool().unwrap();
        let text = tokenizer
            .apply_chat_template(&messages, add_generation_prompt)
            .unwrap();
        assert_eq!(text, chat["text"].as_str().unwrap(), "{messages:?}");
        assert_eq!(
            tokenizer.encode(&text, false).unwrap(),
            ids_of(&chat["ids"])
        );
    }
    let text = tokenizer
        .apply_chat_template(&[ChatMessage::user("hi")], true)
        .unwrap();
    assert!(text.starts_with(
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful \
         assistant.<|im_end|>\n"
    ));
}

fn stream_pieces(tokenizer: &Tokenizer, ids: &[u32], skip_special_tokens: bool) -> Vec<String> {
    let mut stream = tokenizer.decode_stream_with(skip_special_tokens);
    let mut pieces = Vec::new();
    for &id in ids {
        pieces.extend(stream.push(id).unwrap());
    }
    pieces.extend(stream.finish().unwrap());
    pieces
}

#[test]
fn decode_stream_concatenates_to_decode() {
    let tokenizer = qwen();
    for (text, ids, _) in cases() {
        for skip in [false, true] {
            let pieces = stream_pieces(tokenizer, &ids, skip);
            assert_eq!(
                pieces.concat(),
                tokenizer.decode(&ids, skip).unwrap(),
                "{text:?}"
            );
            if !text.contains('\u{FFFD}') {
                assert!(
                    pieces.iter().all(|p| !p.contains('\u{FFFD}')),
                    "{text:?}: {pieces:?}"
                );
            }
        }
    }
}

#[test]
fn decode_stream_holds_back_split_characters() {
    let tokenizer = qwen();
    let text = "a😀b 谢谢 👨\u{200d}👩\u{200d}👧";
    let ids = tokenizer.encode(text, false).unwrap();
    // Tokens holding only part of a character's bytes decode alone to U+FFFD.
    let partial: Vec<u32> = ids
        .iter()
        .copied()
        .filter(|&id| tokenizer.decode(&[id], false).unwrap().contains('\u{FFFD}'))
        .collect();
    assert!(
        !partial.is_empty(),
        "the test needs a character split across tokens: {ids:?}"
    );

    let mut stream = tokenizer.decode_stream();
    let mut pieces = Vec::new();
    let mut pushes_without_text = 0;
    for &id in &ids {
        match stream.push(id).unwrap() {
            Some(piece) => pieces.push(piece),
            None => pushes_without_text += 1,
        }
    }
    assert!(stream.finish().unwrap().is_none());
    assert!(pushes_without_text > 0);
    assert_eq!(pieces.concat(), text);
    assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')), "{pieces:?}");

    // A stream that stops inside a character flushes the partial bytes as U+FFFD, as decode does.
    let (first, _) = ids.split_at(ids.iter().position(|id| partial.contains(id)).unwrap() + 1);
    let pieces = stream_pieces(tokenizer, first, false);
    assert_eq!(pieces.concat(), tokenizer.decode(first, false).unwrap());
}

/// A temporary directory removed on drop (no `tempfile` dev-dependency in this crate).
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        let path =
            std::env::temp_dir().join(format!("specula-{tag}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&path).unwrap();
        Self(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn tokenizer_json_of_the_same_vocab_behaves_the_same() {
    let gguf_built = qwen();
    let dir = TempDir::new("qwen25-json");
    gguf_built
        .inner()
        .save(dir.0.join("tokenizer.json"), false)
        .unwrap();
    let config = serde_json::json!({
        "bos_token": null,
        "eos_token": "<|im_end|>",
        "add_bos_token": false,
        "chat_template": meta()["chat_template"],
    });
    std::fs::write(dir.0.join("tokenizer_config.json"), config.to_string()).unwrap();
    std::fs::write(
        dir.0.join("generation_config.json"),
        r#"{"eos_token_id": [151645, 151643], "bos_token_id": 151643}"#,
    )
    .unwrap();

    let loaded = Tokenizer::from_file(&dir.0.join("tokenizer.json")).unwrap();
    assert_eq!(loaded.vocab_size(), gguf_built.vocab_size());
    assert_eq!(loaded.bos_token_id(), None);
    assert_eq!(loaded.eos_token_ids()[..2], [151_645, 151_643]);
    for (text, expected, _) in cases() {
        let ids = loaded.encode(text, true).unwrap();
        assert_eq!(ids, expected, "{text:?}");
        assert_eq!(loaded.decode(&ids, false).unwrap(), text);
    }
    for chat in reference()["chats"].as_array().unwrap() {
        let messages = chat_messages(&chat["messages"]);
        let add_generation_prompt = chat["add_generation_prompt"].as_bool().unwrap();
        assert_eq!(
            loaded
                .apply_chat_template(&messages, add_generation_prompt)
                .unwrap(),
            chat["text"].as_str().unwrap()
        );
    }
}

mod properties {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// No normalizer and byte-level BPE: any text survives encode -> decode unchanged.
        #[test]
        fn any_text_round_trips(text in "\\PC{0,48}|[ \\t\\n\\r a-z0-9'<|>_]{0,48}") {
            let tokenizer = qwen();
            let ids = tokenizer.encode(&text, false).unwrap();
            prop_assert_eq!(tokenizer.decode(&ids, false).unwrap(), text);
        }

        /// Arbitrary id sequences split and produce invalid UTF-8 anywhere; the streamed
        /// pieces must still add up to the one-shot decode.
        #[test]
        fn any_ids_stream_like_decode(
            ids in proptest::collection::vec(0u32..151_936, 0..40),
            skip_special_tokens in any::<bool>(),
        ) {
            let tokenizer = qwen();
            let pieces = stream_pieces(tokenizer, &ids, skip_special_tokens);
            prop_assert_eq!(
                pieces.concat(),
                tokenizer.decode(&ids, skip_special_tokens).unwrap()
            );
        }
    }
}
