"""Workload traces: deterministic from the seed, shaped like their traffic, loadable from files."""
import collections
import itertools
from pathlib import Path

import pytest

from kvjax.engine import (
    KINDS,
    ChatWorkload,
    FewShotWorkload,
    LongDocQAWorkload,
    SharedSystemPromptWorkload,
    load_workload,
    workload_from_dict,
)
from kvjax.engine.config import EngineConfig, cache_config
from kvjax.model_catalog import load_model_spec

VOCAB = 512
FILES = sorted((Path(__file__).resolve().parents[2] / "configs" / "workloads").glob("*.toml"))


@pytest.mark.parametrize("cls", [ChatWorkload, SharedSystemPromptWorkload, FewShotWorkload, LongDocQAWorkload])
def test_deterministic_from_seed(cls):
    a, b = cls(seed=4).build(VOCAB), cls(seed=4).build(VOCAB)
    assert a == b
    assert cls(seed=5).build(VOCAB) != a
    assert len({it.request_id for it in a}) == len(a)
    assert all(1 <= t < VOCAB for it in a for t in it.tokens)


def test_chat_turns_follow_their_parent():
    wl = ChatWorkload(users=3, turns=4, system_prompts=2, system_prompt_tokens=64, user_tokens=(5, 9),
                      arrival_interval=2, think_steps=3, priority=90, seed=1)
    items = wl.build(VOCAB)
    assert len(items) == 12
    by_id = {it.request_id: it for it in items}
    for u in range(3):
        first = by_id[f"u{u}-t0"]
        assert first.parent is None and first.arrival_step == 2 * u and 69 <= len(first.tokens) <= 73
        assert first.retention.ranges[0].start == 0 and first.retention.ranges[0].end == 64
        assert first.retention.ranges[0].priority == 90
        for t in range(1, 4):
            it = by_id[f"u{u}-t{t}"]
            assert it.parent == f"u{u}-t{t - 1}" and it.arrival_step == 3 and 5 <= len(it.tokens) <= 9
    systems = {by_id[f"u{u}-t0"].tokens[:64] for u in range(3)}
    assert 1 <= len(systems) <= 2  # users share a few system prompts


def test_zipf_popularity():
    wl = SharedSystemPromptWorkload(requests=400, system_prompts=5, system_prompt_tokens=8, zipf=1.2, seed=2)
    counts = collections.Counter(it.request_id.split("-sys")[1] for it in wl.build(VOCAB))
    ranked = [counts[str(i)] for i in range(5)]
    assert ranked == sorted(ranked, reverse=True) and ranked[0] > 3 * ranked[4]
    uniform = SharedSystemPromptWorkload(requests=400, system_prompts=5, system_prompt_tokens=8, zipf=0.0, seed=2)
    c = collections.Counter(it.request_id.split("-sys")[1] for it in uniform.build(VOCAB))
    assert max(c.values()) < 2 * min(c.values())


def test_few_shot_prefixes_nest():
    wl = FewShotWorkload(requests=30, tasks=2, instruction_tokens=10, example_tokens=(5, 8), shots=(1, 4),
                         query_tokens=3, seed=3)
    items = wl.build(VOCAB)
    by_task = collections.defaultdict(list)
    for it in items:
        _, task, k = it.request_id.split("-")
        by_task[task].append((int(k[1:]), it.tokens[:-3]))  # prefix without the query
    for prefixes in by_task.values():
        prefixes.sort()
        for (_, p1), (_, p2) in itertools.pairwise(prefixes):
            assert p2[: len(p1)] == p1  # fewer shots: a prefix of more shots


def test_long_doc_qa_and_isolation_options():
    wl = LongDocQAWorkload(documents=2, document_tokens=100, questions=6, question_tokens=4, tenants=2,
                           lora_ids=[7], priority=60, decode_priority=10, seed=6)
    items = wl.build(VOCAB)
    for it in items:
        doc = int(it.request_id.split("doc")[1])
        assert it.cache_salt == f"tenant{doc % 2}" and it.lora_task_id == 7
        assert len(it.tokens) == 104
        assert it.retention.decode_priority == 10 and it.retention.ranges[0].end == 100
    docs = {it.tokens[:100] for it in items}
    assert len(docs) == 2


def test_eos_never_in_prompts():
    items = ChatWorkload(users=4, turns=1, eos_id=5, seed=0).build(8)
    assert all(5 not in it.tokens for it in items) and all(it.eos_id == 5 for it in items)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_workload_files_load(path):
    wf = load_workload(path)
    assert wf.workload.kind in KINDS and wf.model
    spec = load_model_spec(wf.model)
    engine = EngineConfig.from_dict(wf.engine, str(path))
    config = cache_config(spec, wf.cache, max_num_tokens=engine.scheduler.max_num_tokens)
    items = wf.workload.build(spec.vocab_size)
    for it in items:  # every independent request fits the file's cache
        assert len(it.tokens) + it.max_new_tokens <= config.max_seq_len
    assert load_workload(path.stem).workload == wf.workload  # by name too


def test_all_kinds_have_a_file():
    assert {load_workload(p).workload.kind for p in FILES} == set(KINDS)
    assert {"chat", "shared-system-prompt", "few-shot", "long-doc-qa"} <= {p.stem for p in FILES}


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"kind": "poetry"}, "kind must be one of"),
        ({"kind": "chat", "userz": 3}, "unknown key 'userz'"),
        ({"kind": "chat", "users": 0}, "users must be an int >= 1"),
        ({"kind": "chat", "user_tokens": [9, 3]}, "lo > hi"),
        ({"kind": "chat", "priority": 101}, "priority must be an int in"),
        ({"kind": "chat", "top_p": 0}, "top_p"),
        ({"kind": "few-shot", "shots": [1, 2, 3]}, "shots must be an int or a"),
    ],
)
def test_bad_workload_tables(table, message):
    with pytest.raises(ValueError, match=message):
        workload_from_dict(table, "w.toml")


def test_bad_files(tmp_path):
    p = tmp_path / "w.toml"
    p.write_text("[workload]\nkind = 'chat'\n[cach]\nx = 1\n")
    with pytest.raises(ValueError, match=r"w.toml: unknown key or table 'cach'"):
        load_workload(p)
    p.write_text("[workload\n")
    with pytest.raises(ValueError, match="invalid TOML"):
        load_workload(p)
    with pytest.raises(ValueError, match="cannot read"):
        load_workload(tmp_path / "missing.toml")
    with pytest.raises(ValueError, match="unknown workload 'nope'"):
        load_workload("nope")
    with pytest.raises(ValueError, match=r"\[engine\] unknown key 'polcy'"):
        EngineConfig.from_dict({"polcy": "x"}, "w.toml")
    with pytest.raises(ValueError, match=r"\[engine\] scheduler policy must be one of"):
        EngineConfig.from_dict({"policy": "fifo"}, "w.toml")
    with pytest.raises(ValueError, match=r"\[cache\] tokens_per_block must be a positive power of two"):
        cache_config(load_model_spec("micro"), {"tokens_per_block": 12}, source="w.toml")
    with pytest.raises(ValueError, match=r"\[cache\] enable_block_reuse must be true or false"):
        cache_config(load_model_spec("micro"), {"enable_block_reuse": 1}, source="w.toml")
