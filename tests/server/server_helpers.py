"""The server tests' shared pieces: the micro model's options and a `Stack` of model, runner and
tokenizer (imported by name: a module called `conftest` is ambiguous once several test folders
have one)."""
from kvjax import Tokenizer
from kvjax.engine import Engine, EngineConfig, LLMEngine, ModelRunner, cache_config
from kvjax.models import Transformer, jit_dense_forward
from kvjax.server import ServerConfig, ServerThread

MODEL = "micro"
OPTIONS = dict(tokens_per_block=8, max_seq_len=256, primary_blocks=64, secondary_blocks=0)
ENGINE = dict(max_batch_size=4, max_num_tokens=64, min_batch_bucket=4, min_chunk_bucket=64, min_blocks_bucket=32,
              prefill_rows=1)


class Stack:
    """Model, runner and tokenizer shared by every engine of the module."""

    def __init__(self):
        self.model = Transformer.from_spec(MODEL, seed=0)
        self.runner = ModelRunner(self.model)
        self.tokenizer = Tokenizer.builtin(self.model.spec.vocab_size)
        self.dense_forward = jit_dense_forward(self.model)

    def engine(self, **engine_options) -> LLMEngine:
        config = EngineConfig.from_dict({**ENGINE, **engine_options})
        cc = cache_config(self.model.spec, OPTIONS, max_num_tokens=config.scheduler.max_num_tokens)
        return LLMEngine(Engine(self.model, config, runner=self.runner), cc, tokenizer=self.tokenizer)

    def server(self, engine: LLMEngine | None = None, **config) -> ServerThread:
        return ServerThread(engine or self.engine(), ServerConfig(MODEL, **config))
