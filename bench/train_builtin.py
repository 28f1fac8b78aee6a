"""Train the built-in `glm-5.3-mini` from scratch and export it (see dsaserve/training/trainer.py).

    PYTHONPATH=. python bench/train_builtin.py --out DIR --minutes 6          # the H200 run
    PYTHONPATH=. python bench/train_builtin.py --out /tmp/m --minutes 0.5 --max-files 40 \\
        --batch-size 4 --seq-len 128 --eval-windows 4 --eval-every 10 --log-every 2   # CPU smoke run
"""

import sys

from dsaserve.training.trainer import main

if __name__ == "__main__":
    sys.exit(main())
