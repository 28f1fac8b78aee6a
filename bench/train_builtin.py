"""Train the built-in `glm-5.3-mini` from scratch and export it (the recipe: dsaserve/training/trainer.py).

The H200 run (files back from $OUT are limited to 8 files of <= 16 MiB: the checkpoint travels as a split tar,
`cat glm-5.3-mini.tar.* | tar xf -` puts it back together):

    set -o pipefail; export PYTHONPATH=. PYTHONUNBUFFERED=1 DSASERVE_CACHE_DIR=/tmp/dsaserve-cache
    M=/tmp/glm-5.3-mini
    python bench/train_builtin.py --out $M --minutes 4.5 2>&1 | tee $OUT/train.log
    tar -C /tmp -cf - glm-5.3-mini | split -b 15m -d - $OUT/glm-5.3-mini.tar.
    timeout 100 python -m dsaserve eval --model $M --windows 8 --json $OUT/eval.json 2>&1 | tee $OUT/eval.log

A CPU smoke run (seconds):

    PYTHONPATH=. python bench/train_builtin.py --out /tmp/m --minutes 0.5 --max-files 40 --heldout-permille 250 \\
        --batch-size 4 --seq-len 128 --eval-windows 4 --eval-every 10 --log-every 2
"""

import sys

from dsaserve.training.trainer import main

if __name__ == "__main__":
    sys.exit(main())
