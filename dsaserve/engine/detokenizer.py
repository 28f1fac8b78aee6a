"""IncrementalDetokenizer: token ids -> text as they arrive, and stop-string matching (request path stage 10).

Owns: the offline Engine's text side of one sample (the server's detokenizer process does the same job
out of process). Text is decoded incrementally the way vLLM does it: decode a window that starts a few
tokens back and keep only the new suffix, and wait while the window ends in an incomplete UTF-8
sequence (U+FFFD), so byte-level BPE pieces never surface as garbage. Stop strings are searched only in
the region new text can complete; a match trims the text (keeping the stop string only with
`include_stop_str_in_output`). While streaming, the last len(longest stop) - 1 characters are held
back, since they could still become the start of a stop string.
"""

from __future__ import annotations

from typing import Any

from dsaserve.engine.sampling_params import SamplingParams

PROMPT_CONTEXT = 5  # prompt tokens decoded with the output so word-initial spaces come out right (vLLM)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], params: SamplingParams):
        self.tok = tokenizer
        self.ids = list(prompt_ids[-PROMPT_CONTEXT:])
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self.params = params
        self.text = ""
        self.emitted = 0  # characters already handed out as deltas
        self.hold = 0 if params.include_stop_str_in_output else max((len(s) for s in params.stop), default=1) - 1
        self.stop_string: str | None = None

    def add(self, new_ids: list[int], final: bool = False) -> str | None:
        """Decode new ids; returns the stop string when one matched (the text is already trimmed)."""
        for t in new_ids:
            before = len(self.text)
            self.ids.append(t)
            self.text += self._next_piece(final)
            if self.params.stop and (hit := self._match_stop(before)):
                return hit
        if final:
            self.text += self._flush()
        return None

    def delta(self, finished: bool) -> str:
        """Text not handed out yet (holding back a possible stop-string start unless finished)."""
        end = len(self.text) if finished or self.stop_string else max(len(self.text) - self.hold, self.emitted)
        piece = self.text[self.emitted:end]
        self.emitted = end
        return piece

    # ---- internals -----------------------------------------------------------------------------
    def _decode(self, ids: list[int]) -> str:
        try:
            return self.tok.decode(ids, skip_special_tokens=self.params.skip_special_tokens)
        except TypeError:  # a wrapper without the keyword
            return self.tok.decode(ids)

    def _next_piece(self, final: bool) -> str:
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        return ""

    def _flush(self) -> str:
        """At the end, whatever is left undecoded (an incomplete sequence shows as U+FFFD)."""
        if self.read_offset == len(self.ids):
            return ""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix):] if full.startswith(prefix) else ""

    def _match_stop(self, before: int) -> str | None:
        longest = max(len(s) for s in self.params.stop)
        start = max(0, before - longest + 1)
        best: tuple[int, str] | None = None
        for s in self.params.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[: i + len(s)] if self.params.include_stop_str_in_output else self.text[:i]
        self.emitted = min(self.emitted, len(self.text))
        self.stop_string = s
        return s
