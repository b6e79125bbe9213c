"""The engine survives failed transfers: `apply_transfers` is made to fail (a whole plan, or some
ops after the others applied) mid-run; the ledger drops what did not arrive, the engine
recomputes the prefixes it had reused, and greedy outputs stay identical to the dense oracle."""
import dataclasses

from engine_helpers import TIGHT, assert_same_tokens, cache, check_accounting

import kvjax.device
from kvjax.engine import ChatWorkload
from kvjax.errors import TransferError
from kvjax.ledger import KVCacheManager
from kvjax.transfer_plan import TransferPlan

CHAT = ChatWorkload(
    users=6, turns=3, system_prompts=2, system_prompt_tokens=(36, 44), user_tokens=(4, 20),
    max_new_tokens=(4, 10), arrival_interval=1, think_steps=1, priority=80, seed=7,
)


class FlakyTransfers:
    """Every `every`-th non-empty plan fails: wholly (nothing applied, pools untouched) or, with
    `partial`, all but every other op apply and the pools after them come with the error."""

    def __init__(self, real, every: int, partial: bool) -> None:
        self.real, self.every, self.partial = real, every, partial
        self.plans = self.failed_plans = self.failed_ops = 0

    def __call__(self, pools, plan, **kw):
        self.plans += 1
        if self.plans % self.every:
            return self.real(pools, plan, **kw)
        self.failed_plans += 1
        if not self.partial or len(plan) < 2:
            self.failed_ops += len(plan)
            raise TransferError(f"injected failure of plan {plan.seq}")
        ops = list(plan)
        failed = list(range(0, len(ops), 2))
        kept = TransferPlan.from_ops([op for i, op in enumerate(ops) if i not in failed])
        self.failed_ops += len(failed)
        raise TransferError(
            f"injected failure of ops {failed} of plan {plan.seq}", op_indices=failed, pools=self.real(pools, kept, **kw)
        )


def run_flaky(served, monkeypatch, every, partial, users=4):
    """Run the chat workload with failing transfers; returns the injector, the run and every
    `TransferFailure` the ledger answered."""
    flaky = FlakyTransfers(kvjax.device.apply_transfers, every, partial)
    answers = []
    real_failed = KVCacheManager.transfers_failed

    def recording(self, *a, **kw):
        answers.append(real_failed(self, *a, **kw))
        return answers[-1]

    monkeypatch.setattr(kvjax.device, "apply_transfers", flaky)
    monkeypatch.setattr(KVCacheManager, "transfers_failed", recording)
    items = dataclasses.replace(CHAT, users=users).build(served.model.spec.vocab_size)
    try:
        res = served.engine().run(items, cache(served.model, primary=TIGHT))
    finally:
        monkeypatch.undo()
    return flaky, res, answers


def test_failed_plans_recompute_and_match_the_dense_oracle(micro, monkeypatch):
    for partial in (False, True):
        flaky, res, answers = run_flaky(micro, monkeypatch, every=3, partial=partial)
        assert flaky.failed_plans >= 3 and flaky.failed_ops > 0 and len(answers) == flaky.failed_plans
        # some failures hit blocks a request had just reused: it recomputed them
        assert any(a.recompute_from for a in answers)
        assert_same_tokens(res.outputs, micro.dense(res))
        check_accounting(res)


def test_failed_plans_on_the_sliding_window_model(micro_swa, monkeypatch):
    """A request whose recompute would read blocks its window released is admitted again."""
    flaky, res, answers = run_flaky(micro_swa, monkeypatch, every=2, partial=False)
    assert flaky.failed_plans > 0 and any(a.recompute_from for a in answers)
    assert any(a.readmit for a in answers)
    assert_same_tokens(res.outputs, micro_swa.dense(res))
    check_accounting(res)
