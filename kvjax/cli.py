"""The `kvjax` command.

  kvjax demo      serve the default chat workload on the built-in model with prefix reuse,
                  then again without, and print both side by side (tokens must be identical)
  kvjax run       serve any workload file with any cache / engine settings
  kvjax capacity  how many blocks and tokens a model's KV cache gets from a memory budget

A bad flag or config file prints one line, `kvjax: error: ...`, and exits with status 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

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


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `kvjax: error: ...`, exit status 2."""

    def error(self, message: str):  # noqa: D401 (argparse API)
        raise SystemExit(_fail(message))


def _fail(message: str) -> int:
    print(f"kvjax: error: {message}", file=sys.stderr)
    return 2


# ---------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kvjax", description="kvjax: a paged KV-cache manager for LLM inference in JAX.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="{demo,run,capacity}")

    def serving_flags(sp, workload_default: str | None):
        sp.add_argument("--workload", default=workload_default, required=workload_default is None,
                        help="workload file or name in configs/workloads/" + (f" (default {workload_default})" if workload_default else ""))
        sp.add_argument("--model", help="model name in configs/models/ or a model TOML (default: the workload's, else tiny)")
        sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a [workload] field, e.g. --set users=2 (TOML value syntax)")
        sp.add_argument("--primary-blocks", type=_positive_int)
        sp.add_argument("--secondary-blocks", type=_nonneg_int)
        sp.add_argument("--tokens-per-block", type=_positive_int)
        sp.add_argument("--max-seq-len", type=_positive_int)
        sp.add_argument("--policy", choices=["guaranteed_no_evict", "max_utilization"])
        sp.add_argument("--max-batch-size", type=_positive_int)
        sp.add_argument("--max-num-tokens", type=_positive_int, help="token budget per step (prefill chunk size)")
        sp.add_argument("--no-partial-reuse", action="store_true")
        sp.add_argument("--seed", type=int, default=0, help="model weights seed")
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
    c.add_argument("--model", required=True, help="model name or TOML (configs/models/NAME.toml)")
    c.add_argument("--gpu-memory", required=True, type=_size_arg, help="device memory free for the KV cache, e.g. 141GiB")
    c.add_argument("--host-memory", type=_size_arg, default=0, help="host memory for the secondary tier, e.g. 512GiB")
    c.add_argument("--fraction", type=_fraction, default=0.9, help="fraction of --gpu-memory given to the cache (default 0.9)")
    c.add_argument("--input-len", type=_nonneg_int, default=2048)
    c.add_argument("--output-len", type=_nonneg_int, default=512)
    c.add_argument("--tokens-per-block", type=_positive_int, default=32)
    c.add_argument("--beam-width", type=_positive_int, default=1)
    c.add_argument("--max-seq-len", type=_positive_int, help="default: the model's")
    c.add_argument("--dtype", help="KV cache dtype (default: the model's), e.g. float8_e4m3fn")
    return p


# ---------------------------------------------------------------------- capacity
def cmd_capacity(args) -> int:
    from kvjax import capacity as C
    from kvjax.model_spec import ModelSpec

    spec = ModelSpec.load(args.model)
    primary = int(args.gpu_memory * args.fraction)
    config = C.cache_config_from_memory(
        spec, primary, args.host_memory, tokens_per_block=args.tokens_per_block, max_seq_len=args.max_seq_len,
        dtype=args.dtype, max_beam_width=args.beam_width,
    )
    tpb = config.tokens_per_block
    per_token = config.cache_size_per_token
    shares = C.window_size_shares(config.window_to_layers, per_token)
    gib = 2**30
    print(f"model            {spec.name}  ({config.num_layers} layers, kv heads {config.num_kv_heads}, head dim {config.head_dim}, {config.dtype})")
    scale_bytes = sum(config.kv_scale_bytes_per_token.values())
    scales = f"; {_int(scale_bytes)} of them FP8 block scales" if scale_bytes else ""
    print(f"KV bytes/token   {_int(sum(per_token.values()))} (all layers, K and V{scales})")
    print(f"primary budget   {args.fraction:g} x {args.gpu_memory / gib:.2f} GiB = {primary} bytes ({primary / gib:.2f} GiB)")
    print(f"secondary budget {args.host_memory} bytes ({args.host_memory / gib:.2f} GiB)")
    print(f"tokens/block     {tpb}")
    header = ("window", "layers", "bytes/token", "share", "primary blocks", "primary tokens", "secondary blocks", "secondary tokens")
    rows = []
    for w in config.windows:
        pb, sb = config.primary_blocks_for(w), config.secondary_blocks_for(w)
        rows.append((str(w), str(len(config.window_to_layers[w])), str(_int(per_token[w])), f"{shares[w]:.2%}",
                     str(pb), str(pb * tpb), str(sb), str(sb * tpb)))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print("  ".join(h.rjust(wd) for h, wd in zip(header, widths)))
    for r in rows:
        print("  ".join(c.rjust(wd) for c, wd in zip(r, widths)))
    if args.input_len + args.output_len > 0:
        batch = C.max_batch_size(config, args.input_len, args.output_len, args.beam_width)
        print(f"max batch        {batch} requests of {args.input_len} input + {args.output_len} output tokens"
              f" (beam {args.beam_width})")
        for w in config.windows:
            need = C.max_block_requirements(args.input_len, args.output_len, config.sink_token_length, w, args.beam_width, tpb)
            print(f"  window {w}: {need} blocks per request")
    return 0


def _int(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


# ---------------------------------------------------------------------- serving
@dataclasses.dataclass
class _Setup:
    spec: Any
    workload: Any
    cache: dict
    engine: Any
    name: str


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare string


def _setup(args, *, demo: bool) -> _Setup:
    """Load and validate everything a serving command needs, before JAX is imported."""
    from kvjax.engine.config import EngineConfig
    from kvjax.engine.workloads import load_workload, workload_from_dict
    from kvjax.model_spec import ModelSpec

    wf = load_workload(args.workload)
    fields = {f.name: getattr(wf.workload, f.name) for f in dataclasses.fields(wf.workload)}
    overrides: dict[str, Any] = {}
    for item in args.set:
        if "=" not in item:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        overrides[key.strip()] = _parse_value(value.strip())
    if demo:
        for flag, key in (("users", "users"), ("turns", "turns"), ("max_new_tokens", "max_new_tokens")):
            if getattr(args, flag, None) is not None:
                overrides[key] = getattr(args, flag)
    workload = workload_from_dict({"kind": wf.workload.kind, **fields, **overrides}, wf.path) if overrides else wf.workload
    spec = ModelSpec.load(args.model or wf.model or "tiny")
    cache = dict(wf.cache)
    for flag, key in (("primary_blocks", "primary_blocks"), ("secondary_blocks", "secondary_blocks"),
                      ("tokens_per_block", "tokens_per_block"), ("max_seq_len", "max_seq_len")):
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
    return _Setup(spec, workload, cache, engine_config, workload.name)


@functools.lru_cache(maxsize=4)
def _model_and_runner(spec, seed: int):
    """The model and its jitted runner, kept for later commands of the same process (tests,
    notebooks calling `main` repeatedly) so their executables are compiled once."""
    from kvjax.engine.runner import ModelRunner
    from kvjax.models import Transformer

    model = Transformer.from_spec(spec, seed=seed)
    return model, ModelRunner(model)


def _serve(setup: _Setup, args, runs: list[tuple[str, bool]]):
    """Run the workload once per (label, reuse) with one engine (shared compiled executables)."""
    from kvjax.engine.config import cache_config
    from kvjax.engine.engine import Engine

    model, runner = _model_and_runner(setup.spec, args.seed)
    engine = Engine(model, setup.engine, runner=runner)
    items = setup.workload.build(setup.spec.vocab_size)
    results = []
    for label, reuse in runs:
        cfg = cache_config(setup.spec, {**setup.cache, "enable_block_reuse": reuse},
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
    runs = [("reuse on", True), ("reuse off", False)] if args.compare else [("reuse off" if args.no_reuse else "reuse on", not args.no_reuse)]
    results = _serve(setup, args, runs)
    identical = _report(setup, args, results, f"run-{setup.name}")
    return 0 if identical else 1


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a bad flag (already reported)
        return int(e.code or 0)
    commands = {"demo": cmd_demo, "run": cmd_run, "capacity": cmd_capacity}
    try:
        return commands[args.command](args)
    except ValueError as e:  # bad config file, flag value or workload: one line, no traceback
        return _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
