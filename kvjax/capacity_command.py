"""`kvjax capacity`: how many blocks and tokens a device's memory holds for a model, after its
weights and an activation reserve (TensorRT-LLM's sizing; hybrid checkpoints by its hybrid
rule: a token's KV plus a state block per snapshot interval, plus the running requests' state
blocks). The parser lives in `kvjax.cli`."""
from __future__ import annotations


def _weights_of(spec, model_arg: str) -> tuple[int, str]:
    """(weight bytes, where the figure comes from): a checkpoint's tensors, else the spec's parameter count."""
    from kvjax import capacity as C
    from kvjax.config import DTYPE_BYTES
    from kvjax.model_spec import checkpoint_dir

    path = checkpoint_dir(model_arg)
    if path is not None and (any(path.glob("*.safetensors")) or any(path.glob("*.safetensors.index.json"))):
        from kvjax.checkpoint_files import CheckpointTensors

        tensors = CheckpointTensors(path)
        params = tensors.served_parameters(spec.tie_embeddings)
        return int(params * DTYPE_BYTES[spec.dtype]), f"{_count(params)} parameters in the checkpoint, {spec.dtype}"
    return C.weight_bytes(spec), f"{_count(spec.num_parameters)} parameters from the spec, {spec.dtype}"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 10**9 else f"{n / 1e6:.2f}M" if n >= 10**6 else f"{n:,}"


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def cmd_capacity(args) -> int:
    from kvjax import capacity as C
    from kvjax.hybrid_capacity import hybrid_model_type
    from kvjax.model_catalog import load_model_spec
    from kvjax.model_spec import checkpoint_dir

    path = checkpoint_dir(args.model)
    if path is not None and hybrid_model_type(path) is not None:
        return _capacity_hybrid(args, path)
    if args.snapshot_interval is not None:
        raise ValueError("--snapshot-interval is for hybrid checkpoints (recurrent + attention layers)")
    spec = load_model_spec(args.model, strict_config=args.strict_config)
    weights, weights_from = _weights_of(spec, args.model)
    reserve = args.activation_reserve
    reserve_from = "given"
    if reserve is None:
        reserve = C.activation_reserve_bytes(spec, args.max_num_tokens)
        reserve_from = f"estimate for {args.max_num_tokens} tokens per step"
    primary = C.kv_cache_budget(args.gpu_memory, args.fraction, weights, reserve)
    config = C.cache_config_from_memory(
        spec, primary, args.host_memory, tokens_per_block=args.tokens_per_block, max_seq_len=args.max_seq_len,
        dtype=args.dtype, max_beam_width=args.beam_width,
    )
    tpb = config.tokens_per_block
    per_token = config.cache_size_per_token
    shares = C.window_size_shares(config.window_to_layers, per_token)
    gib = 2**30
    print(
        f"model            {spec.name}  ({config.num_layers} layers, kv heads {config.num_kv_heads}, "
        f"head dim {config.head_dim}, {config.dtype})"
    )
    scale_bytes = sum(config.kv_scale_bytes_per_token.values())
    scales = f"; {_int(scale_bytes)} of them FP8 block scales" if scale_bytes else ""
    print(f"KV bytes/token   {_int(sum(per_token.values()))} (all layers, K and V{scales})")
    print(f"weights          {_gib(weights)} ({weights_from})")
    print(f"activations      {_gib(reserve)} ({reserve_from})")
    print(f"primary budget   {args.fraction:g} x {_gib(args.gpu_memory)} - weights - activations = {primary} bytes "
          f"({_gib(primary)})")
    print(f"secondary budget {args.host_memory} bytes ({args.host_memory / gib:.2f} GiB)")
    print(f"tokens/block     {tpb}")
    header = (
        "window",
        "layers",
        "bytes/token",
        "share",
        "primary blocks",
        "primary tokens",
        "secondary blocks",
        "secondary tokens",
    )
    rows = []
    for w in config.windows:
        pb, sb = config.primary_blocks_for(w), config.secondary_blocks_for(w)
        rows.append((str(w), str(len(config.window_to_layers[w])), str(_int(per_token[w])), f"{shares[w]:.2%}",
                     str(pb), str(pb * tpb), str(sb), str(sb * tpb)))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print("  ".join(h.rjust(wd) for h, wd in zip(header, widths, strict=True)))
    for r in rows:
        print("  ".join(c.rjust(wd) for c, wd in zip(r, widths, strict=True)))
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


def _capacity_hybrid(args, path) -> int:
    """`kvjax capacity` of a hybrid checkpoint: TensorRT-LLM's rule (`hybrid_pool_split`): a
    token costs its attention KV plus a state block per snapshot interval, and the running
    requests a fixed 2 x max batch state blocks (live + write)."""
    from typing import Any, cast

    from kvjax import capacity as C
    from kvjax.checkpoint_files import CheckpointTensors
    from kvjax.config import DTYPE_BYTES, RECURRENT_STATES
    from kvjax.engine.config import default_snapshot_interval
    from kvjax.hybrid_capacity import hybrid_geometry

    geo = hybrid_geometry(path, strict=args.strict_config)
    params = CheckpointTensors(path).served_parameters(geo.tie_embeddings)
    weights = int(params * DTYPE_BYTES[geo.dtype])
    reserve = args.activation_reserve
    reserve_from = "given"
    if reserve is None:
        reserve = C.activation_reserve_bytes(cast(Any, geo), args.max_num_tokens)
        reserve_from = f"estimate for {args.max_num_tokens} tokens per step"
    primary = C.kv_cache_budget(args.gpu_memory, args.fraction, weights, reserve)
    shape = geo.cache_config(tokens_per_block=args.tokens_per_block, max_seq_len=args.max_seq_len, dtype=args.dtype,
                             snapshot_interval=args.snapshot_interval
                             or default_snapshot_interval(args.tokens_per_block, None))
    config = C.cache_config_from_memory(shape, primary, args.host_memory, tokens_per_block=args.tokens_per_block,
                                        max_batch_size=args.max_batch_size)
    tpb, interval, batch = config.tokens_per_block, config.snapshot_interval, args.max_batch_size
    assert interval is not None  # set by CacheConfig for a recurrent window
    state_block = config.recurrent_block_bytes
    per_token = config.cache_size_per_token
    attn = sum(b for w, b in per_token.items() if w != RECURRENT_STATES)
    print(f"model            {geo.name}  ({geo.family} hybrid: {geo.num_recurrent_layers} recurrent + "
          f"{geo.num_layers - geo.num_recurrent_layers} attention layers, kv heads {geo.num_kv_heads}, "
          f"head dim {geo.head_dim}, KV {config.dtype})")
    print(f"state bytes      {geo.state_bytes} per recurrent layer (conv state {geo.dtype}, any SSM / delta-rule state "
          f"float32); "
          f"{state_block} per state block (all recurrent layers at one position)")
    print(f"KV bytes/token   {_int(attn)} (attention layers, K and V)")
    print(f"snapshot every   {interval} tokens: a token costs {_int(attn)} + {state_block} / {interval} = "
          f"{_int(attn + state_block / interval)} bytes; the running requests {2 * batch} state blocks "
          f"(2 x {batch} requests: live + write) = {2 * batch * state_block} bytes")
    print(f"weights          {_gib(weights)} ({_count(params)} parameters in the checkpoint, {geo.dtype})")
    print(f"activations      {_gib(reserve)} ({reserve_from})")
    print(f"primary budget   {args.fraction:g} x {_gib(args.gpu_memory)} - weights - activations = {primary} bytes "
          f"({_gib(primary)})")
    print(f"secondary budget {args.host_memory} bytes ({args.host_memory / 2**30:.2f} GiB)")
    print(f"tokens/block     {tpb}")
    header = ("window", "layers", "bytes/block", "primary blocks", "primary tokens", "secondary blocks")
    rows = []
    for w in config.windows:
        pb, sb = config.primary_blocks_for(w), config.secondary_blocks_for(w)
        block = state_block if w == RECURRENT_STATES else _int(per_token[w] * tpb)
        tokens = f"{(pb - 2 * batch) * interval}" if w == RECURRENT_STATES else str(pb * tpb)
        name = f"{w} (states)" if w == RECURRENT_STATES else str(w)
        rows.append((name, str(len(config.window_to_layers[w])), str(block), str(pb), tokens, str(sb)))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print("  ".join(h.rjust(wd) for h, wd in zip(header, widths, strict=True)))
    for r in rows:
        print("  ".join(c.rjust(wd) for c, wd in zip(r, widths, strict=True)))
    print(f"(the state window's tokens: what its snapshots cover beside the {2 * batch} running-request blocks)")
    return 0
