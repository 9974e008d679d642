//! Tokenizer (placeholder: being written in the tokenizer branch).

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("{0}")]
    Invalid(String),
}
