"""A local lm-eval-harness task for the server's loglikelihood path (prompt logprobs: completions' echo + logprobs),
and the check that lm-eval's numbers are the engine's own.

lm-eval's tasks download their data; this one is made from the local Python standard library: 8 lines of a file as
the context, its next line against three lines of other files as the choices (4-choice, chance 0.25).

    python bench/lm_eval_local_task.py write --dir /tmp/lmtask
    dsaserve serve &            # glm-5.3-mini on :8000
    HF_DATASETS_OFFLINE=1 lm_eval --model local-completions --model_args model=glm-5.3-mini,\
base_url=http://127.0.0.1:8000/v1/completions,tokenizer_backend=huggingface,tokenizer=dsaserve/builtin/glm-5.3-mini \
--tasks stdlib_mc --include_path /tmp/lmtask --log_samples --output_path /tmp/lmout
    python bench/lm_eval_local_task.py check --samples /tmp/lmout/glm-5.3-mini/samples_stdlib_mc_*.jsonl

`check` scores the same pairs with the offline Engine's prompt logprobs, split as lm-eval splits them (the context's
trailing whitespace moved to the continuation; no special tokens), and prints the largest difference.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sysconfig
from pathlib import Path

TASK_YAML = """task: stdlib_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def write(out: Path, docs: int = 30, seed: int = 0) -> None:
    rng = random.Random(seed)
    snips = []
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:200]:
        lines = [x for x in f.read_text(errors="ignore").splitlines() if x.strip()]
        if len(lines) < 40:
            continue
        i = rng.randrange(10, len(lines) - 5)
        if len(lines[i].strip()) >= 8:
            snips.append(("\n".join(lines[i - 8:i]) + "\n", lines[i]))
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "data.jsonl", "w") as fh:
        for j, (ctx, cont) in enumerate(snips[:docs]):
            choices = rng.sample([c for k, (_, c) in enumerate(snips) if k != j], 3) + [cont]
            rng.shuffle(choices)
            fh.write(json.dumps({"context": ctx, "choices": choices, "label": choices.index(cont)}) + "\n")
    (out / "stdlib_mc.yaml").write_text(TASK_YAML.format(data=out / "data.jsonl"))
    print(f"wrote {out / 'stdlib_mc.yaml'} and {min(docs, len(snips))} documents")


def check(samples: Path, model: str) -> None:
    from tokenizers import Tokenizer

    from dsaserve import Engine, SamplingParams
    from dsaserve.weights.checkpoint_cache import resolve_checkpoint

    tok = Tokenizer.from_file(str(resolve_checkpoint(model) / "tokenizer.json"))
    eng = Engine(model)
    worst, n = 0.0, 0
    for line in samples.read_text().splitlines():
        doc = json.loads(line)
        args, resps = doc["arguments"], doc["resps"]
        args = ast.literal_eval(args) if isinstance(args, str) else args
        resps = ast.literal_eval(resps) if isinstance(resps, str) else resps
        for key, r in zip(sorted(args, key=lambda k: int(k.rsplit("_", 1)[1])), resps, strict=True):
            ctx, cont = args[key]["arg_0"], args[key]["arg_1"]
            sp = len(ctx) - len(ctx.rstrip())
            if sp:
                ctx, cont = ctx[:-sp], ctx[-sp:] + cont
            whole = tok.encode(ctx + cont, add_special_tokens=False).ids
            ctx_len = len(tok.encode(ctx, add_special_tokens=False).ids)
            [o] = eng.generate([whole], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
            mine = sum(e["logprob"] for e in o.prompt_logprobs[ctx_len:])
            worst, n = max(worst, abs(mine - float(r[0][0]))), n + 1
    eng.close()
    print(f"{n} loglikelihoods: lm-eval over the server against the offline engine's prompt logprobs, "
          f"max |diff| {worst:.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("--dir", type=Path, required=True)
    w.add_argument("--docs", type=int, default=30)
    c = sub.add_parser("check")
    c.add_argument("--samples", type=Path, required=True)
    c.add_argument("--model", default="glm-5.3-mini")
    a = ap.parse_args()
    if a.cmd == "write":
        write(a.dir, a.docs)
    else:
        check(a.samples, a.model)


if __name__ == "__main__":
    main()
