"""Chat prompts: a conversation rendered with the model's chat template (or an override)."""

from __future__ import annotations

from typing import Any

from raylm.cluster.engine.processor import check_text


def apply_chat_template(tokenizer: Any, conversation: list[dict[str, Any]], *,
                        add_generation_prompt: bool = True, chat_template: str | None = None,
                        chat_template_kwargs: dict[str, Any] | None = None,
                        tools: list[dict[str, Any]] | None = None,
                        continue_final_message: bool = False) -> tuple[str, list[int]]:
    """(prompt text, token ids). The template comes from the model (tokenizer_config.json,
    chat_template.jinja or GGUF metadata) unless ``chat_template`` overrides it; the extra
    ``chat_template_kwargs`` reach the template as variables, ``tools`` (OpenAI's function
    definitions) as transformers' ``tools``: a template that has no use for them ignores
    them. Messages may carry ``tool_calls`` (an assistant's) and ``tool_call_id`` (a tool's
    answer), as transformers' templates read them. ValueError when there is no template,
    it fails to render, or the text is not valid Unicode."""
    kwargs = dict(chat_template_kwargs or {})
    for reserved in ("tokenize", "conversation", "messages", "chat_template",
                     "add_generation_prompt", "tools", "continue_final_message"):
        if reserved in kwargs:
            raise ValueError(f"chat_template_kwargs must not set {reserved!r}.")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model has no chat template; pass chat_template.")
    try:
        text = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, chat_template=chat_template,
            tools=tools, **kwargs)
    except Exception as e:  # jinja2 errors, a template that raises
        raise ValueError(f"cannot apply the chat template: {e}") from e
    check_text(text, "messages")
    # The template already placed the special tokens it wants (BOS included).
    return text, list(tokenizer(text, add_special_tokens=False).input_ids)
