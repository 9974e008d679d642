//! Text <-> token ids for the models the engine runs.
//!
//! Two sources are supported:
//! - a Hugging Face `tokenizer.json` (plus the `tokenizer_config.json`, `chat_template.jinja` and
//!   `generation_config.json` that usually sit beside it), see [`Tokenizer::from_file`];
//! - the `tokenizer.ggml.*` metadata of a GGUF file, see [`GgufTokenizerSpec`] and
//!   [`Tokenizer::from_gguf_spec`]. Only byte-level BPE (`tokenizer.ggml.model = "gpt2"`) is
//!   built; it is made to tokenize exactly like llama.cpp does for the same file.
//!
//! Both end up as a [`tokenizers::Tokenizer`] plus the facts the engine needs around it: which
//! ids end generation, whether a BOS is prepended, and how to render a chat.

mod chat;
mod gguf_spec;
mod hf_files;
mod stream;

use std::path::{Path, PathBuf};

pub use chat::ChatMessage;
pub use gguf_spec::GgufTokenizerSpec;
pub use stream::DecodeStream;

use chat::ChatTemplate;

/// Every way building or using a tokenizer can fail.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a valid tokenizer.json: {message}")]
    InvalidTokenizerFile { path: PathBuf, message: String },
    #[error("{path}: invalid JSON: {source}")]
    InvalidJson {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{path}: {message}")]
    InvalidConfig { path: PathBuf, message: String },
    #[error("GGUF metadata key `{key}` is missing")]
    MissingMetadata { key: String },
    #[error("GGUF metadata key `{key}` has type {found}, expected {expected}")]
    WrongMetadataType {
        key: String,
        expected: &'static str,
        found: String,
    },
    #[error("GGUF metadata key `{key}` is invalid: {reason}")]
    InvalidMetadata { key: String, reason: String },
    #[error(
        "unsupported tokenizer model `{model}` (tokenizer.ggml.model); only byte-level BPE \
         (\"gpt2\") can be built from GGUF metadata"
    )]
    UnsupportedModel { model: String },
    #[error(
        "unknown pre-tokenizer `{pre}` (tokenizer.ggml.pre); known: {}",
        known.join(", ")
    )]
    UnknownPreTokenizer {
        pre: String,
        known: Vec<&'static str>,
    },
    #[error("building the tokenizer failed: {0}")]
    Build(String),
    #[error("encoding failed: {0}")]
    Encode(String),
    #[error("decoding failed: {0}")]
    Decode(String),
    #[error("token id {id} is not in the vocabulary (size {vocab_size})")]
    UnknownTokenId { id: u32, vocab_size: usize },
    #[error("this tokenizer has no chat template")]
    NoChatTemplate,
    #[error(
        "unsupported chat template (only ChatML-style <|im_start|>/<|im_end|> templates are \
         implemented); template starts with: {excerpt}"
    )]
    UnsupportedChatTemplate { excerpt: String },
    #[error("chat message {index} has role `{role}`; the chat template renders only {supported}")]
    UnsupportedChatRole {
        index: usize,
        role: String,
        supported: &'static str,
    },
    #[error("cannot render a chat with no messages")]
    EmptyChat,
}

/// A tokenizer with the special-token facts and chat format of one model.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos_token_id: Option<u32>,
    /// The primary EOS first, then every other id that ends generation, without repeats.
    eos_token_ids: Vec<u32>,
    /// Prepend `bos_token_id` in `encode(.., add_special_tokens = true)` because the inner
    /// tokenizer's post-processor does not already do it.
    prepend_bos: bool,
    /// Every id that decodes to something, sorted. Computed once because the inner tokenizer
    /// can only answer this by building its whole vocabulary map (and a `tokenizer.json` may
    /// leave gaps between ids, so a bound check is not enough).
    known_ids: Vec<u32>,
    vocab_size: usize,
    chat_template: Option<ChatTemplate>,
}

/// Token texts that end generation when they are added/special tokens of a vocabulary: the list
/// llama.cpp uses (`llama-vocab.cpp`), so that generation stops where llama.cpp stops for the
/// same model. That includes Qwen2.5-Coder's FIM/repo separators, which llama.cpp treats as end
/// of generation too. Unlike llama.cpp, ordinary vocabulary entries never qualify: Qwen's
/// vocabulary has "</s>" as plain text (an HTML tag), and llama.cpp's text match turns it into
/// a control token that ends generation and changes how "a</s>" tokenizes.
const END_OF_GENERATION_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
];

/// Facts gathered by a loader, turned into a [`Tokenizer`] by [`Tokenizer::assemble`].
struct TokenizerParts {
    inner: tokenizers::Tokenizer,
    bos_token_id: Option<u32>,
    eos_token_id: Option<u32>,
    extra_eos_token_ids: Vec<u32>,
    add_bos: bool,
    chat_template: Option<String>,
}

impl Tokenizer {
    /// Loads a Hugging Face `tokenizer.json` (or a directory holding one).
    ///
    /// Files beside it refine the result when present: `tokenizer_config.json` (`bos_token`,
    /// `eos_token`, `add_bos_token`, `chat_template`), `chat_template.jinja` (takes precedence
    /// over the config's template, as in `transformers`) and `generation_config.json`
    /// (`eos_token_id`, an integer or a list).
    pub fn from_file(path: &Path) -> Result<Self, TokenizerError> {
        hf_files::load(path).and_then(Self::assemble)
    }

    /// Builds the tokenizer described by GGUF metadata (see [`GgufTokenizerSpec`]).
    pub fn from_gguf_spec(spec: &GgufTokenizerSpec) -> Result<Self, TokenizerError> {
        gguf_spec::build(spec).and_then(Self::assemble)
    }

    fn assemble(parts: TokenizerParts) -> Result<Self, TokenizerError> {
        let TokenizerParts {
            inner,
            bos_token_id,
            eos_token_id,
            extra_eos_token_ids,
            add_bos,
            chat_template,
        } = parts;

        let vocab = inner.get_vocab(true);
        let vocab_size = vocab.len();
        let mut known_ids: Vec<u32> = vocab.values().copied().collect();
        known_ids.sort_unstable();

        let unknown_configured_id = bos_token_id
            .iter()
            .chain(&eos_token_id)
            .chain(&extra_eos_token_ids)
            .find(|id| known_ids.binary_search(id).is_err());
        if let Some(&id) = unknown_configured_id {
            return Err(TokenizerError::UnknownTokenId { id, vocab_size });
        }

        let added_tokens = inner.get_added_tokens_decoder();
        let end_of_generation_by_text = END_OF_GENERATION_TEXTS
            .iter()
            .filter_map(|text| vocab.get(*text).copied())
            .filter(|id| added_tokens.contains_key(id));
        let mut eos_token_ids: Vec<u32> = Vec::new();
        let candidates = eos_token_id
            .into_iter()
            .chain(extra_eos_token_ids)
            .chain(end_of_generation_by_text);
        for id in candidates {
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }

        // Only prepend BOS by hand when the inner post-processor does not already add it:
        // a Llama-3 tokenizer.json adds it itself, and adding it twice would shift every prompt.
        let prepend_bos = match (add_bos, bos_token_id) {
            (true, Some(bos)) => {
                let probe = inner
                    .encode("", true)
                    .map_err(|e| TokenizerError::Build(e.to_string()))?;
                probe.get_ids().first() != Some(&bos)
            }
            _ => false,
        };

        Ok(Self {
            inner,
            bos_token_id,
            eos_token_ids,
            prepend_bos,
            known_ids,
            vocab_size,
            chat_template: chat_template.map(ChatTemplate::new),
        })
    }

    /// Token ids for `text`. Special-token texts such as `<|im_start|>` always become their
    /// single token. `add_special_tokens` adds what the model expects around a sequence
    /// (e.g. a BOS for Llama 3; nothing for Qwen2.5).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| TokenizerError::Encode(e.to_string()))?;
        let ids = encoding.get_ids();
        match self.bos_token_id {
            Some(bos) if add_special_tokens && self.prepend_bos => {
                let mut with_bos = Vec::with_capacity(ids.len() + 1);
                with_bos.push(bos);
                with_bos.extend_from_slice(ids);
                Ok(with_bos)
            }
            _ => Ok(ids.to_vec()),
        }
    }

    /// Text for `ids`. Byte sequences that are not valid UTF-8 become U+FFFD. With
    /// `skip_special_tokens`, special (control) tokens such as `<|im_end|>` are left out.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        self.check_ids(ids)?;
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| TokenizerError::Decode(e.to_string()))
    }

    fn check_ids(&self, ids: &[u32]) -> Result<(), TokenizerError> {
        match ids
            .iter()
            .find(|id| self.known_ids.binary_search(id).is_err())
        {
            Some(&id) => Err(TokenizerError::UnknownTokenId {
                id,
                vocab_size: self.vocab_size,
            }),
            None => Ok(()),
        }
    }

    /// Number of distinct tokens, added/special tokens included. For a GGUF vocabulary this is
    /// the length of `tokenizer.ggml.tokens` (padding entries included).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Every id that ends generation: the configured EOS first, then the other end-of-turn /
    /// end-of-text tokens of this vocabulary (for Qwen2.5: `<|im_end|>`, `<|endoftext|>`, ...).
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token_id
    }

    pub fn token_to_id(&self, tok: &str) -> Option<u32> {
        self.inner.token_to_id(tok)
    }

    /// The vocabulary entry for `id` as stored (byte-level tokens keep their `Ġ`-style form);
    /// use [`Tokenizer::decode`] for text.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Renders `messages` with the model's chat template. See [`ChatMessage`] for what is
    /// supported.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        match &self.chat_template {
            None => Err(TokenizerError::NoChatTemplate),
            Some(template) => template.render(messages, add_generation_prompt),
        }
    }

    /// Whether [`Tokenizer::apply_chat_template`] can render chats for this model: a template
    /// is present and is of a kind this module implements.
    pub fn has_chat_template(&self) -> bool {
        self.chat_template
            .as_ref()
            .is_some_and(ChatTemplate::is_supported)
    }

    /// The chat template source as found in the model files, supported or not.
    pub fn chat_template_source(&self) -> Option<&str> {
        self.chat_template.as_ref().map(ChatTemplate::source)
    }

    /// Incremental detokenizer keeping special tokens, so that the streamed pieces concatenate
    /// to `decode(ids, false)`.
    pub fn decode_stream(&self) -> DecodeStream<'_> {
        DecodeStream::new(self, false)
    }

    /// Incremental detokenizer; its pieces concatenate to `decode(ids, skip_special_tokens)`.
    pub fn decode_stream_with(&self, skip_special_tokens: bool) -> DecodeStream<'_> {
        DecodeStream::new(self, skip_special_tokens)
    }

    /// The underlying `tokenizers` tokenizer, e.g. to save it as `tokenizer.json`.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("bos_token_id", &self.bos_token_id)
            .field("eos_token_ids", &self.eos_token_ids)
            .field("prepend_bos", &self.prepend_bos)
            .field("has_chat_template", &self.has_chat_template())
            .finish_non_exhaustive()
    }
}
