"""The ground floor: vocabulary every other folder shares, importing nothing of the package above it.

Owns: the counters (`counters.py`), the KV byte layouts and their codec (`kv_layout.py`), sampling
parameters (`sampling_params.py`), the causal key/slot counts (`causal.py`) and the environment switches
(`envs.py`); and two helpers of a process's first steps, standard library only: where its bytecode is cached
(`bytecode_cache.py`) and its start-up under cProfile (`startup_profile.py`). None imports torch at import time
(the codec does when first called), so the ledger and the HTTP process use all of it.
"""
