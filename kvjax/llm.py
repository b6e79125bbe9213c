"""`LLM`: offline batched generation, shaped like vLLM's.

    from kvjax import LLM, SamplingParams
    llm = LLM("tiny", primary_blocks=256)                 # built-in model + byte tokenizer
    outs = llm.generate(["Hello", "The capital of"], SamplingParams(max_tokens=16))
    print(outs[0].outputs[0].text, outs[0].outputs[0].finish_reason)

`model` is a built-in model name (`configs/models/NAME.toml`, random weights from
`model_seed`), a model TOML path, a Hugging Face checkpoint directory (loaded with
`kvjax.models.from_pretrained`, tokenizer from the same directory) or an already built model
(an NNX module with `.spec`; pass its `tokenizer` for text prompts). Other keyword options
configure the cache and the engine (see `kvjax.engine.llm_engine`). One `LLM` keeps one
ledger: later `generate` calls reuse the prefixes earlier ones cached, until
`reset_prefix_cache()`. `SamplingParams` carries vLLM's `n`, `logprobs`, `prompt_logprobs`,
penalties and `min_tokens`: a result then holds n `CompletionOutput`s, with logprobs as vLLM's.
"""
from __future__ import annotations

import itertools
import os
from collections.abc import Mapping, Sequence
from typing import Any, cast

from kvjax.engine.core_types import EngineBusyError
from kvjax.engine.llm_engine import LLMEngine
from kvjax.engine.outputs import RequestOutput
from kvjax.engine.sampling import SamplingParams
from kvjax.engine.store_tier_driver import model_identity
from kvjax.models.loading import load_model
from kvjax.tokenizer import Tokenizer

__all__ = ["LLM", "load_model"]


def resolve_tokenizer(tokenizer) -> Tokenizer | None:
    """A `Tokenizer` from a Tokenizer or a tokenizer directory; None stays None."""
    if tokenizer is None or isinstance(tokenizer, Tokenizer):
        return tokenizer
    if isinstance(tokenizer, (str, os.PathLike)):
        return Tokenizer.from_pretrained(os.fspath(tokenizer))
    raise TypeError(f"tokenizer must be a kvjax.Tokenizer or a directory, got {type(tokenizer).__name__}")


class LLM:
    """A model, its tokenizer and a step-wise engine, driven to completion by `generate`."""

    def __init__(
        self, model: Any, *, tokenizer=None, seed: int = 0, model_seed: int = 0, dtype: Any = None, runner=None,
        warmup: str = "none", **options: Any
    ) -> None:
        """`seed`: base of the sampling seeds of requests without their own; `model_seed`: the
        built-in models' weights; `runner`: a `ModelRunner` of the same model whose compiled
        executables to share; `warmup` ("none", "common", "all"; `kvjax.engine.warmup`): step
        programs compiled here instead of on first use (`self.warmup` reports it)."""
        from kvjax.engine.warmup import check_level

        check_level(warmup)
        built, loaded = load_model(model, seed=model_seed, dtype=dtype)
        tok = resolve_tokenizer(tokenizer) or loaded
        self.model_name = str(model) if isinstance(model, (str, os.PathLike)) else built.spec.name
        if options.get("kv_store") is not None and isinstance(model, (str, os.PathLike)):
            # the store's keys name the weights: a built-in model's come from model_seed
            options.setdefault("kv_store_model_id", model_identity(os.fspath(model), f"seed{model_seed}", dtype))
        self.llm_engine = LLMEngine.from_options(built, tokenizer=tok, seed=seed, runner=runner, **options)
        self.warmup = self.llm_engine.core.warm_up(warmup)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer | None:
        return self.llm_engine.tokenizer

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; one `RequestOutput` per prompt, in prompt order.

        `prompts`: a string, a list of token ids, `{"prompt": text}` / `{"prompt_token_ids":
        ids}`, or a list of these. `sampling_params`: one for all, or one per prompt. Every
        prompt is checked before any is queued: a bad one raises and nothing runs.
        """
        items = self._prompt_list(prompts)
        params = self._params_list(sampling_params, len(items))
        return self._run(items, params, use_tqdm)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation ([{"role", "content"}, ...]) or a list of them,
        rendered with the tokenizer's chat template."""
        tok = self.get_tokenizer()
        if tok is None:
            raise ValueError("chat needs a tokenizer")
        one = bool(messages) and isinstance(messages[0], Mapping)
        conversations = cast(list[Sequence[Mapping[str, Any]]], [messages] if one else list(messages))
        items: list[tuple[str | None, list[int]]] = []
        for conv in conversations:
            text = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, chat_template=chat_template)
            assert isinstance(text, str)  # tokenize=False renders text
            items.append((text, tok.encode(text, add_special_tokens=False)))
        params = self._params_list(sampling_params, len(items))
        return self._run(items, params, use_tqdm)

    def close(self) -> None:
        """Finish the KV store's writes in flight (`kv_store=`: a restart finds them) and stop
        publishing KV events; the LLM must not generate afterwards (idempotent)."""
        self.llm_engine.close()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (e.g. after a weight update). Returns False, changing
        nothing, if requests are running (possible only if a `generate` was interrupted)."""
        try:
            self.llm_engine.reset_prefix_cache()
        except EngineBusyError:
            return False
        return True

    # ------------------------------------------------------------------ pieces
    def _prompt_list(self, prompts: Any) -> list[tuple[str | None, list[int]]]:
        eng = self.llm_engine
        if isinstance(prompts, (str, Mapping)) or (
            isinstance(prompts, (list, tuple))
            and prompts
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts)
        ):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a non-empty list (or a single prompt)")
        out = []
        for p in prompts:
            if isinstance(p, Mapping):
                if "prompt_token_ids" in p:
                    out.append((p.get("prompt"), eng.tokenize(list(p["prompt_token_ids"]))))
                elif "prompt" in p:
                    out.append((p["prompt"], eng.tokenize(p["prompt"])))
                else:
                    raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
            elif isinstance(p, str):
                out.append((p, eng.tokenize(p)))
            else:
                out.append((None, eng.tokenize(p)))
        return out

    @staticmethod
    def _params_list(sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n or not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError(f"sampling_params must be one SamplingParams or one per prompt ({n})")
        return params

    def _run(
        self, items: list[tuple[str | None, list[int]]], params: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        eng = self.llm_engine
        ids = [str(next(self._ids)) for _ in items]
        for rid, (_, toks), p in zip(ids, items, params, strict=True):
            eng.check_request(rid, toks, p)  # all or nothing
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(items), desc="generate", unit="req")
        try:
            for rid, (text, toks), p in zip(ids, items, params, strict=True):
                eng.add_request(rid, text if text is not None else toks, p, prompt_token_ids=toks)
            while eng.has_unfinished_requests():
                for out in eng.step():
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in ids:  # leave no request behind in the engine
                eng.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[rid] for rid in ids]
