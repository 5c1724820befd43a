"""Chat prompts: a conversation rendered with the model's chat template (or an override)."""

from __future__ import annotations

from typing import Any


def apply_chat_template(tokenizer: Any, conversation: list[dict[str, Any]], *,
                        add_generation_prompt: bool = True, chat_template: str | None = None,
                        chat_template_kwargs: dict[str, Any] | None = None
                        ) -> tuple[str, list[int]]:
    """(prompt text, token ids). The template comes from the model (tokenizer_config.json,
    chat_template.jinja or GGUF metadata) unless ``chat_template`` overrides it; the extra
    ``chat_template_kwargs`` reach the template as variables. ValueError when there is no
    template or it fails to render."""
    kwargs = dict(chat_template_kwargs or {})
    for reserved in ("tokenize", "conversation", "messages", "chat_template",
                     "add_generation_prompt"):
        if reserved in kwargs:
            raise ValueError(f"chat_template_kwargs must not set {reserved!r}.")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model has no chat template; pass chat_template.")
    try:
        text = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
            chat_template=chat_template, **kwargs)
    except Exception as e:  # jinja2 errors, a template that raises
        raise ValueError(f"cannot apply the chat template: {e}") from e
    # The template already placed the special tokens it wants (BOS included).
    return text, list(tokenizer(text, add_special_tokens=False).input_ids)
