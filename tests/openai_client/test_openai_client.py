"""Drives a running `specula serve` with the official `openai` package.

Usage: python3 test_openai_client.py BASE_URL [CHAT_BASE_URL]
  BASE_URL: the embedded pair (no chat template); CHAT_BASE_URL: a server whose tokenizer has a ChatML
  template (the test uses tests/fixtures/chatml_tiny).
Exits non-zero on the first failed check.
"""

import sys

import openai

base_url = sys.argv[1]
client = openai.OpenAI(base_url=base_url, api_key="unused")
model = client.models.list().data[0].id
assert model == "specula-default", model

# Completion with usage.
c = client.completions.create(model=model, prompt="Once upon a time", max_tokens=10,
                              temperature=0.0)
assert c.choices[0].finish_reason in ("length", "stop"), c
assert c.usage.completion_tokens >= 1 and c.usage.prompt_tokens >= 1, c.usage
text = c.choices[0].text

# Streaming gives the same text, chunk by chunk.
streamed = "".join(
    chunk.choices[0].text
    for chunk in client.completions.create(model=model, prompt="Once upon a time",
                                           max_tokens=10, temperature=0.0, stream=True)
    if chunk.choices
)
assert streamed == text, (streamed, text)

# Seed reproducibility at temperature > 0.
def sampled(seed):
    return client.completions.create(model=model, prompt="The king said", max_tokens=12,
                                     temperature=0.9, seed=seed).choices[0].text

assert sampled(11) == sampled(11)

# Chat: the embedded tokenizer has no chat template, which the server reports as a clear 400.
try:
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    raise AssertionError("chat should be refused without a chat template")
except openai.BadRequestError as e:
    assert "chat template" in str(e), e

# Error cases surface as the client's typed exceptions.
try:
    client.completions.create(model="no-such-model", prompt="a", max_tokens=3)
    raise AssertionError("unknown model accepted")
except openai.NotFoundError:
    pass
try:
    client.completions.create(model=model, prompt="a", max_tokens=3, top_p=1.5)
    raise AssertionError("top_p 1.5 accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400

# Chat on a model with a ChatML template: plain, streamed (same text), and seeded.
if len(sys.argv) > 2:
    chat = openai.OpenAI(base_url=sys.argv[2], api_key="unused")
    chat_model = chat.models.list().data[0].id
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    r = chat.chat.completions.create(model=chat_model, messages=messages, max_tokens=8, temperature=0.0)
    assert r.choices[0].message.role == "assistant", r
    assert r.usage.prompt_tokens > 10 and 1 <= r.usage.completion_tokens <= 8, r.usage
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in chat.chat.completions.create(model=chat_model, messages=messages, max_tokens=8,
                                                  temperature=0.0, stream=True)
        if chunk.choices
    )
    assert streamed == r.choices[0].message.content, (streamed, r.choices[0].message.content)
    s1 = chat.chat.completions.create(model=chat_model, messages=messages, max_tokens=8, temperature=1.0, seed=5)
    s2 = chat.chat.completions.create(model=chat_model, messages=messages, max_tokens=8, temperature=1.0, seed=5)
    assert s1.choices[0].message.content == s2.choices[0].message.content

print("openai client: completion, streaming, seeds, chat (ChatML model and refusal), errors: ok")
