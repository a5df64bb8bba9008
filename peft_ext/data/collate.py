"""Batch builders that turn task examples into model inputs: text classification (:class:`TextCollator`) and
instruction tasks for causal LMs (:class:`CausalLMCollator`, with :class:`AsciiTokenizer` for tiny test models)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from .tasks import Example, Instruction


class TextCollator:
    """Tokenize a list of text examples with dynamic padding (to the longest in the batch, at most ``max_length``).

    Args:
        tokenizer: A transformers tokenizer.
        max_length: Truncation length in tokens.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_length: int = 64) -> None:
        if max_length < 2:
            raise ValueError(f"`max_length` must be >= 2 tokens, got {max_length}")
        self.tokenizer = tokenizer
        self.max_length = max_length

    def __call__(self, examples: Sequence[Example]) -> dict[str, Any]:
        from .user_data import Tokenized

        inputs = [ex.inputs for ex in examples]
        if inputs and all(isinstance(t, Tokenized) for t in inputs):
            # tokenized once for the whole run (peft_ext.data.user_data.tokenize_sequence): pad only
            ids = [{"input_ids": list(t.input_ids[: self.max_length])} for t in inputs]
            enc = self.tokenizer.pad(ids, padding=True, return_tensors="pt")
        else:
            bad = [t for t in inputs if not isinstance(t, str)]
            if bad:
                raise TypeError(f"TextCollator needs string (or Tokenized) inputs, got {type(bad[0]).__name__}")
            enc = self.tokenizer(
                inputs, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
            )
        return {
            "input_ids": enc["input_ids"],
            "attention_mask": enc["attention_mask"],
            "labels": torch.tensor([ex.label for ex in examples], dtype=torch.long),
        }


class AsciiTokenizer:
    """A character-level tokenizer over printable ASCII for tiny test models (vocabulary 128).

    Ids 0-3 are special (pad, bos, eos, separator); every printable character (space to ``~``) is its own code point.
    It has what :class:`CausalLMCollator` needs of a tokenizer: ``encode``, ``decode``, ``pad_token_id``,
    ``eos_token_id`` and a separator id.
    """

    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2
    sep_token_id = 3
    vocab_size = 128

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``'s characters (no special tokens)."""
        bad = sorted({c for c in text if not " " <= c <= "~"})
        if bad:
            raise ValueError(f"AsciiTokenizer encodes printable ASCII (' ' to '~') only, got {bad} in {text!r}")
        return [ord(c) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``; special ids are dropped."""
        return "".join(chr(i) for i in ids if 32 <= i < 127)


class CausalLMCollator:
    """Batches instruction examples (``Example(Instruction(prompt, answer), label)``) for a causal LM.

    A training sequence is ``prompt ids + [separator] + answer ids + [eos]``, right-padded, with ``labels`` equal to
    ``input_ids`` on the answer and eos tokens and -100 on the prompt, the separator and padding (the loss sees the
    answer only; labels are aligned with the inputs, as transformers' causal LMs take them). :meth:`prompts` builds
    the generation inputs, ``prompt ids + [separator]`` left-padded so that every row's next token is its first
    answer token. The separator marks where a prompt ends, which is what PCLR's prompt routing reads
    (:func:`peft_ext.continual.generation.prompt_query`: the tokens up to the row's last separator).

    With ``chat_template=True`` a prompt is the user turn of a chat, rendered by the tokenizer's chat template with
    the assistant's turn opened (``apply_chat_template(..., add_generation_prompt=True)``), and the answer follows as
    the assistant's reply, ended by eos: the format a chat model was tuned on, so its zero-shot answers mean
    something. No separator is appended then: the one the template writes where the assistant's turn opens (for
    ChatML, ``<|im_start|>``) ends the prompt; it must occur in every rendered prompt and in no answer.

    Args:
        tokenizer: :class:`AsciiTokenizer`, or a transformers tokenizer (encoded without special tokens).
        max_length: Longest training sequence in tokens; a longer example is an error (truncating would cut the
            answer).
        separator_id: Token that ends every prompt and appears nowhere inside one (default: the tokenizer's
            ``sep_token_id``; for a transformers tokenizer pick a special token, e.g. Qwen2.5's ``<|im_end|>``; with
            ``chat_template``, default: the first token of the template's assistant-turn opening).
        max_new_tokens: Generation budget per answer when scoring (default: the longest answer of the batch + eos).
        chat_template: Render each prompt as a chat's user turn with the tokenizer's chat template (above).
        system_prompt: With ``chat_template``: the system message put before every prompt (``None``: the
            template's own default, if it has one).
    """

    def __init__(
        self,
        tokenizer: Any,
        max_length: int = 64,
        separator_id: int | None = None,
        max_new_tokens: int | None = None,
        chat_template: bool = False,
        system_prompt: str | None = None,
    ) -> None:
        if max_length < 3:
            raise ValueError(f"`max_length` must be >= 3 tokens (prompt, separator, eos), got {max_length}")
        if max_new_tokens is not None and (isinstance(max_new_tokens, bool) or max_new_tokens < 1):
            raise ValueError(f"`max_new_tokens` must be a positive integer or None, got {max_new_tokens!r}")
        self.max_new_tokens = max_new_tokens
        self.chat_template = bool(chat_template)
        if system_prompt is not None and not self.chat_template:
            raise ValueError("`system_prompt` is a message of the chat template: set `chat_template=True` with it")
        self.system_prompt = system_prompt
        if self.chat_template and separator_id is None:
            separator_id = assistant_turn_token(tokenizer)
        separator_id = getattr(tokenizer, "sep_token_id", None) if separator_id is None else separator_id
        if separator_id is None:
            raise ValueError(f"{type(tokenizer).__name__} has no sep_token_id; pass `separator_id=` (a special token)")
        if getattr(tokenizer, "eos_token_id", None) is None:
            raise ValueError(f"{type(tokenizer).__name__} has no eos_token_id; answers must end with one")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.separator_id = int(separator_id)
        self.eos_token_id = int(tokenizer.eos_token_id)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = self.eos_token_id if pad is None else int(pad)
        if self.separator_id in (self.eos_token_id, self.pad_token_id):
            raise ValueError(
                f"`separator_id` {self.separator_id} is the tokenizer's eos or pad id; pick a token that only ends "
                "prompts (e.g. an unused special token)"
            )

    def render(self, prompt: str) -> list[int]:
        """The token ids of ``prompt`` as the model reads it: the chat template's rendering (``chat_template``), else
        its ids followed by the separator."""
        if not self.chat_template:
            return self.encode(prompt) + [self.separator_id]
        return chat_prompt_ids(self.tokenizer, prompt, self.system_prompt)

    def encode(self, text: str) -> list[int]:
        """``text``'s token ids, without special tokens."""
        if isinstance(self.tokenizer, PreTrainedTokenizerBase):
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return list(self.tokenizer.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` up to the first eos (special tokens dropped)."""
        ids = list(ids)
        if self.eos_token_id in ids:
            ids = ids[: ids.index(self.eos_token_id)]
        if isinstance(self.tokenizer, PreTrainedTokenizerBase):
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids)

    def length(self, example: Example) -> int:
        """Tokens ``example`` takes in a training row: prompt, separator, answer and eos (``max_length`` caps it)."""
        return len(self.render(example.inputs.prompt)) + len(self.encode(example.inputs.answer)) + 1

    def _parts(self, example: Example) -> tuple[list[int], list[int]]:
        if not isinstance(example.inputs, Instruction):
            raise TypeError(
                f"CausalLMCollator needs Example(Instruction(prompt, answer), label), got inputs of type "
                f"{type(example.inputs).__name__}"
            )
        prompt = self.render(example.inputs.prompt)
        answer = self.encode(example.inputs.answer)
        if not answer:
            raise ValueError(f"the answer {example.inputs.answer!r} encodes to no tokens; answers must be non-empty")
        if self.separator_id in answer:
            raise ValueError(f"answer {example.inputs.answer!r} contains the separator id {self.separator_id}")
        if self.chat_template:
            if self.separator_id not in prompt:
                raise ValueError(
                    f"the chat rendering of prompt {example.inputs.prompt!r} does not contain the separator id "
                    f"{self.separator_id}; pass the id of the token that opens the assistant's turn"
                )
        elif self.separator_id in prompt[:-1]:
            raise ValueError(f"prompt {example.inputs.prompt!r} contains the separator id {self.separator_id}")
        if len(prompt) + len(answer) + 1 > self.max_length:
            raise ValueError(
                f"example {example.inputs!r} needs {len(prompt) + len(answer) + 1} tokens, over `max_length`="
                f"{self.max_length}; raise max_length (answers are never truncated)"
            )
        return prompt, answer + [self.eos_token_id]

    def __call__(self, examples: Sequence[Example]) -> dict[str, Any]:
        parts = [self._parts(ex) for ex in examples]
        width = max(len(p) + len(a) for p, a in parts)
        ids = torch.full((len(parts), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full_like(ids, -100)
        mask = torch.zeros_like(ids)
        for row, (prompt, answer) in enumerate(parts):
            n = len(prompt) + len(answer)
            ids[row, :n] = torch.tensor(prompt + answer)
            labels[row, len(prompt) : n] = torch.tensor(answer)
            mask[row, :n] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    def prompts(self, examples: Sequence[Example]) -> dict[str, torch.Tensor]:
        """The generation inputs of ``examples``: prompt and separator, left-padded (``input_ids``,
        ``attention_mask``)."""
        prompts = [self._parts(ex)[0] for ex in examples]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        return {"input_ids": ids, "attention_mask": mask}

    def answer_budget(self, examples: Sequence[Example]) -> int:
        """Tokens to generate for ``examples``: ``max_new_tokens`` when set (the same budget whatever the answers,
        as a deployed model has), else the longest answer plus its eos."""
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        return max(len(self._parts(ex)[1]) for ex in examples)


def chat_prompt_ids(tokenizer: Any, prompt: str, system_prompt: str | None = None) -> list[int]:
    """The ids of ``prompt`` as a chat's user turn, the assistant's turn opened (``tokenizer``'s chat template).

    Raises:
        ValueError: The tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{type(tokenizer).__name__} has no chat template; use `chat_template=False` (prompt + separator)"
        )
    messages = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    messages.append({"role": "user", "content": prompt})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def assistant_turn_token(tokenizer: Any) -> int:
    """The first token the chat template writes to open the assistant's turn (ChatML: ``<|im_start|>``): the
    separator of a chat-rendered prompt.

    Raises:
        ValueError: The tokenizer has no chat template, or its generation prompt adds no token.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{type(tokenizer).__name__} has no chat template to find the assistant's turn in")
    messages = [{"role": "user", "content": "x"}]
    closed = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    opened = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not opened.startswith(closed) or opened == closed:
        raise ValueError("the chat template's generation prompt does not extend the conversation; pass `separator_id`")
    ids = tokenizer(opened[len(closed) :], add_special_tokens=False)["input_ids"]
    return int(ids[0])
