"""The numbers of docs/smollm2.md: SmolLM2-135M-Instruct's load times, held-out perplexity against a unigram model,
and three greedy chat answers.

- Load time: ``load_causal_lm("smollm2-135m")`` into an empty cache (the one-time conversion from the GGUF, then the
  load) and again from that cache, each in this process (``--no-conversion`` times the cached load only, from the
  default cache).
- Perplexity per token on two shipped domains (``peft_ext/data/files``): 200 fortunes of the test split of
  :mod:`peft_ext.data.fortunes` and 200 WordNet 3.0 definitions of the test split of :mod:`peft_ext.data.wordnet`, each
  picked evenly spaced through the split in id order (every topic and part of speech). A text is the fortune, or the
  definition alone, cut to ``--max-tokens`` tokens. SmolLM2 reads ``<|endoftext|>`` (its document separator) and
  then the text, and every token of the text is scored; the unigram model scores the same tokens. Perplexity is
  ``exp`` of the mean negative log-likelihood over all scored tokens of the domain.
- The unigram baseline: token frequencies with add-one smoothing over the whole vocabulary (49,152 tokens), counted
  with the same tokenizer on the *train* split of the same domain (2,938 fortunes; 93,984 definitions), so it never
  saw the texts it scores. It is the floor a language model must clear: what knowing nothing but word frequencies
  gives.
- Three chat prompts, answered greedily (the chat template, KV cache, at most 48 new tokens).

"Held out" is with respect to the unigram fit: WordNet and the fortune files are public text that SmolLM2's
pretraining corpus may well contain.

Usage (about 2 minutes on one shared CPU core, the conversion included)::

    python -m benchmarks.smollm2_card
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from collections import Counter
from collections.abc import Sequence

import torch

from peft_ext.data.fortunes import read_fortune_file
from peft_ext.data.wordnet import read_gloss_file
from peft_ext.models import load_causal_lm

HELD_OUT = 200
PROMPTS = (
    "What is the capital of France?",
    "What does the word 'ephemeral' mean?",
    "What is 12 + 7?",
)


def evenly_spaced(items: Sequence, n: int) -> list:
    """``n`` items spread evenly through ``items`` (all of them when there are fewer)."""
    if len(items) <= n:
        return list(items)
    return [items[i * len(items) // n] for i in range(n)]


def domains() -> dict[str, tuple[list[str], list[str]]]:
    """``{domain: (train texts, held-out texts)}`` for the fortunes and the WordNet definitions."""
    fortunes = read_fortune_file()
    glosses = read_gloss_file()
    return {
        "fortunes": (
            [f.text for f in fortunes if f.split == "train"],
            evenly_spaced([f.text for f in fortunes if f.split == "test"], HELD_OUT),
        ),
        "WordNet definitions": (
            [g.definition for g in glosses if g.split == "train"],
            evenly_spaced([g.definition for g in glosses if g.split == "test"], HELD_OUT),
        ),
    }


def unigram_nll(train: list[list[int]], held_out: list[list[int]], vocab_size: int) -> tuple[float, int]:
    """Total negative log-likelihood (nats) of the ``held_out`` tokens under add-one-smoothed unigram frequencies
    counted on ``train``, and the number of tokens scored."""
    counts = Counter(t for ids in train for t in ids)
    total = sum(counts.values()) + vocab_size
    nll = -sum(math.log((counts[t] + 1) / total) for ids in held_out for t in ids)
    return nll, sum(len(ids) for ids in held_out)


@torch.no_grad()
def model_nll(model: torch.nn.Module, texts: list[list[int]], start: int, batch_size: int = 16) -> tuple[float, int]:
    """Total negative log-likelihood (nats) of every token of ``texts``, each read after the token ``start``, and
    the number of tokens scored. Texts are batched by length, right-padded and masked."""
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    nll, count = 0.0, 0
    for first in range(0, len(order), batch_size):
        rows = [[start, *texts[i]] for i in order[first : first + batch_size]]
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
        nll += torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="sum").item()
        count += int((targets != -100).sum())
    return nll, count


def answer(model: torch.nn.Module, tokenizer, question: str, max_new_tokens: int = 48) -> str:
    """The model's greedy reply to ``question`` as a chat's user turn."""
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=max_new_tokens, do_sample=False, use_cache=True)
    return tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True).strip()


def timed_load() -> tuple[float, tuple]:
    start = time.perf_counter()
    loaded = load_causal_lm("smollm2-135m")
    return time.perf_counter() - start, loaded


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=128, help="Tokens kept of each text.")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (one: the machine is shared).")
    parser.add_argument("--no-conversion", action="store_true", help="Time the cached load only.")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    print("| load | seconds |\n| --- | ---: |")
    if not args.no_conversion:
        before = os.environ.get("PEFT_EXT_CACHE")
        with tempfile.TemporaryDirectory() as empty:
            os.environ["PEFT_EXT_CACHE"] = empty
            try:
                first, _ = timed_load()
                cached, (model, tokenizer) = timed_load()
            finally:
                if before is None:
                    del os.environ["PEFT_EXT_CACHE"]
                else:
                    os.environ["PEFT_EXT_CACHE"] = before
        print(f"| first (conversion from the GGUF into an empty cache, then load) | {first:.1f} |")
    else:
        cached, (model, tokenizer) = timed_load()
    print(f"| cached (hash check of the weights included) | {cached:.1f} |\n")
    model.eval()

    start = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    print(f"| domain ({HELD_OUT} held-out texts) | tokens scored | SmolLM2-135M-Instruct | unigram, add-one | ratio |")
    print("| --- | ---: | ---: | ---: | ---: |")
    options = dict(add_special_tokens=False, truncation=True, max_length=args.max_tokens)
    for name, (train, held_out) in domains().items():
        train_ids, held_ids = tokenizer(train, **options)["input_ids"], tokenizer(held_out, **options)["input_ids"]
        nll, count = model_nll(model, held_ids, start)
        base_nll, base_count = unigram_nll(train_ids, held_ids, len(tokenizer))
        assert count == base_count, (count, base_count)
        ppl, base_ppl = math.exp(nll / count), math.exp(base_nll / count)
        print(f"| {name} | {count:,} | {ppl:.1f} | {base_ppl:.1f} | {base_ppl / ppl:.1f}x |")

    print("\n| prompt (chat template, greedy) | reply |\n| --- | --- |")
    for question in PROMPTS:
        reply = " ".join(answer(model, tokenizer, question).split()).replace("|", "\\|")
        print(f"| {question} | {reply} |")


if __name__ == "__main__":
    main()
