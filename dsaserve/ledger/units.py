"""Units and conventions of the ledger (printed with every report).

Owns: the byte / token / time constants every other ledger module multiplies by, the parser for token
counts on the command line ("128K", "1M"), and the conventions block a report carries. Planning tool,
no stage of the request path: pure Python, no torch.
"""

from __future__ import annotations

KB, MB, GB, TB, PB = 1e3, 1e6, 1e9, 1e12, 1e15  # decimal: GB = 10^9 bytes (DESIGN.md "The ledger")
KiB, MiB, GiB = 2**10, 2**20, 2**30
K_TOKENS, M_TOKENS = 2**10, 2**20  # "128K tokens" = 2^17, "1M tokens" = 2^20 (the notes' 1M-token request)
US, MS = 1e-6, 1e-3
TFLOPS, PFLOPS = 1e12, 1e15

CONVENTIONS: dict[str, str] = {
    "bytes": "GB = 10^9 B, MB = 10^6 B; GiB = 2^30 B (only where labelled GiB)",
    "tokens": "'1M tokens' = 2^20 = 1,048,576 tokens, '128K' = 2^17; a bare number is exact",
    "comm_bytes": "communication bytes are sender totals: the bytes a rank puts on its link",
    "ring": "ring all-reduce moves 2(n-1)/n of the message per rank; ring all-gather / reduce-scatter (n-1)/n; "
            "MoE dispatch/combine: the message is every (token, expert) copy of the rank's own tokens "
            "(ceil(b/dp) under DP-attention), (n-1)/n of it leaves the GPU",
    "message": "'message' = the note's single-call size (e.g. b x hidden x 2 B); 'wire' = what a rank sends",
    "time": "time = bytes / bandwidth + calls x per-collective overhead; lower bounds assume perfect overlap",
    "flops": "FLOP counts a multiply-add as 2; dense (not 2:4-sparse) datasheet FLOP/s",
    "batch": "batch b = decode requests in one step across the whole deployment (the notes' b); "
             "under DP-attention each rank attends and dispatches ceil(b/dp) of them",
}


def parse_tokens(text: str | int, flag: str = "--context") -> int:
    """'1M' -> 2^20, '128K' -> 131072, '32768' -> 32768; errors name the flag."""
    if isinstance(text, int):
        value = text
    else:
        s = str(text).strip().upper().replace("_", "").replace(",", "")
        mult = {"K": K_TOKENS, "M": M_TOKENS}.get(s[-1:], 1)
        body = s[:-1] if mult != 1 else s
        try:
            value = int(float(body) * mult) if "." in body else int(body) * mult
        except ValueError:
            raise ValueError(f"{flag}: {text!r} is not a token count (use e.g. 32768, 128K or 1M)") from None
    if value <= 0:
        raise ValueError(f"{flag}: must be positive, got {text!r}")
    return value


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
