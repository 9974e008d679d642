//! Tokenizer construction paths and their errors on a tiny byte-level BPE vocabulary: GGUF
//! metadata -> `GgufTokenizerSpec` -> `Tokenizer`, and `tokenizer.json` (+ configs) ->
//! `Tokenizer::from_file`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use specula_model::gguf::GgufValue;
use specula_model::tokenizer::{ChatMessage, GgufTokenizerSpec, Tokenizer, TokenizerError};

/// GPT-2's byte -> char map: printable Latin-1 bytes stand for themselves, the others are
/// shifted past U+00FF in byte order.
fn byte_to_char(byte: u8) -> char {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    if printable(byte) {
        char::from(byte)
    } else {
        let shifted = (0..byte).filter(|&b| !printable(b)).count() as u32;
        char::from_u32(256 + shifted).unwrap()
    }
}

const MERGES: &[&str] = &[
    "h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d",
];
const HELLO: u32 = 259;
const SPACE_WORLD: u32 = 264;
const ENDOFTEXT: u32 = 265;
const IM_START: u32 = 266;
const IM_END: u32 = 267;
const TOOL_CALL: u32 = 268;

fn synthetic_spec() -> GgufTokenizerSpec {
    let mut tokens: Vec<String> = (0..=255u8).map(|b| byte_to_char(b).to_string()).collect();
    tokens.extend(MERGES.iter().map(|m| m.replace(' ', "")));
    tokens.extend(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>"].map(String::from));
    let mut token_types = vec![1; tokens.len()];
    token_types[ENDOFTEXT as usize] = 3;
    token_types[IM_START as usize] = 3;
    token_types[IM_END as usize] = 3;
    token_types[TOOL_CALL as usize] = 4;
    GgufTokenizerSpec {
        model: "gpt2".to_string(),
        pre: Some("qwen2".to_string()),
        tokens,
        token_types: Some(token_types),
        merges: MERGES.iter().map(|m| m.to_string()).collect(),
        bos_token_id: Some(ENDOFTEXT),
        eos_token_id: Some(IM_END),
        padding_token_id: Some(ENDOFTEXT),
        add_bos_token: None,
        chat_template: Some(
            "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + \
             '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ \
             '<|im_start|>assistant\\n' }}{% endif %}"
                .to_string(),
        ),
    }
}

fn synthetic_metadata() -> BTreeMap<String, GgufValue> {
    let spec = synthetic_spec();
    let strings =
        |v: &[String]| GgufValue::Array(v.iter().cloned().map(GgufValue::String).collect());
    let mut md = BTreeMap::new();
    md.insert("tokenizer.ggml.model".into(), GgufValue::String(spec.model));
    md.insert(
        "tokenizer.ggml.pre".into(),
        GgufValue::String(spec.pre.unwrap()),
    );
    md.insert("tokenizer.ggml.tokens".into(), strings(&spec.tokens));
    md.insert(
        "tokenizer.ggml.token_type".into(),
        GgufValue::Array(
            spec.token_types
                .unwrap()
                .into_iter()
                .map(GgufValue::I32)
                .collect(),
        ),
    );
    md.insert("tokenizer.ggml.merges".into(), strings(&spec.merges));
    md.insert(
        "tokenizer.ggml.bos_token_id".into(),
        GgufValue::U32(ENDOFTEXT),
    );
    md.insert("tokenizer.ggml.eos_token_id".into(), GgufValue::U32(IM_END));
    md.insert(
        "tokenizer.chat_template".into(),
        GgufValue::String(spec.chat_template.unwrap()),
    );
    md
}

fn build_err(spec: &GgufTokenizerSpec) -> TokenizerError {
    Tokenizer::from_gguf_spec(spec).expect_err("the spec is invalid")
}

#[test]
fn metadata_builds_a_byte_level_bpe() {
    let spec = GgufTokenizerSpec::from_gguf_metadata(&synthetic_metadata()).unwrap();
    assert_eq!(
        spec,
        GgufTokenizerSpec {
            padding_token_id: None,
            ..synthetic_spec()
        }
    );
    let tokenizer = Tokenizer::from_gguf_spec(&spec).unwrap();

    assert_eq!(
        tokenizer.encode("hello world", false).unwrap(),
        [HELLO, SPACE_WORLD]
    );
    assert_eq!(
        tokenizer
            .encode("<|im_start|>hello<|im_end|>", false)
            .unwrap(),
        [IM_START, HELLO, IM_END]
    );
    let ids = tokenizer.encode("héllo\n\t😀 <tool_call>", false).unwrap();
    assert!(ids.contains(&TOOL_CALL));
    assert_eq!(
        tokenizer.decode(&ids, false).unwrap(),
        "héllo\n\t😀 <tool_call>"
    );
    assert_eq!(
        tokenizer.decode(&[IM_START, HELLO, IM_END], true).unwrap(),
        "hello"
    );

    assert_eq!(tokenizer.vocab_size(), 269);
    assert_eq!(tokenizer.bos_token_id(), Some(ENDOFTEXT));
    assert_eq!(tokenizer.eos_token_ids(), [IM_END, ENDOFTEXT]);
    // The qwen2 pre-tokenizer does not add a BOS unless the metadata asks for it.
    assert_eq!(tokenizer.encode("hello", true).unwrap(), [HELLO]);
    let with_bos = Tokenizer::from_gguf_spec(&GgufTokenizerSpec {
        add_bos_token: Some(true),
        ..synthetic_spec()
    })
    .unwrap();
    assert_eq!(with_bos.encode("hello", true).unwrap(), [ENDOFTEXT, HELLO]);
    assert_eq!(with_bos.encode("hello", false).unwrap(), [HELLO]);
}

#[test]
fn llama3_pre_tokenizer_adds_bos_by_default() {
    let spec = GgufTokenizerSpec {
        pre: Some("llama-bpe".to_string()),
        ..synthetic_spec()
    };
    let tokenizer = Tokenizer::from_gguf_spec(&spec).unwrap();
    assert_eq!(
        tokenizer.encode("hello world", true).unwrap(),
        [ENDOFTEXT, HELLO, SPACE_WORLD]
    );
    let spec = GgufTokenizerSpec {
        add_bos_token: Some(false),
        ..spec
    };
    let tokenizer = Tokenizer::from_gguf_spec(&spec).unwrap();
    assert_eq!(
        tokenizer.encode("hello world", true).unwrap(),
        [HELLO, SPACE_WORLD]
    );
}

#[test]
fn every_known_pre_tokenizer_builds() {
    for pre in ["qwen2", "llama-bpe", "llama3", "gpt2", "default"] {
        let spec = GgufTokenizerSpec {
            pre: Some(pre.to_string()),
            ..synthetic_spec()
        };
        let tokenizer = Tokenizer::from_gguf_spec(&spec).unwrap_or_else(|e| panic!("{pre}: {e}"));
        let text = "it's 12345 hello  world\n\n  x";
        let ids = tokenizer.encode(text, false).unwrap();
        assert_eq!(tokenizer.decode(&ids, false).unwrap(), text, "{pre}");
    }
}

#[test]
fn metadata_errors_name_the_key() {
    let md = synthetic_metadata();

    let mut missing = md.clone();
    missing.remove("tokenizer.ggml.tokens");
    let err = GgufTokenizerSpec::from_gguf_metadata(&missing).unwrap_err();
    assert!(matches!(err, TokenizerError::MissingMetadata { .. }));
    assert_eq!(
        err.to_string(),
        "GGUF metadata key `tokenizer.ggml.tokens` is missing"
    );

    let mut wrong = md.clone();
    wrong.insert("tokenizer.ggml.model".into(), GgufValue::U32(2));
    let err = GgufTokenizerSpec::from_gguf_metadata(&wrong).unwrap_err();
    assert_eq!(
        err.to_string(),
        "GGUF metadata key `tokenizer.ggml.model` has type u32, expected string"
    );

    let mut wrong_element = md.clone();
    if let Some(GgufValue::Array(tokens)) = wrong_element.get_mut("tokenizer.ggml.tokens") {
        tokens[3] = GgufValue::F32(1.0);
    }
    let err = GgufTokenizerSpec::from_gguf_metadata(&wrong_element).unwrap_err();
    assert!(
        err.to_string()
            .contains("`tokenizer.ggml.tokens[3]` has type f32"),
        "{err}"
    );

    let mut wrong_type_ids = md.clone();
    wrong_type_ids.insert(
        "tokenizer.ggml.token_type".into(),
        GgufValue::String("x".into()),
    );
    let err = GgufTokenizerSpec::from_gguf_metadata(&wrong_type_ids).unwrap_err();
    assert!(
        err.to_string().contains("expected array of integer"),
        "{err}"
    );

    for bad_id in [
        GgufValue::I32(-1),
        GgufValue::Bool(true),
        GgufValue::U64(1 << 40),
    ] {
        let mut bad = md.clone();
        bad.insert("tokenizer.ggml.eos_token_id".into(), bad_id.clone());
        let err = GgufTokenizerSpec::from_gguf_metadata(&bad).unwrap_err();
        assert!(
            err.to_string().contains("tokenizer.ggml.eos_token_id"),
            "{bad_id:?}: {err}"
        );
    }

    let mut bad_bool = md;
    bad_bool.insert("tokenizer.ggml.add_bos_token".into(), GgufValue::U8(1));
    let err = GgufTokenizerSpec::from_gguf_metadata(&bad_bool).unwrap_err();
    assert!(err.to_string().contains("expected bool"), "{err}");
}

#[test]
fn unsupported_or_inconsistent_specs_are_errors() {
    let err = build_err(&GgufTokenizerSpec {
        model: "llama".to_string(),
        ..synthetic_spec()
    });
    assert!(
        matches!(err, TokenizerError::UnsupportedModel { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("`llama`"), "{err}");

    let err = build_err(&GgufTokenizerSpec {
        pre: Some("made-up".to_string()),
        ..synthetic_spec()
    });
    let message = err.to_string();
    assert!(
        message.contains("`made-up`") && message.contains("qwen2, "),
        "{message}"
    );
    assert!(message.contains("llama-bpe"), "{message}");
    let err = build_err(&GgufTokenizerSpec {
        pre: None,
        ..synthetic_spec()
    });
    assert!(
        matches!(err, TokenizerError::UnknownPreTokenizer { .. }),
        "{err}"
    );

    let mut spec = synthetic_spec();
    spec.token_types.as_mut().unwrap().pop();
    assert!(build_err(&spec).to_string().contains("token_type"));

    let err = build_err(&GgufTokenizerSpec {
        eos_token_id: Some(269),
        ..synthetic_spec()
    });
    assert!(
        err.to_string().contains("eos_token_id") && err.to_string().contains("269"),
        "{err}"
    );

    let mut spec = synthetic_spec();
    spec.merges[2] = "hell".to_string();
    let err = build_err(&spec);
    assert!(
        err.to_string().contains("tokenizer.ggml.merges[2]"),
        "{err}"
    );

    let mut spec = synthetic_spec();
    spec.merges.push("zz q".to_string());
    let err = build_err(&spec);
    assert!(err.to_string().contains("tokenizer.ggml.merges"), "{err}");

    let mut spec = synthetic_spec();
    spec.tokens[HELLO as usize] = "he".to_string();
    let err = build_err(&spec);
    assert!(
        err.to_string().contains("appears at ids 256 and 259"),
        "{err}"
    );

    let err = build_err(&GgufTokenizerSpec {
        merges: Vec::new(),
        ..synthetic_spec()
    });
    assert!(err.to_string().contains("needs merges"), "{err}");
}

#[test]
fn chat_templates_that_cannot_be_rendered_are_errors() {
    let tokenizer = Tokenizer::from_gguf_spec(&synthetic_spec()).unwrap();
    assert!(tokenizer.has_chat_template());
    assert_eq!(
        tokenizer
            .apply_chat_template(&[ChatMessage::user("hi")], true)
            .unwrap(),
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );

    let no_template = Tokenizer::from_gguf_spec(&GgufTokenizerSpec {
        chat_template: None,
        ..synthetic_spec()
    })
    .unwrap();
    assert!(!no_template.has_chat_template());
    let err = no_template
        .apply_chat_template(&[ChatMessage::user("hi")], true)
        .unwrap_err();
    assert!(matches!(err, TokenizerError::NoChatTemplate), "{err}");

    let llama3 = "{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + \
                  '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}{% endfor %}";
    let other = Tokenizer::from_gguf_spec(&GgufTokenizerSpec {
        chat_template: Some(llama3.to_string()),
        ..synthetic_spec()
    })
    .unwrap();
    assert!(!other.has_chat_template());
    assert_eq!(other.chat_template_source(), Some(llama3));
    let err = other
        .apply_chat_template(&[ChatMessage::user("hi")], true)
        .unwrap_err();
    assert!(
        matches!(err, TokenizerError::UnsupportedChatTemplate { .. }),
        "{err}"
    );
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

    fn write(&self, name: &str, contents: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, contents).unwrap();
        path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const QWEN_STYLE_TEMPLATE: &str =
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + \
     messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are \
     a helpful assistant.<|im_end|>\\n' }}{%- endif %}";

#[test]
fn tokenizer_json_with_configs_loads_and_matches() {
    let reference = Tokenizer::from_gguf_spec(&synthetic_spec()).unwrap();
    let dir = TempDir::new("tokenizer-json");
    let json_path = dir.0.join("tokenizer.json");
    reference.inner().save(&json_path, true).unwrap();
    let config = serde_json::json!({
        "bos_token": {"content": "<|endoftext|>", "special": true},
        "eos_token": {"content": "<|im_end|>", "special": true},
        "add_bos_token": false,
        "chat_template": [
            {"name": "tool_use", "template": "{{ 'unused' }}"},
            {"name": "default", "template": QWEN_STYLE_TEMPLATE},
        ],
    });
    dir.write("tokenizer_config.json", &config.to_string());
    dir.write("generation_config.json", r#"{"eos_token_id": 265}"#);

    for path in [json_path.clone(), dir.0.clone()] {
        let loaded = Tokenizer::from_file(&path).unwrap();
        for text in [
            "hello world",
            "<|im_start|>user\nhé 😀<|im_end|>\n",
            "",
            "  \t\n x",
        ] {
            let ids = loaded.encode(text, true).unwrap();
            assert_eq!(ids, reference.encode(text, true).unwrap(), "{text:?}");
            assert_eq!(loaded.decode(&ids, false).unwrap(), text);
            let mut stream = loaded.decode_stream();
            let mut streamed = String::new();
            for &id in &ids {
                streamed.extend(stream.push(id).unwrap());
            }
            streamed.extend(stream.finish().unwrap());
            assert_eq!(streamed, text);
        }
        assert_eq!(loaded.vocab_size(), 269);
        assert_eq!(loaded.bos_token_id(), Some(ENDOFTEXT));
        assert_eq!(loaded.eos_token_ids(), [IM_END, ENDOFTEXT]);
        assert!(loaded.has_chat_template());
        assert_eq!(
            loaded.apply_chat_template(&[ChatMessage::user("hi")], false).unwrap(),
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        );
    }

    // chat_template.jinja beside the config wins over the config's template.
    dir.write("chat_template.jinja", "{{ '<|start_header_id|>' }}");
    let loaded = Tokenizer::from_file(&json_path).unwrap();
    assert!(!loaded.has_chat_template());
}

#[test]
fn bos_comes_from_the_post_processor_or_the_config_but_only_once() {
    use tokenizers::processors::template::TemplateProcessing;

    let base = Tokenizer::from_gguf_spec(&synthetic_spec()).unwrap();
    let dir = TempDir::new("tokenizer-bos");
    let config = r#"{"bos_token": "<|endoftext|>", "add_bos_token": true}"#;
    dir.write("tokenizer_config.json", config);

    // No post-processor: the config's add_bos_token makes from_file prepend it.
    base.inner()
        .save(dir.0.join("tokenizer.json"), false)
        .unwrap();
    let loaded = Tokenizer::from_file(&dir.0).unwrap();
    assert_eq!(loaded.encode("hello", true).unwrap(), [ENDOFTEXT, HELLO]);
    assert_eq!(loaded.encode("hello", false).unwrap(), [HELLO]);

    // A post-processor that adds it already (as Llama 3's tokenizer.json does).
    let mut with_processor = base.inner().clone();
    let processor = TemplateProcessing::builder()
        .try_single("<|endoftext|> $A")
        .unwrap()
        .special_tokens(vec![("<|endoftext|>", ENDOFTEXT)])
        .build()
        .unwrap();
    with_processor.with_post_processor(Some(processor));
    with_processor
        .save(dir.0.join("tokenizer.json"), false)
        .unwrap();
    let loaded = Tokenizer::from_file(&dir.0).unwrap();
    assert_eq!(loaded.encode("hello", true).unwrap(), [ENDOFTEXT, HELLO]);
    assert_eq!(loaded.encode("hello", false).unwrap(), [HELLO]);
}

#[test]
fn unreadable_tokenizer_files_are_clear_errors() {
    let dir = TempDir::new("tokenizer-bad");

    let missing = dir.0.join("nope").join("tokenizer.json");
    let err = Tokenizer::from_file(&missing).unwrap_err();
    assert!(matches!(err, TokenizerError::Io { .. }), "{err}");
    assert!(err.to_string().contains("nope/tokenizer.json"), "{err}");

    let corrupt = dir.write("tokenizer.json", "{\"model\": {\"type\": \"BPE\", ");
    let err = Tokenizer::from_file(&corrupt).unwrap_err();
    assert!(
        matches!(err, TokenizerError::InvalidTokenizerFile { .. }),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("tokenizer.json: not a valid tokenizer.json"),
        "{err}"
    );

    let not_a_tokenizer = dir.write("tokenizer.json", r#"{"hello": "world"}"#);
    assert!(matches!(
        Tokenizer::from_file(&not_a_tokenizer),
        Err(TokenizerError::InvalidTokenizerFile { .. })
    ));

    let good = Tokenizer::from_gguf_spec(&synthetic_spec()).unwrap();
    good.inner()
        .save(dir.0.join("tokenizer.json"), false)
        .unwrap();
    dir.write("tokenizer_config.json", "{ not json");
    let err = Tokenizer::from_file(&dir.0).unwrap_err();
    assert!(matches!(err, TokenizerError::InvalidJson { .. }), "{err}");
    assert!(
        err.to_string()
            .contains("tokenizer_config.json: invalid JSON"),
        "{err}"
    );

    dir.write("tokenizer_config.json", r#"{"eos_token": "<|not_there|>"}"#);
    let err = Tokenizer::from_file(&dir.0).unwrap_err();
    assert!(err.to_string().contains("<|not_there|>"), "{err}");

    dir.write("tokenizer_config.json", r#"{"eos_token": "<|im_end|>"}"#);
    dir.write(
        "generation_config.json",
        r#"{"eos_token_id": [267, 100000]}"#,
    );
    let err = Tokenizer::from_file(&dir.0).unwrap_err();
    assert!(
        matches!(err, TokenizerError::UnknownTokenId { id: 100000, .. }),
        "{err}"
    );

    dir.write("generation_config.json", r#"{"eos_token_id": "x"}"#);
    let err = Tokenizer::from_file(&dir.0).unwrap_err();
    assert!(err.to_string().contains("generation_config.json"), "{err}");
}

#[test]
fn tokenizer_can_be_shared_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
    assert_send_sync::<TokenizerError>();
}
