"""Tiny random models for tests that need what the embedded model lacks: a tool-capable chat
template (Qwen2.5's, with Qwen3's `enable_thinking` switch), or a Hugging Face cache layout.

The tokenizer is the embedded SmolLM2 one (its `<|im_start|>`/`<|im_end|>` tokens are what the
Qwen template writes); the weights are random, so outputs are arbitrary but deterministic.
"""

from __future__ import annotations

from pathlib import Path

QWEN_TOOL_TEMPLATE = """
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
""".strip()

# The layer shapes of the tests' tiny random models (GQA: 4 heads over 2 KV heads).
TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
TINY_QWEN2 = dict(TINY_SHAPE, max_position_embeddings=2048, tie_word_embeddings=True)


def save_tiny_tool_model(directory: Path, seed: int = 0, num_layers: int = 2) -> Path:
    """A random Qwen2 model with the embedded tokenizer and a tool-capable chat template."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config

    from common.model.source import resolve_model
    from common.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(None).directory)
    tokenizer.chat_template = QWEN_TOOL_TEMPLATE
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    shape = dict(TINY_QWEN2, num_hidden_layers=num_layers)
    config = Qwen2Config(vocab_size=len(tokenizer), eos_token_id=eos, **shape)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    GenerationConfig(eos_token_id=eos).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def hub_cache_layout(cache: Path, repo_id: str, source: Path, revision: str = "0" * 40) -> Path:
    """Put the files of `source` where huggingface_hub keeps `repo_id`'s snapshot:
    `cache/models--org--name/snapshots/<revision>/` with `refs/main` naming the revision."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for file in source.iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot
