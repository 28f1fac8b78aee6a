"""Training the built-in model (`glm-5.3-mini`) and the data it is trained and evaluated on.

A package, not a bench script, because `dsaserve eval` needs the same corpus split and the tests need the
same HF <-> checkpoint name mapping as the trainer: one definition of each, imported by all three.
The trainer itself (`dsaserve.training.trainer`, run as `bench/train_builtin.py`) needs transformers;
`corpus` needs only the standard library (and `tokenizers` to tokenize).
"""
