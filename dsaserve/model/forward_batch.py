"""ForwardBatch: the one object that carries a step's metadata into the model (stage 4 -> stage 6).

Owns: the contract between the engine (which builds it in `engine/batch.py`) and the model (which reads
it). All tensors are flat so a CUDA-graph runner can copy them into static buffers. A step may mix
prefill chunks and decode tokens: every request contributes `extend_lens[r]` new tokens whose KV goes
to `out_cache_loc`, and attends to all `seq_lens[r]` tokens of its page table (cached prefix + new).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dsaserve.common.host_lists import to_device


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64: new tokens of every request, request-major
    positions: torch.Tensor  # [T] int64: position of each new token in its sequence
    req_index: torch.Tensor  # [T] int64: row of page_table / seq_lens the token belongs to
    seq_lens: torch.Tensor  # [B] int64: tokens in KV for the request after this step (prefix + new)
    extend_lens: torch.Tensor  # [B] int64: new tokens of the request in this step
    page_table: torch.Tensor  # [B, max_pages] int64: physical page ids (slot = page * page_size + offset)
    out_cache_loc: torch.Tensor  # [T] int64: KV slot written by each new token
    logits_indices: torch.Tensor  # [L] int64: which of the T tokens produce logits (last of each chunk)
    page_size: int = 64
    # host-side copies the reference kernels loop over (avoid device syncs in hot paths)
    seq_lens_cpu: list[int] | None = None
    extend_lens_cpu: list[int] | None = None
    # DP-attention's gather step (engine/dp_step.py): the MoE layers all-gather `dp_rows` rows from every rank
    # and reduce-scatter them back instead of exchanging by all-to-all. A replayed graph's batch is padded to
    # them; an eager batch has its own tokens and the MoE pads (`dp_tokens`: every rank's own count, so the
    # padding rows route to no expert)
    dp_rows: int = 0
    dp_tokens: tuple[int, ...] = ()
    # the host's page table, kept when a host batch goes to the device (`to`; the piecewise runner's core batch):
    # the prefill staging builds its page list there instead of syncing on the device's (prefill_staging.py)
    page_table_cpu: torch.Tensor | None = None
    # prompt logprobs (engine/prompt_logprobs.py): the tokens whose next prompt token's logprob is wanted, those
    # next tokens, and the most alternatives asked; read from the step's hidden rows after the forward
    prompt_rows: torch.Tensor | None = None
    prompt_targets: torch.Tensor | None = None
    prompt_k: int = 0
    # the batch builder's page-table row of each request (host, stable while it runs) and the row's generation (a new
    # one each time a request takes it): a wide decode graph keys its device copy of the page table by them and
    # stages only a request's new pages (engine/page_table_mirror.py); None: by the batch's rows, compared whole
    table_rows: np.ndarray | None = None
    table_gens: np.ndarray | None = None
    # overlap scheduling inside a decode graph: input ids -1-j stand for future_token_ids[j] (engine/overlap.py),
    # resolved in place by the model's first launch (`embed_rope_rows`); None: the ids are real (resolved before)
    future_token_ids: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def samples_every_token(self) -> bool:
        """A decode batch (one new token a request, by the host's lengths: never a sync) whose every token produces
        logits: its logits rows are then 0..T-1 in order, the step's rows as they are."""
        ext = self.extend_lens_cpu
        return ext is not None and self.logits_indices.numel() == self.num_tokens and all(n == 1 for n in ext)

    def host_lens(self) -> tuple[list[int], list[int]]:
        if self.seq_lens_cpu is None:
            self.seq_lens_cpu = self.seq_lens.tolist()
        if self.extend_lens_cpu is None:
            self.extend_lens_cpu = self.extend_lens.tolist()
        return self.seq_lens_cpu, self.extend_lens_cpu

    def to(self, device: torch.device | str) -> ForwardBatch:
        """The batch's tensors on `device` (the host page table kept as `page_table_cpu`). Host tensors go to a GPU
        through pinned memory (`to_device`): a copy from pageable memory waits for the device's queued work, which
        would stall the host behind the step before (overlap scheduling, a drafting step's next launch)."""
        device = torch.device(device)
        moved = {k: (to_device(v, v.dtype, device) if isinstance(v, torch.Tensor) and k != "page_table_cpu" else v)
                 for k, v in self.__dict__.items()}
        if moved["page_table_cpu"] is None and self.page_table.device.type == "cpu":
            moved["page_table_cpu"] = self.page_table
        return ForwardBatch(**moved)

    def slots_of(self, r: int, n: int) -> torch.Tensor:
        """Physical slots of the first `n` token positions of request row `r`."""
        pos = torch.arange(n, device=self.page_table.device)
        return self.page_table[r, pos // self.page_size] * self.page_size + pos % self.page_size


def as_decode_rows(batch: ForwardBatch) -> ForwardBatch | None:
    """A host batch whose every token produces logits (decode rows, and speculative decoding's verify rows: the
    last token and its drafts, engine/mtp.py) as a decode batch of one token a row (`one_token_rows`). None when a
    token produces no logits (a prompt chunk), or when the batch already is one token a request, or asks prompt
    logprobs."""
    seq_lens, ext = batch.host_lens()
    if batch.logits_indices.numel() != batch.num_tokens or all(n == 1 for n in ext) or batch.prompt_rows is not None:
        return None
    return one_token_rows(batch)


def one_token_rows(batch: ForwardBatch) -> ForwardBatch:
    """The host batch as one token a row: each token its own row over its request's page table, attending its
    request's keys up to its own position; the same logits rows. The same step: in every layer each token writes
    its KV before any token attends, so a token reads the rows of the tokens before it as in the request's own row;
    what it changes is the path (the decode CUDA graphs take it; the MTP layer's, engine/mtp_graphs.py) and the
    indexer, which then reads a request's keys once a token."""
    pos = batch.positions.tolist()
    rows = torch.arange(batch.num_tokens, dtype=torch.int64)
    table = batch.page_table.index_select(0, batch.req_index)
    lens = [p + 1 for p in pos]
    return ForwardBatch(batch.input_ids, batch.positions, rows, torch.tensor(lens, dtype=torch.int64),
                        torch.ones(batch.num_tokens, dtype=torch.int64), table, batch.out_cache_loc,
                        batch.logits_indices, batch.page_size, lens, [1] * batch.num_tokens, batch.dp_rows,
                        batch.dp_tokens)


def contiguous_batch(token_lists: list[list[int]], prefix_lens: list[int], slot_base: list[int],
                     page_size: int = 64) -> ForwardBatch:
    """A batch over contiguous slot ranges (request r owns slots slot_base[r]...; slot_base page-aligned).

    The simple path (`generate` before the scheduler, tests) uses this; the engine builds paged batches.
    """
    ids, pos, req, out, logit_idx, seq_lens, ext = [], [], [], [], [], [], []
    max_pages = max(-(-(p + len(t)) // page_size) for p, t in zip(prefix_lens, token_lists, strict=True))
    table = torch.zeros(len(token_lists), max(max_pages, 1), dtype=torch.int64)
    for r, (toks, p, base) in enumerate(zip(token_lists, prefix_lens, slot_base, strict=True)):
        assert base % page_size == 0, "contiguous_batch needs page-aligned slot bases"
        n = p + len(toks)
        table[r, : -(-n // page_size)] = torch.arange(-(-n // page_size)) + base // page_size
        ids += toks
        pos += range(p, n)
        req += [r] * len(toks)
        out += range(base + p, base + n)
        logit_idx.append(len(ids) - 1)
        seq_lens.append(n)
        ext.append(len(toks))
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    return ForwardBatch(t(ids), t(pos), t(req), t(seq_lens), t(ext), table, t(out), t(logit_idx), page_size,
                        seq_lens, ext)
