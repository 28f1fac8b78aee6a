"""The ground floor: vocabulary every other folder shares, importing nothing of the package above it.

Owns: the counters (`counters.py`), the KV byte layouts (`kv_layout.py`, their torch codec `kv_codec.py`),
sampling parameters (`sampling_params.py`), the causal key/slot counts (`causal.py`) and the environment
switches (`envs.py`). Only `kv_codec.py` imports torch, so the ledger and the HTTP process can use the rest.
"""
