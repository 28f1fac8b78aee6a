"""What `bench serve` sends: prompts and their output lengths, generated from a seed (no download).

Owns: the two datasets and their documented length distributions.

  random         input and output lengths uniform in [L(1 - r), L(1 + r)] (vLLM's `--random-range-ratio`),
                 integers, at least 1; prompts are token ids drawn uniformly from [FIRST_ID, vocab), so the
                 input length is exact and no two prompts share a prefix.
  sharegpt-like  lengths with the shape of ShareGPT conversations as vLLM's benchmark filters them: input
                 LogNormal(median SHAREGPT_INPUT_MEDIAN, sigma SHAREGPT_INPUT_SIGMA), output
                 LogNormal(median SHAREGPT_OUTPUT_MEDIAN, sigma SHAREGPT_OUTPUT_SIGMA), drawn independently,
                 rounded, and redrawn until vLLM's filter holds (input 4..1024, output >= 4, input + output
                 <= 2048). These parameters give mean lengths of about 160 in and 340 out (40000 draws:
                 157 and 340; medians 97 and 235), the ShareGPT means the vLLM paper reports (161, 338),
                 with the long right tail of that data. They are chosen to those means, not fitted to the
                 raw data (which this benchmark does not download). Prompt ids as for `random`.

For the chat endpoint a prompt is words instead of ids (one word per requested input token, roughly: the
chat template and the tokenizer decide); the recorded input length is then the server's usage count.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

FIRST_ID = 7  # ids from here on: past the special tokens of the built-in tokenizers
SHAREGPT_INPUT_MEDIAN, SHAREGPT_INPUT_SIGMA = 100.0, 1.1
SHAREGPT_OUTPUT_MEDIAN, SHAREGPT_OUTPUT_SIGMA = 240.0, 0.95
SHAREGPT_MIN_LEN, SHAREGPT_MAX_INPUT, SHAREGPT_MAX_TOTAL = 4, 1024, 2048
DATASETS = ("random", "sharegpt-like")
_WORDS_TEXT = ("time person year way day thing man world life hand part child eye woman place work week case "
               "point number group problem fact model token cache page batch step layer expert router query")
_WORDS = tuple(_WORDS_TEXT.split())


@dataclass
class BenchRequest:
    prompt: list[int] | str
    input_len: int  # tokens asked for (exact for ids)
    output_len: int  # max_tokens


def uniform_lengths(n: int, length: int, ratio: float, rng: random.Random) -> list[int]:
    lo, hi = max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def sharegpt_like_lengths(n: int, rng: random.Random) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    while len(out) < n:
        i = round(rng.lognormvariate(math.log(SHAREGPT_INPUT_MEDIAN), SHAREGPT_INPUT_SIGMA))
        o = round(rng.lognormvariate(math.log(SHAREGPT_OUTPUT_MEDIAN), SHAREGPT_OUTPUT_SIGMA))
        if SHAREGPT_MIN_LEN <= i <= SHAREGPT_MAX_INPUT and o >= SHAREGPT_MIN_LEN and i + o <= SHAREGPT_MAX_TOTAL:
            out.append((i, o))
    return out


def prompt(length: int, vocab: int, as_text: bool, rng: random.Random) -> list[int] | str:
    if as_text:
        return " ".join(rng.choice(_WORDS) for _ in range(length))
    return [rng.randrange(FIRST_ID, vocab) for _ in range(length)]


def make_requests(dataset: str, n: int, *, input_len: int, output_len: int, range_ratio: float, vocab: int,
                  as_text: bool, seed: int, fixed_output_len: int | None = None) -> list[BenchRequest]:
    """n requests of a dataset; the same arguments and seed give the same requests."""
    rng = random.Random(seed)
    if dataset == "random":
        lengths = list(zip(uniform_lengths(n, input_len, range_ratio, rng),
                           uniform_lengths(n, output_len, range_ratio, rng), strict=True))
    elif dataset == "sharegpt-like":
        lengths = sharegpt_like_lengths(n, rng)
    else:
        raise ValueError(f"dataset: {dataset!r} is not one of {', '.join(DATASETS)}")
    if fixed_output_len is not None:
        lengths = [(i, fixed_output_len) for i, _ in lengths]
    return [BenchRequest(prompt(i, vocab, as_text, rng), i, o) for i, o in lengths]
