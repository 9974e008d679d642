//! Tokenizers described by GGUF metadata (`tokenizer.ggml.*`), built to match llama.cpp.

use std::collections::BTreeMap;

use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use super::{TokenizerError, TokenizerParts};
use crate::gguf::GgufValue;

const KEY_MODEL: &str = "tokenizer.ggml.model";
const KEY_PRE: &str = "tokenizer.ggml.pre";
const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
const KEY_TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
const KEY_MERGES: &str = "tokenizer.ggml.merges";
const KEY_BOS: &str = "tokenizer.ggml.bos_token_id";
const KEY_EOS: &str = "tokenizer.ggml.eos_token_id";
const KEY_PADDING: &str = "tokenizer.ggml.padding_token_id";
const KEY_ADD_BOS: &str = "tokenizer.ggml.add_bos_token";
const KEY_CHAT_TEMPLATE: &str = "tokenizer.chat_template";

/// GGUF token types (llama.cpp `llama_token_type`). Only the two that become added tokens
/// matter here; normal, unknown, unused and byte tokens are plain vocabulary entries.
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// The tokenizer part of a GGUF file's metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufTokenizerSpec {
    /// `tokenizer.ggml.model`, e.g. "gpt2" (byte-level BPE) or "llama" (SentencePiece).
    pub model: String,
    /// `tokenizer.ggml.pre`: which pre-tokenizer regex llama.cpp uses, e.g. "qwen2".
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`; the index is the id.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.token_type`, one per token (1 normal, 3 control, 4 user-defined, ...).
    pub token_types: Option<Vec<i32>>,
    /// `tokenizer.ggml.merges`, "left right" in priority order; empty when absent.
    pub merges: Vec<String>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    pub padding_token_id: Option<u32>,
    pub add_bos_token: Option<bool>,
    /// `tokenizer.chat_template` (Jinja source).
    pub chat_template: Option<String>,
}

impl GgufTokenizerSpec {
    /// Reads the `tokenizer.ggml.*` and `tokenizer.chat_template` keys. `model` and `tokens` are
    /// required; every other key is optional but must have the right type when present.
    pub fn from_gguf_metadata(md: &BTreeMap<String, GgufValue>) -> Result<Self, TokenizerError> {
        let model = required(md, KEY_MODEL, string)?;
        let tokens = required(md, KEY_TOKENS, |key, v| {
            array_of(key, v, "array of string", string)
        })?;
        let token_types = optional(md, KEY_TOKEN_TYPE, |key, v| {
            array_of(key, v, "array of integer", |key, element| {
                element
                    .as_i64()
                    .and_then(|t| i32::try_from(t).ok())
                    .ok_or_else(|| wrong_type(key, "integer", element))
            })
        })?;
        let merges = optional(md, KEY_MERGES, |key, v| {
            array_of(key, v, "array of string", string)
        })?
        .unwrap_or_default();
        Ok(Self {
            model,
            pre: optional(md, KEY_PRE, string)?,
            tokens,
            token_types,
            merges,
            bos_token_id: optional(md, KEY_BOS, token_id)?,
            eos_token_id: optional(md, KEY_EOS, token_id)?,
            padding_token_id: optional(md, KEY_PADDING, token_id)?,
            add_bos_token: optional(md, KEY_ADD_BOS, |key, v| {
                v.as_bool().ok_or_else(|| wrong_type(key, "bool", v))
            })?,
            chat_template: optional(md, KEY_CHAT_TEMPLATE, string)?,
        })
    }
}

fn required<T>(
    md: &BTreeMap<String, GgufValue>,
    key: &str,
    read: impl Fn(&str, &GgufValue) -> Result<T, TokenizerError>,
) -> Result<T, TokenizerError> {
    match md.get(key) {
        Some(value) => read(key, value),
        None => Err(TokenizerError::MissingMetadata {
            key: key.to_string(),
        }),
    }
}

fn optional<T>(
    md: &BTreeMap<String, GgufValue>,
    key: &str,
    read: impl Fn(&str, &GgufValue) -> Result<T, TokenizerError>,
) -> Result<Option<T>, TokenizerError> {
    md.get(key).map(|value| read(key, value)).transpose()
}

fn wrong_type(key: &str, expected: &'static str, found: &GgufValue) -> TokenizerError {
    TokenizerError::WrongMetadataType {
        key: key.to_string(),
        expected,
        found: found.type_name().to_string(),
    }
}

fn string(key: &str, value: &GgufValue) -> Result<String, TokenizerError> {
    value
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| wrong_type(key, "string", value))
}

fn token_id(key: &str, value: &GgufValue) -> Result<u32, TokenizerError> {
    match value.as_u64() {
        // A bool also widens to an integer, but a bool where an id belongs is a broken file.
        Some(id) if !matches!(value, GgufValue::Bool(_)) => {
            u32::try_from(id).map_err(|_| TokenizerError::InvalidMetadata {
                key: key.to_string(),
                reason: format!("token id {id} does not fit in 32 bits"),
            })
        }
        _ => Err(wrong_type(key, "non-negative integer", value)),
    }
}

/// Reads an array, naming the offending element's index in the error.
fn array_of<T>(
    key: &str,
    value: &GgufValue,
    expected: &'static str,
    read_element: impl Fn(&str, &GgufValue) -> Result<T, TokenizerError>,
) -> Result<Vec<T>, TokenizerError> {
    let elements = value
        .as_array()
        .ok_or_else(|| wrong_type(key, expected, value))?;
    elements
        .iter()
        .enumerate()
        .map(|(index, element)| read_element(&format!("{key}[{index}]"), element))
        .collect()
}

/// A byte-level BPE pre-tokenizer from llama.cpp's list (`llm_tokenizer_bpe`), by the
/// `tokenizer.ggml.pre` names that select it.
struct PreTokenizerKind {
    names: &'static [&'static str],
    /// Applied in order, each splitting the pieces the previous one produced (llama.cpp's
    /// `unicode_regex_split`); text between matches stays a piece of its own.
    regexes: &'static [&'static str],
    /// llama.cpp's `ignore_merges`: a pre-tokenized word that is itself a vocabulary entry
    /// becomes that token without running the merges.
    ignore_merges: bool,
    /// llama.cpp's default for `add_bos` when `tokenizer.ggml.add_bos_token` is absent.
    add_bos_default: bool,
}

/// The llama.cpp regexes spell the case-insensitive contractions out (`'[sS]`) instead of the
/// Hugging Face `(?i:'s|...)`: with Unicode case folding `(?i)s` also matches `ſ` (U+017F), so
/// the two forms differ on `'ſ`; this is the form llama.cpp runs.
const QWEN2_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const LLAMA3_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const GPT2_REGEX: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

const PRE_TOKENIZERS: &[PreTokenizerKind] = &[
    PreTokenizerKind {
        names: &["qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"],
        regexes: &[QWEN2_REGEX],
        ignore_merges: false,
        add_bos_default: false,
    },
    PreTokenizerKind {
        names: &["llama-bpe", "llama3", "llama-v3", "falcon3"],
        regexes: &[LLAMA3_REGEX],
        ignore_merges: true,
        add_bos_default: true,
    },
    PreTokenizerKind {
        names: &["gpt2", "gpt-2", "phi-2", "mpt", "olmo"],
        regexes: &[GPT2_REGEX],
        ignore_merges: false,
        add_bos_default: false,
    },
    PreTokenizerKind {
        names: &["default"],
        regexes: &[
            r"[\p{P}\$\+<=>\^~\|]+",
            GPT2_REGEX,
            r"\p{N}+",
            r"[0-9][0-9][0-9]",
        ],
        ignore_merges: false,
        add_bos_default: false,
    },
];

fn known_pre_names() -> Vec<&'static str> {
    PRE_TOKENIZERS
        .iter()
        .flat_map(|kind| kind.names.iter().copied())
        .collect()
}

/// Builds a byte-level BPE tokenizer the way llama.cpp reads the same metadata.
///
/// Deliberate differences from a Hugging Face `tokenizer.json` of the same model: no NFC
/// normalizer (llama.cpp applies none, and it keeps `decode(encode(s)) == s`), and the
/// contraction regex spelled as llama.cpp spells it (see [`QWEN2_REGEX`]).
pub(super) fn build(spec: &GgufTokenizerSpec) -> Result<TokenizerParts, TokenizerError> {
    if spec.model != "gpt2" {
        return Err(TokenizerError::UnsupportedModel {
            model: spec.model.clone(),
        });
    }
    // llama.cpp falls back to a generic regex (with a "quality will be degraded" warning) when
    // `pre` is missing or unknown; a silently different tokenization is worse than an error.
    let pre_name = spec
        .pre
        .as_deref()
        .ok_or_else(|| TokenizerError::UnknownPreTokenizer {
            pre: "<missing>".to_string(),
            known: known_pre_names(),
        })?;
    let pre = PRE_TOKENIZERS
        .iter()
        .find(|kind| kind.names.contains(&pre_name))
        .ok_or_else(|| TokenizerError::UnknownPreTokenizer {
            pre: pre_name.to_string(),
            known: known_pre_names(),
        })?;

    let n_tokens = spec.tokens.len();
    if n_tokens == 0 {
        return Err(invalid(KEY_TOKENS, "the vocabulary is empty".to_string()));
    }
    if let Some(types) = &spec.token_types {
        if types.len() != n_tokens {
            return Err(invalid(
                KEY_TOKEN_TYPE,
                format!("{} entries for {n_tokens} tokens", types.len()),
            ));
        }
    }
    let check_id = |key: &str, id: Option<u32>| -> Result<Option<u32>, TokenizerError> {
        match id {
            Some(id) if id as usize >= n_tokens => Err(invalid(
                key,
                format!("token id {id} is outside the vocabulary of {n_tokens} tokens"),
            )),
            _ => Ok(id),
        }
    };
    let bos_token_id = check_id(KEY_BOS, spec.bos_token_id)?;
    let eos_token_id = check_id(KEY_EOS, spec.eos_token_id)?;
    check_id(KEY_PADDING, spec.padding_token_id)?;
    if spec.merges.is_empty() {
        return Err(invalid(
            KEY_MERGES,
            "byte-level BPE needs merges, and there are none".to_string(),
        ));
    }

    // Empty entries get llama.cpp's placeholder text so that every id stays addressable.
    let token_text = |id: usize| -> String {
        match spec.tokens[id].as_str() {
            "" => format!("[EMPTY_{id}]"),
            text => text.to_string(),
        }
    };
    let mut vocab = Vocab::default();
    vocab.reserve(n_tokens);
    for id in 0..n_tokens {
        if let Some(first) = vocab.insert(token_text(id), id as u32) {
            // llama.cpp refuses such a vocabulary too (id_to_token / token_to_id size assert).
            return Err(invalid(
                KEY_TOKENS,
                format!(
                    "token {:?} appears at ids {first} and {id}",
                    spec.tokens[id]
                ),
            ));
        }
    }

    let merges = spec
        .merges
        .iter()
        .enumerate()
        .map(|(index, merge)| {
            // Split at the first space after the first character, as llama.cpp does, so a
            // left part that itself starts with a space still parses.
            let split_at = merge
                .char_indices()
                .skip(1)
                .find(|&(_, c)| c == ' ')
                .map(|(at, _)| at);
            match split_at {
                Some(at) => Ok((merge[..at].to_string(), merge[at + 1..].to_string())),
                None => Err(invalid(
                    &format!("{KEY_MERGES}[{index}]"),
                    format!("{merge:?} is not two tokens separated by a space"),
                )),
            }
        })
        .collect::<Result<Vec<_>, _>>()?;

    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(pre.ignore_merges)
        .build()
        .map_err(|e| invalid(KEY_MERGES, e.to_string()))?;

    let mut pre_tokenizers = Vec::with_capacity(pre.regexes.len() + 1);
    for regex in pre.regexes {
        let split = Split::new(
            SplitPattern::Regex((*regex).to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| TokenizerError::Build(format!("pre-tokenizer regex {regex:?}: {e}")))?;
        pre_tokenizers.push(PreTokenizerWrapper::Split(split));
    }
    // The regexes above did the splitting; ByteLevel only maps bytes to its printable alphabet.
    pre_tokenizers.push(PreTokenizerWrapper::ByteLevel(ByteLevel::new(
        false, false, false,
    )));

    let mut inner = tokenizers::Tokenizer::new(bpe);
    inner.with_pre_tokenizer(Some(Sequence::new(pre_tokenizers)));
    inner.with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevel::new(
        false, false, false,
    ))));

    // Control and user-defined tokens are matched in the raw text before pre-tokenization, so
    // that `<|im_start|>` is one token; control ones are also "special" (skippable in decode).
    if let Some(types) = &spec.token_types {
        let added = |wanted: i32, special: bool| -> Vec<AddedToken> {
            types
                .iter()
                .enumerate()
                .filter(|&(id, &t)| t == wanted && !spec.tokens[id].is_empty())
                .map(|(id, _)| AddedToken::from(spec.tokens[id].clone(), special).normalized(false))
                .collect()
        };
        inner.add_special_tokens(&added(TOKEN_TYPE_CONTROL, true));
        inner.add_tokens(&added(TOKEN_TYPE_USER_DEFINED, false));
    }

    Ok(TokenizerParts {
        inner,
        bos_token_id,
        eos_token_id,
        extra_eos_token_ids: Vec::new(),
        add_bos: spec.add_bos_token.unwrap_or(pre.add_bos_default),
        chat_template: spec.chat_template.clone(),
    })
}

fn invalid(key: &str, reason: String) -> TokenizerError {
    TokenizerError::InvalidMetadata {
        key: key.to_string(),
        reason,
    }
}
