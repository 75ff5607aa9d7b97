"""SFTTokenizer: a conversation -> its token ids and which of them are the assistant's.

Megatron-LM's SFTTokenizer (--tokenizer-type SFTTokenizer,
--sft-tokenizer-prompt-format) renders a conversation with a Jinja chat
template and tokenizes the text. mp does the same with the tokenizer.json of
a HuggingFaceTokenizer and one of these prompt formats:

- "default": the tokenizer's own chat template (tokenizer_config.json's
  "chat_template", or chat_template.jinja beside it);
- "nemotron-h-aligned" (Megatron's default), "nemotron-nano-v2", "identity":
  Megatron's named formats, the same text for the same messages.

Rendering is transformers' (`apply_chat_template(tokenize=False)`: its
sandboxed Jinja environment, the tokenizer's special tokens as variables;
`pip install 'mp-data[sft]'`); tokenizing is the tokenizer.json's, special
tokens matched and none added, which gives transformers' ids.

**Which tokens are the assistant's.** For each assistant message k the text
rendered for messages[:k] with the generation prompt must be a prefix of the
text for messages[:k+1], itself a prefix of the whole conversation's; the
characters between the two are the assistant's: its content and whatever
the template closes the turn with (an end-of-turn token, a newline), never
the role header the generation prompt holds. A token is the assistant's
when its first character is. A template that rewrites earlier turns (one
that drops past reasoning, say) has no such prefixes and is refused, naming
the message. Megatron's named formats mask as Megatron does (the nano-v2
header is the generation prompt here); with "default" Megatron trains on every
token, mp on the assistant's only.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

from mp_data.tokenizers.huggingface import HuggingFaceTokenizer

__all__ = ["SFT_PROMPT_FORMATS", "SFTTokenizer"]

SFT_PROMPT_FORMATS: dict[str, str | None] = {
    "default": None,
    # The user's turn ends with the assistant's header: the assistant's text is its answer.
    "nemotron-h-aligned": (
        "{% for m in messages %}{% set text = m['content'].strip() %}"
        "{% if m['role'] == 'system' %}{{ '<SPECIAL_10>System\\n' + text + '\\n' }}"
        "{% elif m['role'] == 'user' %}"
        "{{ '<SPECIAL_11>User\\n' + text + '\\n<SPECIAL_11>Assistant\\n' }}"
        "{% elif m['role'] == 'assistant' %}{{ text + '\\n' }}"
        "{% endif %}{% endfor %}"
    ),
    # The assistant's header opens its turn, and is the generation prompt.
    "nemotron-nano-v2": (
        "{% for m in messages %}"
        "{% set text = m['content'].replace('/think', '').replace('/no_think', '').strip() %}"
        "{% if m['role'] == 'system' %}{{ '<SPECIAL_10>System\\n' + text + '\\n' }}"
        "{% elif m['role'] == 'user' %}{{ '<SPECIAL_11>User\\n' + text + '\\n' }}"
        "{% elif m['role'] == 'assistant' %}"
        "{{ '<SPECIAL_11>Assistant\\n' + m['content'].strip() + '\\n<SPECIAL_12>\\n' }}"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<SPECIAL_11>Assistant\\n' }}{% endif %}"
    ),
    "identity": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
}
"""Prompt format -> its Jinja template (None: the tokenizer's own chat template)."""


class SFTTokenizer(HuggingFaceTokenizer):
    """A HuggingFaceTokenizer (same ids, eod, pad for text) that tokenizes conversations."""

    def __init__(self, path: str | os.PathLike, prompt_format: str = "nemotron-h-aligned") -> None:
        if prompt_format not in SFT_PROMPT_FORMATS:
            raise ValueError(f"sft_tokenizer_prompt_format={prompt_format!r} is not one of "
                             f"{', '.join(SFT_PROMPT_FORMATS)}")  # fmt: skip
        super().__init__(path)
        self.prompt_format = prompt_format
        self._renderer = _load_transformers_tokenizer(os.path.dirname(self.path))
        template = SFT_PROMPT_FORMATS[prompt_format]
        if template is None:
            template = self._renderer.chat_template
            if not isinstance(template, str):
                raise ValueError(
                    f"{os.path.dirname(self.path)}: sft_tokenizer_prompt_format='default' needs "
                    'the tokenizer\'s chat template ("chat_template" in tokenizer_config.json or '
                    "a chat_template.jinja file); none is there"
                )
        self.chat_template = template
        digest = hashlib.sha256(template.encode()).hexdigest()
        self.identity = f"SFTTokenizer:{prompt_format}:template-sha256={digest}:{self.identity}"

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The text of `messages` in this prompt format."""
        return self._renderer.apply_chat_template(
            messages, chat_template=self.chat_template, tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )  # fmt: skip

    def tokenize_conversation(self, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        """(ids int32 [n], assistant bool [n]) of one conversation (module docstring)."""
        text = self.render(messages)
        spans = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:k], add_generation_prompt=True)
            through = self.render(messages[: k + 1])
            if not (through.startswith(before) and text.startswith(through)):
                raise ValueError(
                    f"message {k} (assistant): the {self.prompt_format!r} chat template does not "
                    "render the conversation as a growing text (the text before this message, "
                    "with the generation prompt, is not a prefix of the text through it, or that "
                    "is not a prefix of the whole); its assistant tokens cannot be told apart"
                )
            spans.append((len(before), len(through)))
        encoding = self.backend.encode(text, add_special_tokens=False)
        ids = np.asarray(encoding.ids, dtype=np.int32)
        starts = np.asarray([start for start, _ in encoding.offsets], dtype=np.int64)
        assistant = np.zeros(len(ids), dtype=bool)
        for lo, hi in spans:
            assistant |= (starts >= lo) & (starts < hi)
        return ids, assistant


def _load_transformers_tokenizer(folder: str):
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError as error:
        raise ImportError(
            f"SFT data needs transformers to render chat templates ({error}): "
            "pip install 'mp-data[sft]'"
        ) from None
    # The tokenizer's files only: the backend class a tokenizer_config.json may name
    # (LlamaTokenizer, ...) tokenizes the same tokenizer.json.
    return PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)
