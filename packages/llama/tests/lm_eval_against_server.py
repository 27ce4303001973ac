"""lm-evaluation-harness against ``pallas-flash-llama serve``, as users evaluate a served
model: ``lm_eval --model local-completions`` on the tiny model, one loglikelihood task and
one generation task from small local datasets (no network), its tokenizer the server's own
(lm-eval's ``remote`` backend: ``/tokenizer_info``, ``/tokenize``, ``/detokenize``).

Checks: every loglikelihood lm-eval reports equals the model's own, float64 log-softmax of
its logits summed over the continuation's tokens; every generation equals the server's
greedy text for the prompt. ``nox -s lm_eval`` runs it (lm-eval and torch installed there);
``python lm_eval_against_server.py [--lm-eval PATH]`` runs it with another lm_eval.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import httpx
import jax.numpy as jnp
import numpy as np
import scipy.special

sys.path.insert(0, str(pathlib.Path(__file__).parent))  # server_testing, llama_testing

from server_testing import serving

from pallas_flash_llama import tiny
from pallas_flash_llama.engine import Engine
from pallas_flash_llama.model import forward
from pallas_flash_llama.server import make_app
from pallas_flash_llama.tokenizer import load_tokenizer
from pallas_flash_llama.weights import load_params

MODEL = "tiny"
PAIRS = [
    ("The quick brown", " fox jumps over the lazy dog."),
    ("Attention is a weighted average of values,", " weighted by how well keys match a query."),
    ("Once upon a time there was", " a small language model."),
    ("The key and value cache grows", " by one row for every generated token."),
]
"""(context, continuation) of the loglikelihood task, lines of the tiny model's sample text."""

PROMPTS = ["The quick brown", "Flash attention computes it in blocks,", "Then it generated"]
"""The generation task's prompts."""

TASKS = {
    "tiny_loglikelihood": """
task: tiny_loglikelihood
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
""",
    "tiny_generation": """
task: tiny_generation
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
""",
}


def _write_tasks(root: pathlib.Path) -> None:
    rows = {
        "tiny_loglikelihood": [{"context": c, "continuation": t} for c, t in PAIRS],
        "tiny_generation": [{"prompt": p, "target": ""} for p in PROMPTS],
    }
    for name, template in TASKS.items():
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows[name]))
        (root / f"{name}.yaml").write_text(template.format(data=data))


def _samples(output: pathlib.Path, task: str) -> list[dict]:
    (path,) = output.rglob(f"samples_{task}_*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lm-eval", default="lm_eval", help="the lm_eval command")
    args = parser.parse_args(argv)
    root = pathlib.Path(tempfile.mkdtemp(prefix="lm-eval-"))
    model_dir, tasks, output = root / "tiny", root / "tasks", root / "out"
    tasks.mkdir()
    tiny.init_tiny(model_dir)
    _write_tasks(tasks)
    config, params = load_params(model_dir)
    config = config.replace(dtype="float32")  # the served model's and the reference's
    engine = Engine(params, config, slots=4, token_budget=64, page_size=16, num_pages=64,
                    pages_per_sequence=16, backend="xla")  # fmt: skip
    engine.start()
    try:
        with serving(make_app(engine, model_dir, config, model_name=MODEL)) as url:
            model_args = (f"model={MODEL},base_url={url}/v1/completions,num_concurrent=1,"
                          "max_retries=1,tokenizer_backend=remote")  # fmt: skip
            environment = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
            subprocess.run(
                [args.lm_eval, "--model", "local-completions", "--model_args", model_args,
                 "--tasks", ",".join(TASKS), "--include_path", str(tasks), "--log_samples",
                 "--output_path", str(output)],
                check=True, env=environment,
            )  # fmt: skip
            tokenizer = load_tokenizer(model_dir)  # lm-eval sends the ids /tokenize gives it
            greedy = [
                httpx.post(f"{url}/v1/completions", timeout=600, json={
                    "model": MODEL, "max_tokens": 8, "temperature": 0, "stop": ["\n"],
                    "prompt": tokenizer.encode(prompt, add_special_tokens=False).ids,
                }).json()["choices"][0]["text"]
                for prompt in PROMPTS
            ]  # fmt: skip
    finally:
        engine.stop()

    worst = 0.0
    for sample in _samples(output, "tiny_loglikelihood"):
        context, continuation = sample["doc"]["context"], sample["doc"]["continuation"]
        got = float(sample["resps"][0][0][0])
        first = tokenizer.encode(context, add_special_tokens=False).ids
        rest = tokenizer.encode(continuation, add_special_tokens=False).ids
        tokens = [*first, *rest]
        logits = forward(params, jnp.asarray([tokens], jnp.int32), config, backend="xla")[0]
        scores = scipy.special.log_softmax(np.asarray(logits, np.float64), axis=-1)
        want = sum(scores[p - 1, tokens[p]] for p in range(len(first), len(tokens)))
        worst = max(worst, abs(got - want))
        print(f"loglikelihood {context!r} + {continuation!r}: lm-eval {got:.6f}, model {want:.6f}")
        assert abs(got - want) < 1e-3, (got, want)
    generations = [s["resps"][0][0] for s in _samples(output, "tiny_generation")]
    prompts = [s["doc"]["prompt"] for s in _samples(output, "tiny_generation")]
    assert generations == [greedy[PROMPTS.index(p)] for p in prompts], (generations, greedy)
    print(f"lm-eval against the server: {len(PAIRS)} loglikelihoods equal the model's (largest "
          f"difference {worst:.2e}), {len(PROMPTS)} generations equal its greedy text")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
