//! Chat templates. Models ship Jinja templates; rather than embed a Jinja engine, the known
//! template families are recognised and rendered natively, and anything else is refused with a
//! clear error.
//!
//! Implemented: ChatML (`<|im_start|>{role}\n{content}<|im_end|>\n`), used by Qwen and others.
//! Its Qwen2/Qwen2.5 variant inserts a default system message when the chat has none (the
//! literal text is read from the template, e.g. Qwen2.5's "You are Qwen, created by Alibaba
//! Cloud. You are a helpful assistant.") and wraps runs of `tool` messages in one user turn as
//! `<tool_response>` blocks. Tool definitions, assistant tool calls and thinking sections are
//! not modelled: [`ChatMessage`] carries plain text only.

use super::TokenizerError;

/// One chat turn: `role` is "system", "user", "assistant" or "tool".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }

    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

const SUPPORTED_ROLES: &str = "system, user, assistant and tool";

#[derive(Debug, Clone, PartialEq)]
enum TemplateKind {
    ChatMl {
        /// Emitted as a first system turn when the chat does not start with one.
        default_system_prompt: Option<String>,
        /// Consecutive `tool` messages become one user turn of `<tool_response>` blocks
        /// (Qwen2.5); otherwise a tool message is an ordinary `tool` turn.
        tool_responses_in_user_turn: bool,
    },
    Unsupported,
}

#[derive(Debug, Clone)]
pub(super) struct ChatTemplate {
    source: String,
    kind: TemplateKind,
}

impl ChatTemplate {
    pub(super) fn new(source: String) -> Self {
        let kind = if source.contains("<|im_start|>") && source.contains("<|im_end|>") {
            TemplateKind::ChatMl {
                default_system_prompt: find_default_system_prompt(&source),
                tool_responses_in_user_turn: source.contains("<tool_response>"),
            }
        } else {
            TemplateKind::Unsupported
        };
        Self { source, kind }
    }

    pub(super) fn source(&self) -> &str {
        &self.source
    }

    pub(super) fn is_supported(&self) -> bool {
        self.kind != TemplateKind::Unsupported
    }

    pub(super) fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        match &self.kind {
            TemplateKind::ChatMl {
                default_system_prompt,
                tool_responses_in_user_turn,
            } => render_chatml(
                messages,
                add_generation_prompt,
                default_system_prompt.as_deref(),
                *tool_responses_in_user_turn,
            ),
            TemplateKind::Unsupported => Err(TokenizerError::UnsupportedChatTemplate {
                excerpt: self.source.chars().take(120).collect(),
            }),
        }
    }
}

fn render_chatml(
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    default_system_prompt: Option<&str>,
    tool_responses_in_user_turn: bool,
) -> Result<String, TokenizerError> {
    if messages.is_empty() {
        return Err(TokenizerError::EmptyChat);
    }
    if let Some((index, message)) = messages
        .iter()
        .enumerate()
        .find(|(_, m)| !matches!(m.role.as_str(), "system" | "user" | "assistant" | "tool"))
    {
        return Err(TokenizerError::UnsupportedChatRole {
            index,
            role: message.role.clone(),
            supported: SUPPORTED_ROLES,
        });
    }

    let mut out = String::new();
    if let (Some(prompt), false) = (default_system_prompt, messages[0].role == "system") {
        push_turn(&mut out, "system", prompt);
    }
    for (index, message) in messages.iter().enumerate() {
        if message.role == "tool" && tool_responses_in_user_turn {
            let previous_is_tool = index > 0 && messages[index - 1].role == "tool";
            let next_is_tool = messages.get(index + 1).is_some_and(|m| m.role == "tool");
            if !previous_is_tool {
                out.push_str("<|im_start|>user");
            }
            out.push_str("\n<tool_response>\n");
            out.push_str(&message.content);
            out.push_str("\n</tool_response>");
            if !next_is_tool {
                out.push_str("<|im_end|>\n");
            }
        } else {
            push_turn(&mut out, &message.role, &message.content);
        }
    }
    if add_generation_prompt {
        out.push_str("<|im_start|>assistant\n");
    }
    Ok(out)
}

fn push_turn(out: &mut String, role: &str, content: &str) {
    out.push_str("<|im_start|>");
    out.push_str(role);
    out.push('\n');
    out.push_str(content);
    out.push_str("<|im_end|>\n");
}

/// Finds a literal default system turn such as
/// `'<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n'` in a Jinja source. Turns
/// built from variables (`'<|im_start|>system\n' + messages[0]['content']`) are skipped: the
/// text up to `<|im_end|>` must not leave the string literal.
fn find_default_system_prompt(source: &str) -> Option<String> {
    // Inside a Jinja string literal the newline is written `\n`; a template may also hold a
    // real newline there.
    for marker in ["<|im_start|>system\\n", "<|im_start|>system\n"] {
        let mut rest = source;
        while let Some(at) = rest.find(marker) {
            rest = &rest[at + marker.len()..];
            if let Some(end) = rest.find("<|im_end|>") {
                let candidate = &rest[..end];
                let leaves_literal = candidate.contains(['\'', '"', '{', '}', '\\']);
                if !leaves_literal {
                    return Some(candidate.to_string());
                }
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_literal_default_system_prompt_only() {
        let qwen25 = r#"{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}{%- else %}{{- '<|im_start|>system\nYou are Qwen.<|im_end|>\n' }}{%- endif %}"#;
        assert_eq!(
            find_default_system_prompt(qwen25).as_deref(),
            Some("You are Qwen.")
        );
        let plain = r#"{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"#;
        assert_eq!(find_default_system_prompt(plain), None);
    }

    #[test]
    fn plain_chatml_without_default_system() {
        let template = ChatTemplate::new(
            "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n'}}{% endfor %}"
                .to_string(),
        );
        assert!(template.is_supported());
        let text = template
            .render(
                &[ChatMessage::user("hi"), ChatMessage::new("tool", "42")],
                true,
            )
            .unwrap();
        assert_eq!(
            text,
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn unknown_template_and_role_are_errors() {
        let llama = ChatTemplate::new("{{ '<|start_header_id|>' }}".to_string());
        assert!(!llama.is_supported());
        assert!(matches!(
            llama.render(&[ChatMessage::user("x")], false),
            Err(TokenizerError::UnsupportedChatTemplate { .. })
        ));
        let chatml = ChatTemplate::new("<|im_start|><|im_end|>".to_string());
        assert!(matches!(
            chatml.render(&[ChatMessage::new("developer", "x")], false),
            Err(TokenizerError::UnsupportedChatRole { index: 0, .. })
        ));
        assert!(matches!(
            chatml.render(&[], true),
            Err(TokenizerError::EmptyChat)
        ));
    }
}
