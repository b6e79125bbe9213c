"""Text in and out of real checkpoint directories: `kvjax.Tokenizer` against what transformers
wrote into each fixture's expected.json (encodings, decoding, rendered chat template, EOS ids),
and `kvjax.LLM` on a checkpoint directory generating transformers' greedy tokens."""
import pytest
from hf_helpers import FAMILIES, FIXTURES, expected

from kvjax import LLM, SamplingParams, Tokenizer


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_matches_transformers(family):
    want = expected(family)["tokenizer"]
    tok = Tokenizer.from_pretrained(FIXTURES / family)
    for case in want["encode"]:
        assert tok.encode(case["text"]) == case["ids"], case["text"]
        assert tok.decode(case["ids"]) == case["decoded"]
    chat = want["chat"]
    rendered = tok.apply_chat_template(chat["messages"], add_generation_prompt=chat["add_generation_prompt"])
    assert rendered == chat["rendered"]
    ids = tok.apply_chat_template(chat["messages"], add_generation_prompt=chat["add_generation_prompt"], tokenize=True)
    assert ids == chat["ids"]
    assert tok.eos_token_ids == frozenset(want["eos_token_ids"])


def test_llm_on_a_checkpoint_directory_generates_transformers_greedy_tokens():
    # llama3 is the sharded checkpoint with an index file; test_hf_engine covers every family
    family = "llama3"
    exp = expected(family)
    llm = LLM(str(FIXTURES / family), primary_blocks=64, tokens_per_block=4)
    params = [SamplingParams(max_tokens=len(g), temperature=0.0, ignore_eos=True) for g in exp["greedy"]]
    outs = llm.generate([{"prompt_token_ids": p} for p in exp["prompts"]], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == exp["greedy"]
    assert [list(o.prompt_token_ids) for o in outs] == exp["prompts"]
    # the text is the checkpoint tokenizer's decoding of those tokens
    tok = llm.get_tokenizer()
    assert outs[0].outputs[0].text == tok.decode(exp["greedy"][0])


def test_a_published_spec_without_weights_is_refused_by_llm():
    with pytest.raises(ValueError, match="no weights"):
        LLM("llama-3.1-8b")
