"""``pallas-flash-llama``: create a tiny model, generate text, train.

    pallas-flash-llama init-tiny DIR
    pallas-flash-llama generate --model DIR --prompt "Once upon a time" --max-new-tokens 32
    pallas-flash-llama generate ... --kv-cache paged --kv-dtype int8   (a paged int8 cache)
    pallas-flash-llama train --model DIR --data FILE --steps 100 --save OUT
    pallas-flash-llama train ... --checkpoint-dir CKPT   (run again to resume)
    pallas-flash-llama serve --model DIR --port 8000   (an OpenAI-compatible server)

Compiled programs are kept in a persistent compilation cache (`DEFAULT_CACHE_DIR`, or
``$PALLAS_FLASH_LLAMA_CACHE``; ``--compilation-cache off`` disables it), so a second run
starts without recompiling.

A job over several processes (hosts) runs the same command in each, with
``--coordinator HOST:PORT --num-processes N --process-id I`` (or ``--distributed`` where jax
detects the job itself, as on a Cloud TPU slice): see `distributed`. Process 0 prints and
writes the model; every process writes its shards of the checkpoints.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys
import time
from collections.abc import Sequence

import jax
from jax.sharding import Mesh

import pallas_flash as pf
from pallas_flash_llama import data, distributed, sharding, tiny
from pallas_flash_llama.config import REMAT_POLICIES, LlamaConfig, get_config
from pallas_flash_llama.generation import KV_CACHES, PAGE_SIZE, generate
from pallas_flash_llama.int8_weights import quantize_params
from pallas_flash_llama.kv_cache import CACHE_SPLITS
from pallas_flash_llama.model import init_params
from pallas_flash_llama.sampling import Sampling
from pallas_flash_llama.tokenizer import (
    CHAT_TEMPLATE_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    encode,
    load_tokenizer,
    special_tokens,
)
from pallas_flash_llama.train import TrainConfig, init_state, make_train_step, shard_batch
from pallas_flash_llama.weights import load_params, save_params

DEFAULT_CACHE_DIR = pathlib.Path.home() / ".cache" / "pallas-flash-llama" / "jax"
CACHE_ENV_VAR = "PALLAS_FLASH_LLAMA_CACHE"


def enable_compilation_cache(directory: str | None) -> None:
    """Turns on jax's persistent compilation cache in ``directory`` (None: the default;
    ``"off"``: leave it off)."""
    if directory == "off":
        return
    path = directory or os.environ.get(CACHE_ENV_VAR) or str(DEFAULT_CACHE_DIR)
    jax.config.update("jax_compilation_cache_dir", path)


def _mesh(text: str | None) -> jax.sharding.Mesh | None:
    """``--mesh data,fsdp,tensor`` (one may be -1) as a mesh; None without the flag."""
    if text is None:
        return None
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if len(sizes) != 3:
        raise pf.InvalidInputError(f"--mesh: expected DATA,FSDP,TENSOR sizes, got {text!r}")
    return sharding.make_mesh(*sizes)


def _init_tiny(args: argparse.Namespace) -> None:
    tiny.init_tiny(args.directory, seed=args.seed)
    print(f"wrote a tiny LLaMa to {args.directory} (train on {args.directory}/{tiny.SAMPLE_FILE})")


def _inference_model(args: argparse.Namespace, mesh: Mesh | None) -> tuple[LlamaConfig, dict]:
    """The model of ``--model`` in ``--dtype``, its weights int8 with ``--weights int8``."""
    config, params = load_params(args.model, mesh=mesh)
    if args.dtype:
        config = config.replace(dtype=args.dtype)
    if args.weights == "int8":
        params = quantize_params(params, mesh, config)
    return config, params


def _generate(args: argparse.Namespace) -> None:
    mesh = _mesh(args.mesh)
    config, params = _inference_model(args, mesh)
    tokenizer = load_tokenizer(args.model)
    special = special_tokens(args.model, tokenizer, config)
    prompts = [encode(tokenizer, text, special) for text in args.prompt]
    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    steps = generate(
        params,
        config,
        prompts,
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        key=jax.random.key(args.seed),
        max_len=args.max_len,
        backend=args.backend,
        decode_backend=args.decode_backend,
        mesh=mesh,
        kv_cache=args.kv_cache,
        kv_dtype=args.kv_dtype,
        page_size=args.page_size,
        kv_split=args.kv_split,
    )
    generated: list[list[int]] = [[] for _ in prompts]
    show = distributed.is_main()
    start = time.perf_counter()
    count, shown = 0, ""
    for tokens in steps:
        for i, token in enumerate(tokens):
            if token >= 0:
                generated[i].append(int(token))
                count += 1
        if show and len(prompts) == 1:  # stream one prompt's text (whole characters)
            text = tokenizer.decode(generated[0])
            sys.stdout.write(text[len(shown) :])
            sys.stdout.flush()
            shown = text
    elapsed = time.perf_counter() - start
    if not show:
        return
    if len(prompts) == 1:
        print()
    else:
        for text, ids in zip(args.prompt, generated, strict=True):
            print(f"{text!r} -> {tokenizer.decode(ids)!r}")
    print(f"[{count} tokens in {elapsed:.1f} s, compiles included]", file=sys.stderr)


def _serve(args: argparse.Namespace) -> None:
    try:  # the serve extra, and the engine
        import uvicorn

        from pallas_flash_llama.engine import Engine
        from pallas_flash_llama.server import make_app
        from pallas_flash_llama.server_metrics import log_to_stderr
    except ModuleNotFoundError as error:
        raise pf.UnsupportedFeatureError(
            f"serve: {error} (pip install 'pallas-flash-llama[serve]')"
        ) from None
    mesh = _mesh(args.mesh)
    config, params = _inference_model(args, mesh)
    pages_per_sequence = -(-(args.max_len or config.max_len) // args.page_size)
    engine = Engine(
        params,
        config,
        slots=args.slots,
        token_budget=args.token_budget,
        page_size=args.page_size,
        num_pages=args.num_pages or args.slots * pages_per_sequence,
        pages_per_sequence=pages_per_sequence,
        backend=args.backend,
        cache_dtype=args.kv_dtype,
        mesh=mesh,
        prefix_caching=args.prefix_caching,
    )
    limit = {} if args.max_request_bytes is None else {"max_request_bytes": args.max_request_bytes}
    app = make_app(engine, args.model, config, args.served_model_name, **limit)
    log_to_stderr()  # a line per request beside uvicorn's
    engine.start()
    try:
        uvicorn.run(app, host=args.host, port=args.port)
    finally:
        engine.stop()


def _train(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    mesh = _mesh(args.mesh)
    if args.model:
        config, params = load_params(args.model, mesh=mesh)
        tokenizer_dir = args.tokenizer or args.model
    else:
        if not args.tokenizer:
            raise pf.InvalidInputError("--tokenizer: required with --config (a directory)")
        config = get_config(args.config)
        params = init_params(config, jax.random.key(args.seed), mesh)
        tokenizer_dir = args.tokenizer
    config = config.replace(remat=args.remat, loss_chunk=args.loss_chunk,
                            **({"dtype": args.dtype} if args.dtype else {}))  # fmt: skip
    tokenizer = load_tokenizer(tokenizer_dir)
    special = special_tokens(tokenizer_dir, tokenizer, config)
    ends = list(config.eos_ids[:1])
    documents = [
        ids if ids[-1:] == ends else ids + ends  # each document ends in one eos
        for ids in (encode(tokenizer, text, special) for text in data.read_documents(args.data))
    ]
    packed = data.pack(documents, args.seq_len)
    train_config = TrainConfig(
        learning_rate=args.lr,
        warmup_steps=args.warmup,
        total_steps=args.steps,
        weight_decay=args.weight_decay,
        clip_norm=args.clip_norm,
    )
    if mesh is not None:
        sharding.check_mesh(config, mesh, batch=args.batch_size)
    state = init_state(params, train_config)
    checkpoints = None
    if args.checkpoint_dir:
        from pallas_flash_llama import checkpoint  # orbax: imported only when checkpointing

        if args.checkpoint_every < 1:
            raise pf.InvalidInputError(
                f"--checkpoint-every: expected at least 1 step, got {args.checkpoint_every}"
            )
        checkpoints = checkpoint.checkpoint_manager(args.checkpoint_dir, args.keep_checkpoints)
        state = checkpoint.restore_state(checkpoints, state) or state
    first = int(state.step)
    if first and distributed.is_main():
        print(f"resuming at step {first} from {args.checkpoint_dir}")
    step_fn = make_train_step(config, train_config, backend=args.backend, mesh=mesh)
    batches = data.batches(packed, args.batch_size, seed=args.seed)
    for _ in range(first):  # the batches the checkpointed steps already took
        next(batches)

    def save(directory: pathlib.Path) -> None:
        save_params(directory, state.params, config)
        if distributed.is_main():
            for name in (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, CHAT_TEMPLATE_FILE):
                if (pathlib.Path(tokenizer_dir) / name).exists():
                    shutil.copy(pathlib.Path(tokenizer_dir) / name, directory / name)

    log = open(args.metrics, "a") if args.metrics and distributed.is_main() else None  # noqa: SIM115

    bar = tqdm(
        range(first + 1, args.steps + 1),
        desc="train",
        unit="step",
        initial=first,
        disable=not distributed.is_main(),
    )
    start, tokens_seen = time.perf_counter(), 0
    for step in bar:
        state, metrics = step_fn(state, shard_batch(next(batches), mesh))
        tokens_seen += args.batch_size * args.seq_len
        loss = float(metrics["loss"])
        rate = tokens_seen / (time.perf_counter() - start)
        bar.set_postfix(loss=f"{loss:.3f}", tokens_per_s=f"{rate:,.0f}")
        if log:
            record = {"step": step, "loss": loss, "grad_norm": float(metrics["grad_norm"])}
            log.write(json.dumps(record | {"tokens_per_s": rate}) + "\n")
            log.flush()
        if args.save and args.save_every and step % args.save_every == 0:
            save(pathlib.Path(args.save))
        if checkpoints and step % args.checkpoint_every == 0:
            checkpoint.save_state(checkpoints, state)
    if checkpoints:
        if int(state.step) > first and int(state.step) % args.checkpoint_every:
            checkpoint.save_state(checkpoints, state)
        checkpoints.wait_until_finished()
        checkpoints.close()
    if log:
        log.close()
    if args.save:
        save(pathlib.Path(args.save))
        if distributed.is_main():
            print(f"saved to {args.save}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pallas-flash-llama", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--compilation-cache",
        metavar="DIR",
        help=f"persistent compilation cache (default ${CACHE_ENV_VAR} or {DEFAULT_CACHE_DIR}; "
        "'off' disables it)",
    )
    job = parser.add_argument_group("jobs over several processes (hosts)")
    job.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address")
    job.add_argument("--num-processes", type=int, help="how many processes the job has")
    job.add_argument("--process-id", type=int, help="this process's rank, from 0")
    job.add_argument(
        "--distributed",
        action="store_true",
        help="a job jax detects itself (a Cloud TPU slice, SLURM, Open MPI)",
    )
    job.add_argument(
        "--heartbeat-timeout",
        type=int,
        default=distributed.HEARTBEAT_TIMEOUT_S,
        metavar="SECONDS",
        help="a process silent this long fails the job",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    init = commands.add_parser("init-tiny", help="write a tiny random model directory")
    init.add_argument("directory")
    init.add_argument("--seed", type=int, default=0)
    init.set_defaults(run=_init_tiny)

    def weights(sub: argparse.ArgumentParser) -> None:
        sub.add_argument(
            "--weights",
            choices=["int8"],
            help="int8: matmul weights quantized per output channel when loaded (half the "
            "HBM); default: as the checkpoint holds them",
        )

    def common(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--backend", help="pf.attention backend (default: the registry's)")
        sub.add_argument(
            "--mesh", metavar="DATA,FSDP,TENSOR", help="a device mesh, e.g. 1,-1,1 (one -1)"
        )
        sub.add_argument("--dtype", help="compute dtype (default: the config's, bfloat16)")
        sub.add_argument("--seed", type=int, default=0)

    gen = commands.add_parser("generate", help="generate text from prompts")
    gen.add_argument("--model", required=True, help="a Hugging Face LLaMa directory")
    gen.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--max-len", type=int, help="cache positions per sequence")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-k", type=int)
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--decode-backend", help="pf.decode backend (splitkv: the Split-KV kernel)")
    gen.add_argument(
        "--kv-cache",
        choices=KV_CACHES,
        default="contiguous",
        help="KV cache layout: max-len positions per sequence, or pages allocated as "
        "sequences grow (over --mesh, each sequence's pages round the devices, or each "
        "device its kv heads of every page with --kv-split heads)",
    )
    gen.add_argument(
        "--kv-dtype",
        help="KV cache dtype: int8 (quantized, a scale per token and kv head); default: the "
        "compute dtype",
    )
    weights(gen)
    gen.add_argument(
        "--page-size", type=int, default=PAGE_SIZE, help="positions per page of a paged cache"
    )
    gen.add_argument(
        "--kv-split",
        choices=CACHE_SPLITS,
        help="how --mesh splits the cache: over kv heads (contiguous default: and batch; "
        "no exchange between devices) or along the sequence (paged default; splitkv merges "
        "the devices' partials)",
    )
    common(gen)
    gen.set_defaults(run=_generate)

    srv = commands.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (continuous batching)"
    )
    srv.add_argument("--model", required=True, help="a Hugging Face LLaMa directory")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument(
        "--served-model-name", help="the model's name in the API (default: --model's path)"
    )
    srv.add_argument("--slots", type=int, default=8, help="sequences generated at once")
    srv.add_argument("--token-budget", type=int, default=256, help="most new tokens per step")
    srv.add_argument("--page-size", type=int, default=16, help="positions per cache page")
    srv.add_argument("--max-len", type=int, help="longest sequence (default: the config's)")
    srv.add_argument(
        "--num-pages", type=int, help="pages in the cache (default: --slots full sequences)"
    )
    srv.add_argument("--kv-dtype", help="KV cache dtype: int8 (quantized); default: compute dtype")
    weights(srv)
    srv.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="compute every prompt whole (default: requests reuse the cached pages of the "
        "prompt prefixes they share)",
    )
    srv.add_argument(
        "--max-request-bytes",
        type=int,
        help="the largest request body answered; larger ones get a 413 (default: "
        "server_limits.MAX_REQUEST_BYTES, 32 MiB)",
    )
    srv.add_argument("--backend", help="pf.attention backend (default: the registry's)")
    srv.add_argument("--dtype", help="compute dtype (default: the config's, bfloat16)")
    srv.add_argument(
        "--mesh",
        metavar="1,1,TENSOR",
        help="serve tensor-parallel over this mesh (e.g. 1,1,8 on a v5e-8: each chip its share "
        "of the heads and of every cache page); default: one device",
    )
    srv.set_defaults(run=_serve)

    tr = commands.add_parser("train", help="train on a text or jsonl file")
    source = tr.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="start from this Hugging Face LLaMa directory")
    source.add_argument("--config", help="start from random weights of this config name")
    tr.add_argument("--tokenizer", help="directory with tokenizer.json (default: --model)")
    tr.add_argument("--data", required=True, help="a .txt (a document per line) or .jsonl file")
    tr.add_argument("--seq-len", type=int, default=128)
    tr.add_argument("--batch-size", type=int, default=8)
    tr.add_argument("--steps", type=int, default=100)
    tr.add_argument("--lr", type=float, default=3e-4)
    tr.add_argument("--warmup", type=int, default=10)
    tr.add_argument("--weight-decay", type=float, default=0.1)
    tr.add_argument("--clip-norm", type=float, default=1.0)
    tr.add_argument("--remat", choices=REMAT_POLICIES, default="none")
    tr.add_argument(
        "--loss-chunk",
        type=int,
        help="make the loss's logits this many positions at a time (divides --seq-len): a "
        "large vocabulary's logits need not exist whole",
    )
    tr.add_argument(
        "--metrics", metavar="FILE", help="append each step's loss and rate to FILE (JSON lines)"
    )
    tr.add_argument("--save", help="write the trained model here (safetensors)")
    tr.add_argument("--save-every", type=int, help="also save every N steps")
    tr.add_argument(
        "--checkpoint-dir",
        help="orbax checkpoints of the whole training state; resumes from the newest one",
    )
    tr.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints")
    tr.add_argument("--keep-checkpoints", type=int, default=3)
    common(tr)
    tr.set_defaults(run=_train)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    enable_compilation_cache(args.compilation_cache)
    joined = False
    try:
        joined = distributed.initialize(
            args.coordinator,
            args.num_processes,
            args.process_id,
            auto=args.distributed,
            heartbeat_timeout_s=args.heartbeat_timeout,
        )
        args.run(args)
    except (pf.InvalidInputError, pf.UnsupportedFeatureError, pf.BackendNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except jax.errors.JaxRuntimeError as error:
        if not joined:
            raise
        # A collective with a process that stopped fails here first; jax's coordination
        # service then ends this process too once the heartbeat timeout passes.
        print(
            f"error: process {jax.process_index()} of {jax.process_count()}: a step failed, "
            f"most likely because another process of the job stopped ({error})",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
