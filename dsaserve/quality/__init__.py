"""Quality measurement (`dsaserve eval`): held-out perplexity and greedy agreement between settings.

`variants` makes checkpoint variants that differ only in config (dense attention, every layer full),
`runs` measures one setting through the real ModelRunner (prefill perplexity, MTP acceptance, batched
greedy decode), `report` pairs settings with their references and prints the table / JSON.
"""
