"""IncrementalDetokenizer: token ids -> text as they arrive, and stop-string matching (request path stage 10).

Owns: the text side of one sample, for both fronts — the offline Engine (engine/engine.py) and the
server's detokenizer process (server/detokenizer_process.py, which adds the process loop and logprob entries).
The tokenizer is anything with `decode(ids, skip_special_tokens=...)`: a `tokenizers.Tokenizer`, the
server's HFTokenizer, or a test double.

Text is decoded incrementally the way vLLM (and `tokenizers`' DecodeStream) does it: decode a window that
starts a few tokens back and keep only the new suffix, and wait while the window ends in an incomplete
UTF-8 sequence (U+FFFD), so byte-level BPE pieces never surface as garbage. The window is seeded with the
prompt's last ids, so the first output token decodes in context (word-initial spaces come out right).
At the end whatever is still buffered is flushed, so a complete sequence gives exactly
`tokenizer.decode(ids)`.

Stop strings are searched only in the region new text can complete (the earliest match wins, as in
vLLM); a match trims the text, keeping the stop string only with `include_stop_str_in_output`. While
streaming, the last len(longest stop) - 1 characters are held back, since they could still become the
start of a stop string. A stop *token* (EOS or a stop_token_id) that ended generation is not part of the
text unless `include_stop_str_in_output` (vLLM).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dsaserve.common.sampling_params import SamplingParams

PROMPT_CONTEXT = 5  # prompt ids decoded with the output (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)


class IncrementalDetokenizer:
    """Text state of one sample: what was decoded, what was handed out, whether a stop string matched."""

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True) -> None:
        self.tok = tokenizer
        self.stop = [s for s in stop if s]
        self.include_stop = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        # the decode window: ids[:read_offset] were already turned into text (`_prefix_text`, the context
        # the next piece is decoded in), ids[read_offset:] wait for a complete character
        self.ids = list(prompt_ids[-PROMPT_CONTEXT:])
        self.read_offset = len(self.ids)
        self._prefix_text = self._decode(self.ids)
        # a stop string may start this many characters before the newest piece
        self.lookback = max((len(s) for s in self.stop), default=1) - 1
        # with the stop string kept in the output nothing is ever cut, so nothing needs holding back
        self.hold = 0 if include_stop_str_in_output else self.lookback
        self.text = ""  # decoded so far (cut at a matched stop string)
        self.emitted = 0  # characters of `text` already handed out as deltas
        self.num_tokens = 0  # output ids consumed (a trailing stop token counts, though it has no text)
        self.stop_string: str | None = None

    @classmethod
    def for_params(cls, tokenizer: Any, prompt_ids: Sequence[int], params: SamplingParams) -> IncrementalDetokenizer:
        return cls(tokenizer, prompt_ids, params.stop, params.include_stop_str_in_output, params.skip_special_tokens)

    def add(self, new_ids: Sequence[int], final: bool = False, stop_terminated: bool = False) -> str | None:
        """Decode new output ids; the stop string when one matched (the text is then already trimmed and
        the ids after the one that completed it are not consumed: see `num_tokens`).

        final: generation ended, flush what is still buffered. stop_terminated: the last id is the stop
        token that ended generation (its text is left out unless include_stop_str_in_output)."""
        if self.stop_string is not None:
            return None
        text_ids = len(new_ids) - 1 if stop_terminated and new_ids and not self.include_stop else len(new_ids)
        for i, t in enumerate(new_ids):
            self.num_tokens += 1
            if i >= text_ids:
                break
            before = len(self.text)
            self.ids.append(t)
            self.text += self._next_piece()
            if self.stop and (hit := self._match_stop(before)):
                return hit
        if final:
            before = len(self.text)
            self.text += self._flush()
            if self.stop and (hit := self._match_stop(before)):
                return hit
        return None

    def delta(self, finished: bool) -> str:
        """Text not handed out yet: everything once finished, else all but the held-back tail."""
        if finished or self.stop_string is not None:
            end = len(self.text)
        else:
            end = max(len(self.text) - self.hold, self.emitted)
        piece = self.text[self.emitted:end]
        self.emitted = end
        return piece

    # ---- internals -----------------------------------------------------------------------------
    def _decode(self, ids: list[int]) -> str:
        try:
            return self.tok.decode(ids, skip_special_tokens=self.skip_special_tokens)
        except TypeError:  # a wrapper without the keyword
            return self.tok.decode(ids)

    def _advance(self) -> None:
        """The window moves on: the ids just read become the prefix; older ids are no longer needed."""
        del self.ids[: self.read_offset]
        self.read_offset = len(self.ids)
        self._prefix_text = self._decode(self.ids)

    def _next_piece(self) -> str:
        full = self._decode(self.ids)
        if len(full) > len(self._prefix_text) and not full.endswith("\ufffd"):
            piece = full[len(self._prefix_text):]
            self._advance()
            return piece
        return ""

    def _flush(self) -> str:
        """At the end, whatever is left undecoded (an incomplete UTF-8 sequence shows as U+FFFD)."""
        if self.read_offset == len(self.ids):
            return ""
        full = self._decode(self.ids)
        piece = full[len(self._prefix_text):]
        self._advance()
        return piece

    def _match_stop(self, before: int) -> str | None:
        """Search the text that the newest piece (which starts at `before`) can complete."""
        start = max(0, before - self.lookback)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return None
        i, s = min(hits)  # the earliest match wins (vLLM)
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        self.emitted = min(self.emitted, len(self.text))
        self.stop_string = s
        return s
