"""Shared-prefix completion CE (envace_core/training/prefix_grad.py) equals the row-by-row computation,
and the SFT warm-up's batches each come from one prompt cluster (envace_core/training/sft.py)."""

from __future__ import annotations

import pytest
import torch

import envace_core  # noqa: F401  (offline environment before tau2)
from envace_core.config import TrainConfig
from envace_core.training.prefix_grad import common_prefix
from envace_core.training.sft import SFTExample, batch_order, prompt_clusters


def _trainer(tiny_model_dir):
    from envace_core.models import load_model, load_tokenizer
    from envace_core.training.trainer import PolicyTrainer

    torch.manual_seed(0)
    cfg = TrainConfig(lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    tr = PolicyTrainer(load_model(str(tiny_model_dir)), load_tokenizer(str(tiny_model_dir)), cfg,
                       compute_dtype="float32")
    with torch.no_grad():  # LoRA B starts at 0: make it non-zero so the prefix's K/V depend on it
        for n, p in tr.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return tr


def _grads(tr):
    return {n: p.grad.detach().clone() for n, p in tr.model.named_parameters() if p.grad is not None}


def test_common_prefix():
    assert common_prefix([[1, 2, 3], [1, 2, 4], [1, 2]]) == 2
    assert common_prefix([[5], [6]]) == 0 and common_prefix([]) == 0


@pytest.mark.parametrize("split_head,recompute", [(True, True), (True, False), (False, True)])
def test_shared_prefix_loss_and_gradients_equal_row_by_row(tiny_model_dir, split_head, recompute):
    tr = _trainer(tiny_model_dir)
    tr.cfg.recompute_shared_root = recompute  # True: the prefix's forward runs again after the rows
    g = torch.Generator().manual_seed(1)
    head = torch.randint(5, 500, (80,), generator=g).tolist()  # a system message shared by the rows
    rows = [(head + torch.randint(5, 500, (k,), generator=g).tolist(),
             torch.randint(5, 500, (c,), generator=g).tolist()) for k, c in ((7, 5), (1, 9), (20, 3))]
    n_tok = sum(len(c) for _, c in rows)

    tr.model.zero_grad(set_to_none=True)
    ref_loss = 0.0
    for p, c in rows:  # the plain computation: each row whole
        ids = torch.tensor([p + c])
        logits = tr.model(input_ids=ids, use_cache=False).logits[0, len(p) - 1:-1].float()
        loss = torch.nn.functional.cross_entropy(logits, torch.tensor(c), reduction="sum") / n_tok
        loss.backward()
        ref_loss += loss.item()
    ref = _grads(tr)

    tr.model.zero_grad(set_to_none=True)
    tr._split_head = split_head  # False: the whole-model fallback
    got_loss = tr.completion_ce_backward(rows, 1.0 / n_tok)
    got = _grads(tr)
    assert got_loss == pytest.approx(ref_loss, rel=1e-5)
    assert set(got) == set(ref) and ref
    for n in ref:  # float32: only the summation order differs
        assert torch.allclose(got[n], ref[n], rtol=1e-4, atol=1e-6), n
    # the prefix's own gradient reached the adapter: without it layer 0's v_proj LoRA would differ
    assert any(float(ref[n].abs().sum()) > 0 for n in ref if "v_proj" in n)


def _ex(prompt, task="t"):
    return SFTExample(task_id=task, prompt_ids=prompt, completion_ids=[1], text="x", gold=None)


def test_batches_come_from_one_prompt_cluster_and_cover_every_example_once_per_pass():
    a, b = list(range(100, 200)), list(range(300, 400))  # two system messages of 100 tokens
    exs = [_ex(a + [i]) for i in range(7)] + [_ex(b + [i]) for i in range(5)] + [_ex([9, 9, 9])]
    clusters = prompt_clusters(exs)
    assert sorted(map(sorted, clusters)) == [list(range(7)), list(range(7, 12)), [12]]
    batches = batch_order(clusters, 3, torch.Generator().manual_seed(0))
    assert sorted(i for bt in batches for i in bt) == list(range(13))  # each example once
    assert all(len(bt) <= 3 for bt in batches) and len(batches) == 3 + 2 + 1
    assert all(any(set(bt) <= set(c) for c in clusters) for bt in batches)


def test_role_repeats_put_each_act_example_that_many_times_in_a_pass_and_keep_clusters_apart():
    a = list(range(100, 200))  # one system message shared by an ACT and a REHEARSE example set
    exs = [_ex(a + [i]) for i in range(5)] + [
        SFTExample(task_id="t", prompt_ids=a + [50 + i], completion_ids=[1], text="x", gold=None, role="rehearse")
        for i in range(4)]
    clusters = prompt_clusters(exs)
    assert sorted(map(sorted, clusters)) == [list(range(5)), list(range(5, 9))]  # role splits the prefix
    reps = [2 if exs[c[0]].role == "act" else 1 for c in clusters]
    batches = batch_order(clusters, 2, torch.Generator().manual_seed(0), reps)
    seen = sorted(i for bt in batches for i in bt)
    assert seen == sorted(list(range(5)) * 2 + list(range(5, 9)))  # ACT twice, REHEARSE once per pass
    assert all(len(set(bt)) == len(bt) for bt in batches)  # a repeat is its own reshuffled cut
    assert len(batches) == 2 * 3 + 2
    for bad in ([0, 1], [1], [True, 1], [1.5, 1], ["2", 1], {0: 2, 1: 1}):
        with pytest.raises(ValueError, match="repeats"):
            batch_order(clusters, 2, torch.Generator().manual_seed(0), bad)
