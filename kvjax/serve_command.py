"""`kvjax serve`: its flags turned into an engine (model, mesh, memory-sized cache) and a server config.

Kept apart from `kvjax/cli.py` (the parser and the other commands) so each file holds one
command's worth of logic; nothing here runs before `cmd_serve` is called, and JAX loads only
when the engine is built.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import tomllib
from typing import Any


def parse_value(text: str) -> Any:
    """A flag's KEY=VALUE value in TOML syntax (numbers, booleans, arrays); else the bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare string


def serve_options(args) -> dict[str, Any]:
    """The engine and cache options of `kvjax serve`'s flags (checked by `LLMEngine.from_options`)."""
    options: dict[str, Any] = {}
    for item in args.option:
        if "=" not in item:
            raise ValueError(f"--option expects KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        options[key.strip()] = parse_value(value.strip())
    for flag in ("primary_blocks", "secondary_blocks", "tokens_per_block", "max_seq_len", "kv_cache_dtype", "snapshot_interval",
                 "policy", "queue_policy", "max_wait_steps", "max_batch_size", "max_num_tokens"):
        if getattr(args, flag) is not None:
            options[flag] = getattr(args, flag)
    if args.no_prefix_caching and args.enable_prefix_caching:
        raise ValueError("--no-prefix-caching contradicts --enable-prefix-caching")
    if args.no_prefix_caching or args.enable_prefix_caching is False:
        options["enable_block_reuse"] = False
    if getattr(args, "async_scheduling", None) is not None:
        options["async_scheduling"] = args.async_scheduling
    return options


def kv_events_config(args):
    """The `KVEventsConfig` of `kvjax serve`'s --kv-events-* flags (None without an endpoint)."""
    from kvjax.engine.event_publishing import KVEventsConfig

    if args.kv_events_endpoint is None:
        if args.kv_events_replay_endpoint is not None or args.kv_events_topic:
            raise ValueError("--kv-events-replay-endpoint and --kv-events-topic need --kv-events-endpoint")
        return None
    return KVEventsConfig(args.kv_events_endpoint, replay_endpoint=args.kv_events_replay_endpoint,
                          topic=args.kv_events_topic, data_parallel_rank=args.data_parallel_rank)


@contextlib.contextmanager
def _logging_to_stderr(level: str):
    """A stderr handler on the `kvjax` logger at `level` while a command runs (removed after,
    so repeated `main` calls in one process neither stack handlers nor keep the level)."""
    root = logging.getLogger("kvjax")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(level.upper())
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)


def serve_mesh(tensor_parallel_size: int):
    """The device mesh of `--tensor-parallel-size` (None for 1); refused when JAX sees fewer devices."""
    if tensor_parallel_size == 1:
        return None
    import jax

    devices = jax.devices()
    if len(devices) < tensor_parallel_size:
        raise ValueError(f"--tensor-parallel-size {tensor_parallel_size} needs {tensor_parallel_size} devices, but JAX "
                         f"sees {len(devices)} ({devices[0].platform})")
    return jax.make_mesh((tensor_parallel_size,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=devices[:tensor_parallel_size])


def _device_memory_stats(mesh) -> dict | None:
    """JAX's memory figures of the (first) device the cache lives on; None on a CPU backend."""
    import jax

    if mesh is None:
        device = jax.local_devices()[0]
    else:
        device = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
    return device.memory_stats()


def _serve_model(args, mesh):
    """(model, tokenizer) of `kvjax serve`'s MODEL, with --dtype, --model-seed, --strict-config."""
    from kvjax.model_catalog import hybrid_checkpoint, servable_model
    from kvjax.tokenizer import Tokenizer

    hybrid = hybrid_checkpoint(args.model)
    if hybrid is not None:  # LFM2, Granite-4.0-H, Qwen3.5: their own loader (and config checks)
        from kvjax.models import from_pretrained

        tokenizer = Tokenizer.from_pretrained(hybrid) if (hybrid / "tokenizer.json").is_file() else None
        return from_pretrained(hybrid, dtype=args.dtype, mesh=mesh, strict_config=args.strict_config), tokenizer
    spec, path = servable_model(args.model, strict_config=args.strict_config)
    if path is None:
        if args.strict_config:
            raise ValueError("--strict-config checks a checkpoint's config.json; a built-in model has none")
        from kvjax.models import Transformer

        return Transformer.from_spec(spec, seed=args.model_seed, dtype=args.dtype), Tokenizer.builtin(spec.vocab_size)
    from kvjax.models import from_pretrained

    # the config was read (and checked, strictly if asked) by servable_model: not read again
    return from_pretrained(path, spec=spec, dtype=args.dtype, mesh=mesh), Tokenizer.from_pretrained(path)


def kv_transfer_config(args):
    """The `KVTransferConfig` of --kv-transfer-config (None without it); bad JSON or keys raise
    `TransferConfigError` (a ValueError) before the model loads."""
    raw = getattr(args, "kv_transfer_config", None)
    if raw is None:
        return None
    from kvjax.disagg import KVTransferConfig

    return KVTransferConfig.parse(raw)


def kv_store_config(args):
    """The `KVStoreConfig` of the --kv-store flags (None without --kv-store); the store opens
    with the engine (a bad URL raises `StoreURLError` then)."""
    from kvjax.engine.store_tier_driver import KVStoreConfig, model_identity

    flags = {"write_policy": args.kv_store_write_policy, "prefetch_policy": args.kv_store_prefetch_policy,
             "prefetch_min_tokens": args.kv_store_prefetch_min_tokens,
             "prefetch_timeout_s": args.kv_store_prefetch_timeout, "threads": args.kv_store_threads}
    if args.kv_store is None:
        given = [k for k, v in flags.items() if v is not None]
        if given or args.kv_store_model_id is not None:
            raise ValueError("the --kv-store-* flags need --kv-store URL")
        return None
    model_id = args.kv_store_model_id or model_identity(args.model, f"seed{args.model_seed}", args.dtype)
    return KVStoreConfig(url=args.kv_store, model_id=model_id, **{k: v for k, v in flags.items() if v is not None})


def serve_engine(args, options: dict[str, Any], kv_events=None, mesh=None, kv_store=None):
    """(LLMEngine, how its KV cache was sized or None) for `kvjax serve`: the model on `mesh`, the
    engine (which shards it), then the cache: --primary-blocks if given, else sized from memory
    (`capacity.serving_kv_cache_bytes`; a hybrid's KV and state pools split it by
    `capacity.hybrid_pool_split` for --max-num-seqs requests); a cache that cannot hold one
    --max-model-len request is refused."""
    from kvjax import capacity as C
    from kvjax.engine.config import EngineConfig, cache_config
    from kvjax.engine.engine import Engine
    from kvjax.engine.llm_engine import LLMEngine, split_options
    from kvjax.hybrid_capacity import hybrid_geometry_of_spec
    from kvjax.llm import resolve_tokenizer
    from kvjax.models.parallel import mesh_size

    cache_values, engine_values = split_options(options, "kvjax serve")
    if "primary_blocks" in cache_values and args.kv_cache_memory_bytes is not None:
        raise ValueError("--primary-blocks and --kv-cache-memory-bytes both size the KV cache: give one")
    engine_config = EngineConfig.from_dict(engine_values, "kvjax serve")
    max_num_tokens = engine_config.scheduler.max_num_tokens
    model, tokenizer = _serve_model(args, mesh)
    tokenizer = resolve_tokenizer(args.tokenizer) or tokenizer
    engine = Engine(model, engine_config, mesh=mesh)  # shards the weights over the mesh
    geometry = cache_config(model.spec, cache_values, max_num_tokens=max_num_tokens, source="kvjax serve")
    sizing = None
    if "primary_blocks" not in cache_values:
        hybrid = geometry.has_recurrent  # sized by TensorRT-LLM's rule: KV + a state block per snapshot interval
        batch = engine_config.scheduler.max_batch_size
        reserve_of: Any = hybrid_geometry_of_spec(model.spec) if hybrid else model.spec  # the fields the estimate reads
        reserve = C.activation_reserve_bytes(reserve_of, max(max_num_tokens, batch))
        total, sizing = C.serving_kv_cache_bytes(
            utilization=args.gpu_memory_utilization, activations=reserve, memory_stats=_device_memory_stats(mesh),
            kv_cache_bytes=args.kv_cache_memory_bytes, num_devices=1 if mesh is None else mesh_size(mesh))
        sized = C.cache_config_from_memory(geometry, total, tokens_per_block=geometry.tokens_per_block,
                                           max_batch_size=batch if hybrid else None)
        geometry = dataclasses.replace(geometry, primary_blocks=sized.primary_blocks)
    C.check_max_seq_len_fits(geometry)
    return LLMEngine(engine, geometry, tokenizer=tokenizer, seed=args.seed, kv_events=kv_events,
                     kv_transfer=kv_transfer_config(args), kv_store=kv_store), sizing


def serve_config(args, engine):
    """The `ServerConfig` of `kvjax serve`'s flags."""
    from kvjax.server import ServerConfig
    from kvjax.server.auth import api_keys

    names = args.served_model_name or [args.model]
    return ServerConfig(names[0], max_pending=args.max_pending, default_max_tokens=args.default_max_tokens,
                        shutdown_timeout=args.shutdown_timeout, tokenizer_source=args.tokenizer or args.model,
                        other_model_names=tuple(n for n in names[1:] if n != names[0]), api_keys=api_keys(args.api_key),
                        log_requests=not args.disable_log_requests,
                        log_stats_interval=None if args.disable_log_stats else args.log_stats_interval)


def cmd_serve(args) -> int:
    from kvjax.engine.llm_engine import split_options

    options = serve_options(args)
    split_options(options, "kvjax serve")  # unknown keys fail before the model loads
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    kv_events = kv_events_config(args)
    kv_transfer_config(args)  # bad JSON fails before the model loads
    kv_store = kv_store_config(args)
    from kvjax.server.auth import api_keys

    api_keys(args.api_key)  # an empty key fails before the model loads
    with _logging_to_stderr(args.log_level):
        _run_server(args, options, kv_events, kv_store)
    return 0


def compilation_cache(args) -> str | None:
    """Set up JAX's persistent compilation cache as --compilation-cache-dir / --no-compilation-cache
    ask, before any program compiles; returns the directory in use (None: off)."""
    import jax

    from kvjax.compilation_cache import enable_compilation_cache

    if args.no_compilation_cache:
        if args.compilation_cache_dir is not None:
            raise ValueError("--compilation-cache-dir and --no-compilation-cache contradict each other: give one")
        jax.config.update("jax_enable_compilation_cache", False)  # EngineCore's enable call then does nothing
        return None
    return enable_compilation_cache(args.compilation_cache_dir)  # a directory set here stands for EngineCore


def warm_up(core, level: str):
    """`--warmup`: compile the chosen step programs before the server listens, saying how far it got."""
    log = logging.getLogger("kvjax.serve")
    total = len(core.forward_shapes)
    if level == "none":
        log.info("warmup off: the first request of each of the %d step shapes compiles it", total)
        return None

    def progress(done: int, count: int, shape, seconds: float) -> None:
        if done == 1 or done == count or done % 10 == 0:
            log.info("warmup (%s): %d/%d step programs ready (%.1f s; last: %d decode rows, %d prefill rows x %d "
                     "tokens, tables %d blocks wide)", level, done, count, seconds, *shape)

    report = core.warm_up(level, progress)
    log.info("warmup (%s) done: %d of %d step shapes, %d programs traced, in %.1f s", level, report.shapes, total,
             report.traced, report.seconds)
    return report


def _run_server(args, options, kv_events, kv_store=None) -> None:
    from kvjax.config import RECURRENT_STATES
    from kvjax.server import serve
    from kvjax.server.stats_logger import log_startup

    cache_dir = compilation_cache(args)
    mesh = serve_mesh(args.tensor_parallel_size)
    engine, sizing = serve_engine(args, options, kv_events, mesh, kv_store)
    try:
        logging.getLogger("kvjax.serve").info("compilation cache: %s", cache_dir or "off")
        warm_up(engine.core, args.warmup)
        config = serve_config(args, engine)
        log_startup(engine, model_name=config.model_name, model_arg=args.model, sizing=sizing,
                    mesh_size=args.tensor_parallel_size)
        events = engine.kv_events_info()
        where = "" if events is None else f"; KV events on {events['endpoint']}" + (
            f" (replay {events['replay_endpoint']})" if events["replay_endpoint"] else "")
        auth = "; an API key is required on /v1" if config.api_keys else ""
        remote = engine.core.remote_kv
        if remote is not None:
            side = remote.producer
            where += f"; KV transfer {remote.config.kv_role}" + (
                "" if side is None else f" (side channel {side.host}:{side.port})")
        cc = engine.core.cache_config
        kv = [w for w in cc.windows if w != RECURRENT_STATES][0]  # a hybrid's state window says its own below
        states = (f", {cc.primary_blocks_for(RECURRENT_STATES)} recurrent-state blocks"
                  if RECURRENT_STATES in cc.windows else "")
        print(f"kvjax serve: model {config.model_name!r} on http://{args.host}:{args.port} (max_model_len "
              f"{engine.max_seq_len}, {cc.primary_blocks_for(kv)} primary blocks{states}{where}{auth})", file=sys.stderr)
        serve(engine, config, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.close()  # idempotent: the server's shutdown closed it already unless serving failed
