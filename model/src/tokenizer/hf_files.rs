//! Loading a Hugging Face `tokenizer.json` and the config files that sit beside it.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::{TokenizerError, TokenizerParts};

const TOKENIZER_FILE: &str = "tokenizer.json";
const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";
const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";
const GENERATION_CONFIG_FILE: &str = "generation_config.json";

pub(super) fn load(path: &Path) -> Result<TokenizerParts, TokenizerError> {
    let tokenizer_path = if path.is_dir() {
        path.join(TOKENIZER_FILE)
    } else {
        path.to_path_buf()
    };
    let bytes = std::fs::read(&tokenizer_path).map_err(|source| TokenizerError::Io {
        path: tokenizer_path.clone(),
        source,
    })?;
    let inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| {
        TokenizerError::InvalidTokenizerFile {
            path: tokenizer_path.clone(),
            message: e.to_string(),
        }
    })?;
    let dir = tokenizer_path.parent().unwrap_or(Path::new("."));

    let mut parts = TokenizerParts {
        inner,
        bos_token_id: None,
        eos_token_id: None,
        extra_eos_token_ids: Vec::new(),
        add_bos: false,
        chat_template: None,
    };

    let config_path = dir.join(TOKENIZER_CONFIG_FILE);
    if let Some(config) = read_json_if_present(&config_path)? {
        parts.bos_token_id = special_token_id(&parts.inner, &config_path, &config, "bos_token")?;
        parts.eos_token_id = special_token_id(&parts.inner, &config_path, &config, "eos_token")?;
        parts.add_bos = match config.get("add_bos_token") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(add)) => *add,
            Some(other) => {
                return Err(config_error(
                    &config_path,
                    format!("`add_bos_token` should be a bool, found {other}"),
                ))
            }
        };
        parts.chat_template = chat_template_from_config(&config_path, &config)?;
    }

    let template_path = dir.join(CHAT_TEMPLATE_FILE);
    match std::fs::read_to_string(&template_path) {
        Ok(template) => parts.chat_template = Some(template),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => {
            return Err(TokenizerError::Io {
                path: template_path,
                source,
            })
        }
    }

    let generation_path = dir.join(GENERATION_CONFIG_FILE);
    if let Some(generation) = read_json_if_present(&generation_path)? {
        let ids = match generation.get("eos_token_id") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(values)) => values
                .iter()
                .map(|v| json_token_id(&generation_path, v))
                .collect::<Result<_, _>>()?,
            Some(value) => vec![json_token_id(&generation_path, value)?],
        };
        // The tokenizer config's EOS stays primary; generation_config adds to the stop set.
        if parts.eos_token_id.is_none() {
            parts.eos_token_id = ids.first().copied();
        }
        parts.extra_eos_token_ids = ids;
    }

    Ok(parts)
}

fn read_json_if_present(path: &Path) -> Result<Option<Value>, TokenizerError> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(TokenizerError::Io {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|source| TokenizerError::InvalidJson {
            path: path.to_path_buf(),
            source,
        })
}

fn config_error(path: &Path, message: String) -> TokenizerError {
    TokenizerError::InvalidConfig {
        path: PathBuf::from(path),
        message,
    }
}

/// `bos_token` / `eos_token` are either the token text or an `AddedToken` object with a
/// `content` field; `null` means the model has none.
fn special_token_id(
    tokenizer: &tokenizers::Tokenizer,
    path: &Path,
    config: &Value,
    field: &str,
) -> Result<Option<u32>, TokenizerError> {
    let text = match config.get(field) {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(text)) => text.as_str(),
        Some(Value::Object(token)) => match token.get("content") {
            Some(Value::String(text)) => text.as_str(),
            _ => {
                return Err(config_error(
                    path,
                    format!("`{field}` is an object without a string `content`"),
                ))
            }
        },
        Some(other) => {
            return Err(config_error(
                path,
                format!("`{field}` should be a token string, found {other}"),
            ))
        }
    };
    tokenizer.token_to_id(text).map(Some).ok_or_else(|| {
        config_error(
            path,
            format!("`{field}` is {text:?}, which is not in the tokenizer's vocabulary"),
        )
    })
}

/// `chat_template` is a string, or a list of `{name, template}` of which "default" is the one
/// used for plain chats.
fn chat_template_from_config(
    path: &Path,
    config: &Value,
) -> Result<Option<String>, TokenizerError> {
    match config.get("chat_template") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(template)) => Ok(Some(template.clone())),
        Some(Value::Array(named)) => {
            let default = named
                .iter()
                .find(|entry| entry.get("name").and_then(Value::as_str) == Some("default"));
            match default
                .and_then(|entry| entry.get("template"))
                .and_then(Value::as_str)
            {
                Some(template) => Ok(Some(template.to_string())),
                None => Err(config_error(
                    path,
                    "`chat_template` is a list without a \"default\" template".to_string(),
                )),
            }
        }
        Some(other) => Err(config_error(
            path,
            format!("`chat_template` should be a string, found {other}"),
        )),
    }
}

fn json_token_id(path: &Path, value: &Value) -> Result<u32, TokenizerError> {
    value
        .as_u64()
        .and_then(|id| u32::try_from(id).ok())
        .ok_or_else(|| {
            config_error(
                path,
                format!("`eos_token_id` entry {value} is not a token id"),
            )
        })
}
