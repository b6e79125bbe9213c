"""The `kvjax` command.

  kvjax demo      serve the default chat workload on the built-in model with prefix reuse,
                  then again without, and print both side by side (tokens must be identical)
  kvjax run       serve any workload file with any cache / engine settings, on a built-in
                  random-weight model or a Hugging Face checkpoint directory (--model PATH)
  kvjax capacity  how many blocks and tokens a model's KV cache gets on a device, after its
                  weights and an activation reserve
  kvjax serve     an OpenAI-compatible HTTP server for a built-in model or a checkpoint
  kvjax router    a KV-aware router in front of several `kvjax serve` replicas
  kvjax route-sim compare routing policies on a workload over N simulated replicas

A bad flag or config file prints one line, `kvjax: error: ...`, and exits with status 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import logging
import re
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

from kvjax.capacity_command import cmd_capacity
from kvjax.serve_command import cmd_serve, parse_value

#: `--kv-cache-dtype` values (the keys of `kvjax.engine.config.KV_CACHE_DTYPES`, listed here so
#: that parsing flags imports no engine code).
KV_CACHE_DTYPE_CHOICES = ("auto", "fp8", "float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMGTP]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1}
for _i, _p in enumerate("KMGTP", start=1):
    _UNITS[_p + "IB"] = _UNITS[_p + "I"] = 1024**_i
    _UNITS[_p + "B"] = _UNITS[_p] = 1000**_i


def parse_size(text: str) -> int:
    """Bytes from '141GiB', '512GB', '100MiB', '1.5TiB', '4096' (binary *iB, decimal *B)."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"invalid size {text!r} (examples: 141GiB, 512GB, 100MiB, 4096)")
    value = float(m.group(1)) * _UNITS[(m.group(2) or "").upper()]
    if value < 0:
        raise ValueError(f"size must be >= 0, got {text!r}")
    return int(value)


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _int_at_least(minimum: int):
    """argparse type: an int >= `minimum`, with a one-line message otherwise."""
    what = "a positive int" if minimum == 1 else f"an int >= {minimum}"

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return v

    return parse


_positive_int = _int_at_least(1)
_nonneg_int = _int_at_least(0)


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return v


#: vLLM's `--kv-cache-dtype` spellings kvjax has under another name.
_VLLM_KV_CACHE_DTYPES = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
#: vLLM's `--dtype` values (torch names) -> kvjax's; "auto" keeps the model's.
MODEL_DTYPES = {"auto": None, "bfloat16": "bfloat16", "float16": "float16", "half": "float16", "float32": "float32",
                "float": "float32"}


def _kv_cache_dtype(text: str) -> str:
    """argparse type: kvjax's KV dtypes and vLLM's spellings of them."""
    if text in KV_CACHE_DTYPE_CHOICES:
        return text
    if text in _VLLM_KV_CACHE_DTYPES:
        return _VLLM_KV_CACHE_DTYPES[text]
    known = ", ".join(KV_CACHE_DTYPE_CHOICES + tuple(_VLLM_KV_CACHE_DTYPES))
    if text.startswith("fp8"):
        raise argparse.ArgumentTypeError(f"kvjax has no {text!r} KV cache (vLLM's fp8 variants it has: fp8, fp8_e4m3, "
                                         f"fp8_e5m2); choose from {known}")
    raise argparse.ArgumentTypeError(f"invalid choice {text!r} (choose from {known})")


def _model_dtype(text: str) -> str | None:
    if text not in MODEL_DTYPES:
        raise argparse.ArgumentTypeError(f"invalid choice {text!r} (choose from {', '.join(MODEL_DTYPES)})")
    return MODEL_DTYPES[text]


#: vLLM `serve` flags kvjax does not take, with what to use instead (shown for an unknown flag).
VLLM_FLAG_HINTS = {
    "--swap-space": "kvjax's host tier is --secondary-blocks N (blocks, not GiB)",
    "--cpu-offload-gb": "kvjax offloads KV blocks, not weights: --secondary-blocks N",
    "--num-gpu-blocks-override": "use --primary-blocks N",
    "--enforce-eager": "not supported: JAX compiles each program shape once (logged at startup)",
    "--trust-remote-code": "not needed: kvjax runs its own implementation of the architectures it supports",
    "--pipeline-parallel-size": "not supported; use --tensor-parallel-size",
    "-pp": "not supported; use --tensor-parallel-size",
    "--data-parallel-size": "run one `kvjax serve` per replica behind `kvjax router` (--data-parallel-rank labels events)",
    "-dp": "run one `kvjax serve` per replica behind `kvjax router`",
    "--quantization": "not supported (weights in --dtype; an FP8 KV cache with --kv-cache-dtype fp8)",
    "-q": "not supported (weights in --dtype; an FP8 KV cache with --kv-cache-dtype fp8)",
    "--enable-chunked-prefill": "always on in kvjax: --max-num-batched-tokens sets the chunk",
    "--no-enable-chunked-prefill": "chunked prefill is always on in kvjax: --max-num-batched-tokens sets the chunk",
    "--chat-template": "not supported: the tokenizer's chat template is used",
    "--uvicorn-log-level": "use --log-level",
    "--enable-log-requests": "requests are logged at --log-level debug unless --disable-log-requests",
    "--revision": "kvjax serves a local checkpoint directory as it is",
    "--download-dir": "kvjax serves a local checkpoint directory as it is",
    "--load-format": "kvjax reads safetensors checkpoints",
    "--tokenizer-mode": "not supported; --tokenizer DIR picks the tokenizer",
    "--scheduling-policy": "use --queue-policy fcfs|lpm",
    "--preemption-mode": "use --policy guaranteed_no_evict|max_utilization",
    "--prefix-caching-hash-algo": "use --option 'event_hash=\"sha256\"' (or trtllm64)",
    "--kv-events-config": "use --kv-events-endpoint, --kv-events-replay-endpoint and --kv-events-topic",
    "--enable-lora": "not supported",
    "--generation-config": "kvjax reads the checkpoint's generation_config.json (EOS ids)",
    "--device": "JAX picks the device: set JAX_PLATFORMS (cpu, cuda, tpu)",
    "--distributed-executor-backend": "kvjax spans processes with jax.distributed (docs/distributed.md)",
    # vLLM names only `kvjax serve` takes; the other commands keep kvjax's
    "--max-model-len": "this command's flag is --max-seq-len",
    "--max-num-seqs": "this command's flag is --max-batch-size",
    "--max-num-batched-tokens": "this command's flag is --max-num-tokens",
    "--block-size": "this command's flag is --tokens-per-block",
    "--gpu-memory-utilization": "only `kvjax serve` and `kvjax capacity` take it",
    "--enable-prefix-caching": "on by default; `kvjax run --no-reuse` turns it off",
    "--no-enable-prefix-caching": "this command's flag is --no-reuse (kvjax run)",
}


def _unknown_flag_hints(message: str, known: Collection[str] = ()) -> str:
    """`unrecognized arguments: ...` plus, for known vLLM flags, what kvjax takes instead, and
    for a near miss of a kvjax flag (among `known`), that flag."""
    hints: list[str] = []
    for arg in message.split(":", 1)[1].split():
        flag = arg.split("=", 1)[0]
        if not flag.startswith("-") or any(h.startswith(flag + ":") for h in hints):
            continue
        if flag in VLLM_FLAG_HINTS:
            hints.append(f"{flag}: {VLLM_FLAG_HINTS[flag]}")
        elif close := difflib.get_close_matches(flag, sorted(known), n=1, cutoff=0.8):
            hints.append(f"{flag}: did you mean {close[0]}?")
    return message + (" (" + "; ".join(hints) + ")" if hints else "")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `kvjax: error: ...`, exit status 2; an unknown vLLM flag
    says what kvjax takes instead."""

    def error(self, message: str):  # noqa: D401 (argparse API)
        if message.startswith("unrecognized arguments:"):
            message = _unknown_flag_hints(message, self._known_flags())
        raise SystemExit(_fail(message))

    def _known_flags(self) -> set[str]:
        """Every option string of this parser and its subcommands."""
        flags = set(self._option_string_actions)
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    flags |= set(sub._option_string_actions)
        return flags


def _fail(message: str) -> int:
    print(f"kvjax: error: {message}", file=sys.stderr)
    return 2


# ---------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kvjax", description="kvjax: a paged KV-cache manager for LLM inference in JAX.")
    sub = p.add_subparsers(
        dest="command", required=True, parser_class=_Parser, metavar="{demo,run,capacity,serve,router,route-sim}"
    )

    def serving_flags(sp, workload_default: str | None):
        sp.add_argument(
            "--workload",
            default=workload_default,
            required=workload_default is None,
            help="workload file or name in configs/workloads/" + (f" (default {workload_default})" if workload_default else ""),
        )
        sp.add_argument("--model", help="a Hugging Face checkpoint directory, or a random-weight model name / TOML "
                                        "(configs/models/; default: the workload's, else tiny)")
        sp.add_argument("--strict-config", action="store_true",
                        help="refuse a checkpoint whose config.json has keys kvjax does not know")
        sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a [workload] field, e.g. --set users=2 (TOML value syntax)")
        sp.add_argument("--primary-blocks", type=_positive_int)
        sp.add_argument("--secondary-blocks", type=_nonneg_int)
        sp.add_argument("--tokens-per-block", type=_positive_int)
        sp.add_argument("--max-seq-len", type=_positive_int)
        sp.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPE_CHOICES,
                        help="KV pool dtype (default auto: the model's; fp8 = float8_e4m3fn with per-block scales)")
        sp.add_argument("--policy", choices=["guaranteed_no_evict", "max_utilization"])
        sp.add_argument("--max-batch-size", type=_positive_int)
        sp.add_argument("--max-num-tokens", type=_positive_int, help="token budget per step (prefill chunk size)")
        sp.add_argument("--no-partial-reuse", action="store_true")
        sp.add_argument(
            "--seed", type=int, default=0, help="weights seed of a random-weight model (a checkpoint has its own weights)"
        )
        sp.add_argument("--out", default="results", help="directory for the JSON and PNG (default results/)")
        sp.add_argument("--no-progress", action="store_true", help="no progress bar")

    d = sub.add_parser("demo", help="chat workload with and without prefix reuse, side by side")
    serving_flags(d, "chat")
    d.add_argument("--users", type=_positive_int, help="shrink: number of chat users")
    d.add_argument("--turns", type=_positive_int, help="shrink: turns per user")
    d.add_argument("--max-new-tokens", type=_positive_int, help="shrink: tokens generated per turn")

    r = sub.add_parser("run", help="serve a workload file")
    serving_flags(r, None)
    r.add_argument("--no-reuse", action="store_true", help="disable prefix reuse")
    r.add_argument("--compare", action="store_true", help="also run without reuse and compare (like demo)")

    c = sub.add_parser("capacity", help="blocks and tokens a memory budget holds for a model")
    c.add_argument("--model", required=True, help="model name or TOML (configs/models/NAME.toml), or a checkpoint directory")
    c.add_argument("--gpu-memory", required=True, type=_size_arg, help="memory of the device, e.g. 141GiB")
    c.add_argument("--host-memory", type=_size_arg, default=0, help="host memory for the secondary tier, e.g. 512GiB")
    c.add_argument("--gpu-memory-utilization", "--fraction", dest="fraction", type=_fraction, default=0.9,
                   help="fraction of --gpu-memory for weights, activations and KV cache, as vLLM's (default 0.9)")
    c.add_argument("--activation-reserve", type=_size_arg,
                   help="device memory kept for activations (default: an estimate for --max-num-tokens)")
    c.add_argument("--max-num-tokens", type=_positive_int, default=8192,
                   help="tokens per forward step the activation estimate is sized for (default 8192)")
    c.add_argument("--input-len", type=_nonneg_int, default=2048)
    c.add_argument("--output-len", type=_nonneg_int, default=512)
    c.add_argument("--tokens-per-block", type=_positive_int, default=32)
    c.add_argument("--beam-width", type=_positive_int, default=1)
    c.add_argument("--max-seq-len", type=_positive_int, help="default: the model's")
    c.add_argument("--dtype", help="KV cache dtype (default: the model's), e.g. float8_e4m3fn")
    c.add_argument("--strict-config", action="store_true",
                   help="refuse a checkpoint whose config.json has keys kvjax does not know")
    c.add_argument("--snapshot-interval", type=_positive_int, metavar="N",
                   help="hybrid checkpoints: tokens between kept recurrent-state snapshots, a multiple of "
                        "--tokens-per-block (default: `kvjax serve`'s, its default token budget of 256 in whole blocks)")
    c.add_argument("--max-num-seqs", "--max-batch-size", dest="max_batch_size", type=_positive_int, default=8,
                   metavar="N", help="hybrid checkpoints: requests running at once, each holding live + write "
                                     "state blocks (default 8, as `kvjax serve`)")
    _route_sim_parser(sub)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /metrics)",
                        description="vLLM's flags have vLLM's meanings; see docs/serving.md for the table.")
    sv.add_argument("model", help="built-in model name (configs/models/), a model TOML, or a checkpoint directory")
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    sv.add_argument("--port", type=_int_at_least(0), default=8000)
    sv.add_argument("--served-model-name", nargs="+", metavar="NAME",
                    help="names clients may send as `model`; the first is reported (default: MODEL as given)")
    sv.add_argument("--api-key", nargs="+", action="extend", metavar="KEY",
                    help="require `Authorization: Bearer KEY` on /v1/* (401 otherwise); default: $VLLM_API_KEY, as vLLM")
    sv.add_argument("--tokenizer", help="tokenizer directory (default: the checkpoint's, or the built-in byte tokenizer)")
    sv.add_argument("--seed", type=int, default=0,
                    help="base seed of the sampling of requests that send no seed, as vLLM's (default 0)")
    sv.add_argument("--model-seed", type=int, default=0,
                    help="weights seed of a built-in random-weight model (kvjax's former --seed; default 0)")
    sv.add_argument("--dtype", type=_model_dtype, default=None, metavar="{auto,bfloat16,float16,half,float32,float}",
                    help="weights and activations dtype (default auto: the model's)")
    sv.add_argument("--strict-config", action="store_true",
                    help="refuse a checkpoint whose config.json has keys kvjax does not read")
    sv.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=1, metavar="N",
                    help="devices to shard weights and KV heads over (default 1)")
    sv.add_argument("--gpu-memory-utilization", type=_fraction, default=0.9, metavar="F",
                    help="fraction of each device's memory (JAX's allocator limit) for weights, activations and KV "
                         "cache; the KV cache gets what is left (default 0.9). A CPU reports no device memory: "
                         "there the cache gets --kv-cache-memory-bytes (default 1GiB)")
    sv.add_argument("--kv-cache-memory-bytes", "--kv-cache-memory", dest="kv_cache_memory_bytes", type=_size_arg,
                    metavar="SIZE", help="KV cache bytes per device, e.g. 4GiB (overrides --gpu-memory-utilization)")
    sv.add_argument("--primary-blocks", type=_positive_int,
                    help="KV cache blocks on the device, instead of sizing the cache from memory")
    sv.add_argument("--secondary-blocks", type=_nonneg_int, help="KV cache blocks in host memory (offload tier)")
    sv.add_argument("--tokens-per-block", "--block-size", dest="tokens_per_block", type=_positive_int, metavar="N",
                    help="tokens per KV block, a power of two (default 16)")
    sv.add_argument("--snapshot-interval", "--mamba-block-size", dest="snapshot_interval", type=_positive_int,
                    metavar="N", help="hybrid models: tokens between recurrent-state snapshots, a multiple of "
                    "--block-size (default: --max-num-batched-tokens rounded down to whole blocks); prefill "
                    "chunks end there and prefix hits resume there")
    sv.add_argument("--max-model-len", "--max-seq-len", dest="max_seq_len", type=_positive_int, metavar="N",
                    help="longest prompt + output in tokens (default: the model's)")
    kv_dtypes = KV_CACHE_DTYPE_CHOICES + tuple(_VLLM_KV_CACHE_DTYPES)
    sv.add_argument("--kv-cache-dtype", type=_kv_cache_dtype, metavar="{" + ",".join(kv_dtypes) + "}",
                    help="KV pool dtype (default auto: the model's; fp8 = fp8_e4m3 = float8_e4m3fn with per-block scales)")
    sv.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                    help="reuse cached prefixes (default on)")
    sv.add_argument("--no-prefix-caching", action="store_true", help="same as --no-enable-prefix-caching")
    sv.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="schedule and dispatch step n+1 while step n runs on the device, reading tokens one "
                         "step late (default off; penalties / min_tokens requests step synchronously)")
    sv.add_argument("--policy", choices=["guaranteed_no_evict", "max_utilization"])
    sv.add_argument("--queue-policy", choices=["fcfs", "lpm"], help="waiting-queue order (default fcfs)")
    sv.add_argument("--max-wait-steps", type=_positive_int, help="lpm starvation guard (engine steps)")
    sv.add_argument("--max-num-seqs", "--max-batch-size", dest="max_batch_size", type=_positive_int, metavar="N",
                    help="requests running at once (default 8)")
    sv.add_argument("--max-num-batched-tokens", "--max-num-tokens", dest="max_num_tokens", type=_positive_int, metavar="N",
                    help="token budget per step (prefill chunk size; default 256)")
    sv.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="any other [cache] / [engine] option, e.g. --option min_chunk_bucket=32 (TOML value syntax)")
    sv.add_argument("--max-pending", type=_positive_int, default=64,
                    help="requests queued or running at once; more get HTTP 429 (default 64)")
    sv.add_argument("--default-max-tokens", type=_positive_int, default=256,
                    help="max_tokens of chat requests that set none (default 256)")
    sv.add_argument("--shutdown-timeout", type=float, default=10.0,
                    help="seconds in-flight requests get to finish at shutdown (default 10)")
    sv.add_argument("--kv-events-endpoint", metavar="tcp://HOST:PORT",
                    help="publish the cache's KV events (vLLM's wire format) on a ZeroMQ PUB socket bound here")
    sv.add_argument("--kv-events-replay-endpoint", metavar="tcp://HOST:PORT",
                    help="bind a ZeroMQ ROUTER socket here that replays event batches a subscriber missed")
    sv.add_argument("--kv-events-topic", default="", help="topic prefixed to every KV-event message (default none)")
    sv.add_argument("--kv-transfer-config", metavar="JSON",
                    help="disaggregated prefill/decode: vLLM's KVTransferConfig JSON with kv_connector "
                         "JaxTransferConnector and kv_role kv_producer | kv_consumer | kv_both (docs/disaggregation.md)")
    sv.add_argument("--data-parallel-rank", type=_nonneg_int, default=0,
                    help="data-parallel rank written into the KV-event batches (default 0)")
    sv.add_argument("--kv-store", metavar="URL",
                    help="keep host KV blocks in a third tier a restart or another replica finds again: "
                         "file:///DIR[?max_bytes=100GiB], redis://HOST:PORT[/DB], memory://, or "
                         "package.module:Class?k=v (docs/kv_store.md); needs --secondary-blocks")
    sv.add_argument("--kv-store-write-policy", choices=["write_through", "write_through_selective", "write_back"],
                    help="when a host block is written to the store (default write_through)")
    sv.add_argument("--kv-store-prefetch-policy", choices=["best_effort", "wait_complete", "timeout"],
                    help="how long a request waits for its blocks from the store (default timeout)")
    sv.add_argument("--kv-store-prefetch-min-tokens", type=_nonneg_int, metavar="N",
                    help="missing tokens below which the store is not consulted (default 256)")
    sv.add_argument("--kv-store-prefetch-timeout", type=float, metavar="SECONDS",
                    help="timeout policy: seconds a prefetch may take, plus 0.002 s per block (default 0.5)")
    sv.add_argument("--kv-store-threads", type=_positive_int, metavar="N", help="store I/O threads (default 2)")
    sv.add_argument("--kv-store-model-id", metavar="ID",
                    help="the weights' identity in the store's keys (default: --model, --model-seed and --dtype)")
    sv.add_argument("--warmup", choices=["none", "common", "all"], default="common",
                    help="compile the step programs before serving: decode and single-chunk prefill shapes "
                         "(common, the default), every shape the settings allow (all), or none (compile on "
                         "first use)")
    sv.add_argument("--compilation-cache-dir", metavar="DIR",
                    help="JAX's persistent compilation cache for this server's programs (default: "
                         "$KVJAX_COMPILATION_CACHE_DIR, else ~/.cache/kvjax/jax)")
    sv.add_argument("--no-compilation-cache", action="store_true",
                    help="compile every program anew (no persistent compilation cache)")
    sv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    sv.add_argument("--disable-log-requests", action="store_true", help="no per-request line (logged at debug level)")
    sv.add_argument("--disable-log-stats", action="store_true", help="no periodic stats line")
    sv.add_argument("--log-stats-interval", type=_positive_float, default=10.0,
                    help="seconds between two stats lines while serving (default 10)")
    _router_parser(sub)
    return p


# ---------------------------------------------------------------------- capacity
# ---------------------------------------------------------------------- serving
@dataclasses.dataclass
class _Setup:
    spec: Any
    workload: Any
    cache: dict
    engine: Any
    name: str
    checkpoint: str | None = None  # a Hugging Face checkpoint directory, else a random-weight model


def _setup(args, *, demo: bool) -> _Setup:
    """Load and validate everything a serving command needs, before JAX is imported."""
    from kvjax.engine.config import EngineConfig
    from kvjax.engine.workloads import load_workload, workload_from_dict
    from kvjax.model_catalog import hybrid_checkpoint, servable_model

    wf = load_workload(args.workload)
    fields = {f.name: getattr(wf.workload, f.name) for f in dataclasses.fields(wf.workload)}
    overrides: dict[str, Any] = {}
    for item in args.set:
        if "=" not in item:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        overrides[key.strip()] = parse_value(value.strip())
    if demo:
        for flag, key in (("users", "users"), ("turns", "turns"), ("max_new_tokens", "max_new_tokens")):
            if getattr(args, flag, None) is not None:
                overrides[key] = getattr(args, flag)
    workload = workload_from_dict({"kind": wf.workload.kind, **fields, **overrides}, wf.path) if overrides else wf.workload
    strict = getattr(args, "strict_config", False)
    checkpoint_dir = hybrid_checkpoint(args.model or wf.model or "tiny")
    if checkpoint_dir is not None:  # LFM2, Granite-4.0-H, Qwen3.5: their family's spec, served by HybridRunner
        from kvjax.hybrid_capacity import hybrid_spec

        spec = hybrid_spec(checkpoint_dir, strict=strict)
    else:
        spec, checkpoint_dir = servable_model(args.model or wf.model or "tiny", strict_config=strict)
    checkpoint = None if checkpoint_dir is None else str(checkpoint_dir)
    cache = dict(wf.cache)
    for flag, key in (("primary_blocks", "primary_blocks"), ("secondary_blocks", "secondary_blocks"),
                      ("tokens_per_block", "tokens_per_block"), ("max_seq_len", "max_seq_len"),
                      ("kv_cache_dtype", "kv_cache_dtype")):
        if getattr(args, flag) is not None:
            cache[key] = getattr(args, flag)
    if args.no_partial_reuse:
        cache["enable_partial_reuse"] = False
    engine = dict(wf.engine)
    for flag in ("policy", "max_batch_size", "max_num_tokens"):
        if getattr(args, flag) is not None:
            engine[flag] = getattr(args, flag)
    engine_config = EngineConfig.from_dict(engine, wf.path)
    # fail on a bad [cache] now, not after JAX started
    from kvjax.engine.config import cache_config

    cache_config(spec, cache, max_num_tokens=engine_config.scheduler.max_num_tokens, source=wf.path)
    return _Setup(spec, workload, cache, engine_config, workload.name, checkpoint)


@functools.lru_cache(maxsize=4)
def _model_and_runner(spec, seed: int, checkpoint: str | None = None):
    """The model and its jitted runner, kept for later commands of the same process (tests,
    notebooks calling `main` repeatedly) so their executables are compiled once."""
    from kvjax.engine.hybrid_runner import HybridRunner
    from kvjax.engine.runner import ModelRunner
    from kvjax.models import Transformer, from_pretrained
    from kvjax.models.hybrid.paged import is_hybrid_spec

    if checkpoint and is_hybrid_spec(spec):  # its family's loader (the checkpoint's dtype)
        hybrid = from_pretrained(checkpoint)
        return hybrid, HybridRunner(hybrid)
    model = from_pretrained(checkpoint, spec=spec) if checkpoint else Transformer.from_spec(spec, seed=seed)
    return model, ModelRunner(model)


def _serve(setup: _Setup, args, runs: list[tuple[str, bool]]):
    """Run the workload once per (label, reuse) with one engine (shared compiled executables)."""
    from kvjax.engine.config import cache_config
    from kvjax.engine.engine import Engine

    model, runner = _model_and_runner(setup.spec, args.seed, setup.checkpoint)
    engine = Engine(model, setup.engine, runner=runner)
    items = setup.workload.build(setup.spec.vocab_size)
    results = []
    for label, reuse in runs:
        cfg = cache_config(model.spec, {**setup.cache, "enable_block_reuse": reuse},  # a hybrid's in its dtype
                           max_num_tokens=setup.engine.scheduler.max_num_tokens)
        progress, bar = None, None
        if not args.no_progress:
            from tqdm import tqdm

            bar = tqdm(total=len(items), desc=f"{setup.name}: {label}", unit="req", file=sys.stderr, leave=True)
            progress = bar.update
        try:
            results.append(engine.run(items, cfg, label=label, progress=progress))
        finally:
            if bar is not None:
                bar.close()
    return results


def _report(setup: _Setup, args, results, stem: str) -> bool:
    """Print the table (side by side), write JSON + PNG. Returns whether outputs are identical."""
    from kvjax.engine.engine import identical_outputs, max_logit_difference, min_margin
    from kvjax.engine.metrics import format_table, plot_runs, write_json

    columns = [(r.metrics.label, r.metrics.summary()) for r in results]
    extra = []
    identical = True
    if len(results) == 2:
        a, b = results
        identical = identical_outputs(a, b)
        saved = columns[1][1]["prefill_computed_tokens"] - columns[0][1]["prefill_computed_tokens"]
        ratio = columns[1][1]["ttft_mean_s"] / columns[0][1]["ttft_mean_s"] if columns[0][1]["ttft_mean_s"] else float("nan")
        extra = [
            ("generated tokens identical", ["yes" if identical else "NO"] * 2),
            ("max |logit diff| of sampled tokens", [f"{max_logit_difference(a, b):.2e}"] * 2),
            ("min top-2 logit margin", [f"{min_margin(results):.2e}"] * 2),
            ("prefill tokens saved by reuse", [str(saved), "-"]),
            ("TTFT speed-up (mean)", [f"{ratio:.2f}x", "-"]),
        ]
    print(f"workload {setup.name!r} ({setup.workload.kind}) on model {setup.spec.name!r}")
    print(format_table(columns, extra))
    out = Path(args.out)
    payload = {
        "workload": setup.workload.describe(),
        "model": setup.spec.name,
        "cache": setup.cache,
        "engine": {"policy": setup.engine.scheduler.policy.value, "max_batch_size": setup.engine.scheduler.max_batch_size,
                   "max_num_tokens": setup.engine.scheduler.max_num_tokens},
        "runs": [r.metrics.to_dict() for r in results],
    }
    if len(results) == 2:
        payload["identical_outputs"] = identical
        payload["max_logit_difference"] = max_logit_difference(*results)
    js = write_json(out / f"{stem}.json", payload)
    png = plot_runs(out / f"{stem}.png", [r.metrics for r in results], title=f"{setup.name} on {setup.spec.name}")
    print(f"wrote {js} and {png}")
    return identical


def cmd_demo(args) -> int:
    setup = _setup(args, demo=True)
    results = _serve(setup, args, [("reuse on", True), ("reuse off", False)])
    identical = _report(setup, args, results, "demo")
    if not identical:
        print("kvjax: error: generated tokens differ with and without reuse", file=sys.stderr)
        return 1
    return 0


def cmd_run(args) -> int:
    setup = _setup(args, demo=False)
    runs = (
        [("reuse on", True), ("reuse off", False)]
        if args.compare
        else [("reuse off" if args.no_reuse else "reuse on", not args.no_reuse)]
    )
    results = _serve(setup, args, runs)
    identical = _report(setup, args, results, f"run-{setup.name}")
    return 0 if identical else 1


# ---------------------------------------------------------------------- route-sim
def _route_sim_parser(sub) -> None:
    s = sub.add_parser("route-sim", help="compare routing policies on a workload over simulated replicas")
    s.add_argument("--replicas", type=_positive_int, default=4, help="replicas (default 4)")
    s.add_argument(
        "--workload", required=True, help="workload file or name in configs/workloads/ ([cache] and [engine] size one replica)"
    )
    s.add_argument("--policies", default="kv-aware,round-robin,least-loaded", help="comma-separated routing policies")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a [workload] field")
    s.add_argument("--primary-blocks", type=_positive_int, help="primary blocks per replica")
    s.add_argument("--secondary-blocks", type=_nonneg_int, help="secondary blocks per replica")
    s.add_argument("--tick-s", type=float, default=0.02, help="seconds per workload arrival step (default 0.02)")
    s.add_argument("--alpha", type=float, help="kv-aware: weight of load against cached overlap")
    s.add_argument("--imbalance-cap", type=float, help="kv-aware: hard cap on load / mean load")
    s.add_argument("--no-reference", action="store_true", help="skip the single-replica reference run")
    s.add_argument("--out", default="results", help="directory for the JSON and PNG (default results/)")


def cmd_route_sim(args) -> int:
    from kvjax.router.policy import POLICIES
    from kvjax.router.sim import format_table, run_route_sim, write_report

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if not policies or unknown:
        raise ValueError(f"--policies must name policies among {sorted(POLICIES)}, got {args.policies!r}")
    if not args.tick_s > 0:
        raise ValueError(f"--tick-s must be > 0, got {args.tick_s}")
    overrides = {}
    for item in args.set:
        if "=" not in item:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        overrides[key.strip()] = parse_value(value.strip())
    cache = {k: v for k, v in (("primary_blocks", args.primary_blocks), ("secondary_blocks", args.secondary_blocks))
             if v is not None}
    kv_aware = {k: v for k, v in (("alpha", args.alpha), ("imbalance_cap", args.imbalance_cap)) if v is not None}
    run = run_route_sim(args.workload, replicas=args.replicas, policies=policies, tick_s=args.tick_s,
                        overrides=overrides, cache_overrides=cache, kv_aware=kv_aware, reference=not args.no_reference)
    print(f"workload {run.workload!r}: {args.replicas} replicas, {run.results[0].requests} requests")
    print(format_table(run.results, run.reference))
    js, png = write_report(run, args.out, f"route-sim-{run.workload}")
    print(f"wrote {js} and {png}")
    return 0


# ---------------------------------------------------------------------- router
def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return v


def _router_parser(sub) -> None:
    from kvjax.router.policy import POLICIES

    r = sub.add_parser("router", help="KV-aware router in front of kvjax serve replicas (OpenAI-compatible)")
    r.add_argument("--replica", action="append", default=[], metavar="URL",
                   help="a kvjax serve replica, e.g. http://10.0.0.5:8000 (repeat for each)")
    r.add_argument("--prefill-replica", action="append", default=[], metavar="URL",
                   help="disaggregated prefill/decode: a kvjax serve --kv-transfer-config kv_producer replica "
                        "(repeat; needs --decode-replica; instead of --replica)")
    r.add_argument("--decode-replica", action="append", default=[], metavar="URL",
                   help="disaggregated prefill/decode: a kv_consumer replica (repeat; needs --prefill-replica)")
    r.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    r.add_argument("--port", type=_int_at_least(0), default=8000)
    r.add_argument("--policy", choices=sorted(POLICIES), default="kv-aware", help="routing policy (default kv-aware)")
    r.add_argument("--alpha", type=float, help="kv-aware: weight of load against cached overlap (default 0.5)")
    r.add_argument("--imbalance-cap", type=float, help="kv-aware: hard cap on load / mean load (default 1.25)")
    r.add_argument("--tokenizer", help="tokenizer directory or built-in model name (default: what the replicas report)")
    r.add_argument("--health-interval", type=_positive_float, default=2.0, help="seconds between health checks (default 2)")
    r.add_argument("--request-timeout", type=_positive_float, default=600.0,
                   help="seconds a replica may take to answer or between two stream chunks (default 600)")
    r.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def router_config(args):
    from kvjax.router.app import RouterConfig

    options = tuple((k, v) for k, v in (("alpha", args.alpha), ("imbalance_cap", args.imbalance_cap)) if v is not None)
    if options and args.policy != "kv-aware":
        raise ValueError("--alpha and --imbalance-cap apply to --policy kv-aware only")
    return RouterConfig(tuple(args.replica), policy=args.policy, policy_options=options, tokenizer=args.tokenizer,
                        health_interval=args.health_interval, request_timeout=args.request_timeout,
                        prefill_replicas=tuple(args.prefill_replica), decode_replicas=tuple(args.decode_replica))


def cmd_router(args) -> int:

    from kvjax.router.launch import serve_router

    config = router_config(args)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
    for name in ("kvjax.router", "kvjax.kv_events"):
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(args.log_level.upper())
    mode = (f"prefill {len(config.prefill_replicas)} + decode {len(config.decode_replicas)}" if config.disaggregated
            else f"{len(config.replicas)}")
    print(f"kvjax router: {args.policy} over {mode} replicas on http://{args.host}:{args.port}", file=sys.stderr)
    serve_router(config, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a bad flag (already reported)
        return int(e.code or 0)
    commands = {"demo": cmd_demo, "run": cmd_run, "capacity": cmd_capacity, "serve": cmd_serve, "router": cmd_router,
                "route-sim": cmd_route_sim}
    try:
        return commands[args.command](args)
    except ValueError as e:  # bad config file, flag value or workload: one line, no traceback
        return _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
