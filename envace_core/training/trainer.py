"""The LoRA policy trainer: role-wise GRPO updates over generation rows (METHOD.md §3).

`PolicyTrainer.update(rows)` is one training iteration on one rollout batch (the PPO inner loop):

    for epoch in 1..ppo_epochs:                         (PPO inner epochs, Schulman et al. 2017 Alg. 1)
        for mini-batch M of mini_batch_rows rows       (a fresh seeded shuffle per epoch)
            step(M): one AdamW step on L(M), gradients accumulated over micro-batches
    lr <- schedule(iteration + 1)                     (once per rollout batch, as verl's actor does)

`PolicyTrainer.step` reads top to bottom: cut rows into micro-batches of at most `micro_batch_rows` rows and
`micro_batch_tokens` padded tokens (memory bounds only: the accumulated gradient equals one big batch's),
forward (autocast bf16 when asked; LoRA master weights stay float32), per-token log-probs of exactly the
generated ids, PPO-clip loss from `training.grpo`, backward, clip the gradient norm, AdamW step.

Adapter files and checkpoints: `training.persistence.TrainerPersistence`, which `PolicyTrainer` inherits.

The options (`TrainConfig`) and their math, per generated token t of row i with advantage A_i:
  - importance ratio r_t = pi_theta(y_t | ...) / pi_old(y_t | ...), where pi_old is the *behaviour*
    policy: the log-probs the engine recorded at rollout (`TrainingRow.old_logprobs`), fixed for all
    epochs of the update. In epoch 1 before any step r_t = 1 up to engine/trainer numerics.
  - `clip_eps` ε: l_t = -min(r_t A_i, clip(r_t, 1-ε, 1+ε) A_i).
  - `kl_beta` β: l_t += β (exp(ref_t - logp_t) - (ref_t - logp_t) - 1) (k3), ref = the base model,
    i.e. the same weights with the LoRA adapters disabled (peft `disable_adapter()`), no second copy.
  - `loss_agg`: "token-mean" L = Σ_t l_t / #tokens of the step; "seq-mean-token-mean" L = mean over
    rows of (mean over the row's tokens).
  - `max_grad_norm`: g <- g · min(1, c / ||g||_2) before each AdamW step (per adapter when
    `policy_per_role`: two policies, two norms).
  - `lr_scheduler` + `warmup_iterations` W over K = `iterations`: transformers.get_scheduler, stepped once per
    iteration (the factors are in `TrainConfig`'s field descriptions).
  - `policy_per_role`: two LoRA adapters "act" and "rehearse" (peft named adapters) on one base
    model; a row trains the adapter of its role (`engines.base.ROLE_ADAPTERS`: USER rows train
    "rehearse") and the loss is normalised per adapter, so each adapter's update is exactly that of a
    separate policy trained on its own rows. An `HFEngine` over this model generates each role with
    its adapter (`SamplingParams.role`).
  - data parallel (`training.distributed`, WORLD_SIZE > 1): `update`/`step` take the same global
    rows on every rank; each rank computes a cost-balanced share of every step with the global
    normaliser and the LoRA gradients are summed over ranks before clipping, so each optimizer step
    equals the one-process step over all rows; `mini_batch_rows` counts global rows.

Speed levers (measured in benchmarks/RESULTS.md, "Speed" and "Where an iteration's time goes"):
  - Rows sharing a prompt (a GRPO group) or a prefix (a system message) are batched together and the
    common prefix runs once at batch size 1; its KV cache, with grad, is repeated over the rows. A
    prefix that consecutive micro-batches share (≥ 128 tokens: a role's system message) runs once per
    step (`prefix_grad.SharedRoot`: gradient summed over the micro-batches, then one backward; with
    `recompute_shared_root` its forward runs again there instead of holding its activations).
  - On CPU, grouped key/value heads are not repeated per query head (`attention.grouped_kv_attention`);
    in bf16 the frozen linears run on oneDNN-packed bf16 weights shared with the engines (`_frozen_packed`).
  - The LM head runs only on completion tokens, in float32 (bf16 logits add ~1.7x more noise to the
    importance ratio), `logprob_chunk_tokens` at a time (`training.logprobs`: no [B, T, V] tensor).
  - The reference policy for KL is the same model with its adapters disabled, never a second copy.
"""

from __future__ import annotations

import inspect
import time
import warnings
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from envace_core.config import TrainConfig
from envace_core.engines import packed_linear
from envace_core.engines.base import ROLE_ADAPTERS, resolve_compute_dtype
from envace_core.models import check_lora_targets
from envace_core.training.attention import grouped_kv_attention
from envace_core.training.distributed import World, balanced_slices
from envace_core.training.grpo import policy_loss, token_logprobs
from envace_core.training.logprobs import DEFAULT_CHUNK_TOKENS, chunked_token_logprobs
from envace_core.training.persistence import CHECKPOINT_FORMAT, AdapterLoadError, CheckpointError, TrainerPersistence
from envace_core.training.prefix_grad import SharedRoot, root_clusters, shared_prefix_ce_backward
from envace_core.training.rows import TrainingRow, role_name, trainable_rows

__all__ = ["CHECKPOINT_FORMAT", "AdapterLoadError", "CheckpointError", "PolicyTrainer"]


@dataclass
class _Batch:
    """A right-padded micro-batch. Column t of the [B, T] tensors is sequence position start + t,
    whose logits predict input_ids[:, start + t + 1]."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    start: int  # first position whose logits are needed: min prompt length - 1
    shared: int  # length of the token prefix common to every row, capped at `start`
    targets: torch.Tensor  # [B, T] = input_ids[:, start + 1:], T = L - 1 - start
    mask: torch.Tensor  # [B, T] bool: True exactly on completion tokens
    old: torch.Tensor  # [B, T] behaviour log-probs at completion tokens, 0 elsewhere
    adv: torch.Tensor  # [B]
    temperature: torch.Tensor  # [B]


class PolicyTrainer(TrainerPersistence):
    """LoRA GRPO trainer around one causal LM shared by all roles (and by the generation engine).

    Args:
        model: a float32 HF causal LM (`envace_core.models.load_model`), or a PeftModel already
            holding the adapter(s). It is wrapped in place with LoRA (r, alpha, target modules from
            `cfg`, dropout 0): one adapter "default", or "act" and "rehearse" when
            `cfg.policy_per_role`; `self.model` is the PeftModel, the object a generation engine shares.
        tokenizer: its tokenizer (padding id).
        cfg: `TrainConfig`.
        compute_dtype: "bfloat16" (autocast on forward passes), "float32", or "auto"
            (`engines.base.resolve_compute_dtype`: bf16 on CUDA and on CPUs with native bf16).

    Attributes:
        optimizer, scheduler: AdamW and its LR schedule (stepped once per `update`).
        updates: `update` calls so far (= finished training iterations); optimizer_steps: AdamW steps.
        world: `distributed.World` of the process group initialised when the trainer was built (one
            process when none): its ranks split every step's rows and sum the LoRA gradients (`step`);
            the LoRA weights are broadcast from rank 0 here. The caller lets only rank 0 save.

    Raises:
        ValueError: unknown compute_dtype, or a PeftModel without the adapters `cfg` asks for.
        models.LoraTargetError: a name in `cfg.lora_target_modules` matches no module of `model`.
    """

    min_shared_prefix: int = 16  # tokens; a shorter common prefix is not worth a separate call
    # completion tokens whose logits exist at a time (`_token_logprobs`); None: the full [B, T, V]
    # float32 logits of `_logits` (also the path of a head that is not a plain linear).
    logprob_chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS
    # tokens; rows whose prompt lengths differ by more share no micro-batch: on the full-logits path (`_logits`,
    # [B, L - min prompt, V] float32) 4 rows with ~2k-token tool histories took > 15 GB on the 135M model.
    max_prompt_spread: int = 256
    packed_frozen: bool = True  # frozen linears on oneDNN-packed bf16 weights (`_frozen_packed`)

    def __init__(self, model, tokenizer, cfg: TrainConfig, compute_dtype: str = "bfloat16"):
        from peft import LoraConfig, PeftModel, get_peft_model

        compute_dtype = resolve_compute_dtype(compute_dtype, next(model.parameters()).device.type)
        self.cfg, self.tokenizer, self.compute_dtype = cfg, tokenizer, compute_dtype
        torch.manual_seed(cfg.seed)
        names = sorted(set(ROLE_ADAPTERS.values())) if cfg.policy_per_role else ["default"]
        if not isinstance(model, PeftModel):
            lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, bias="none",
                              target_modules=list(cfg.lora_target_modules), task_type="CAUSAL_LM")
            # before peft: it wraps an Embedding silently and leaves no trainable parameter, and it
            # refuses a norm with a bare ValueError; this names the setting and the linear layers
            check_lora_targets(list(cfg.lora_target_modules), model)
            model = get_peft_model(model, lora, adapter_name=names[0])
            for name in names[1:]:
                model.add_adapter(name, lora)
        if sorted(model.peft_config) != names:
            raise ValueError(f"the PeftModel holds adapters {sorted(model.peft_config)}, but "
                             f"train.policy_per_role={cfg.policy_per_role} needs {names}")
        # peft's set_adapter makes the active adapter trainable (also one loaded for inference) and
        # freezes the others; `_using` switches per role, so parameters are found by name below.
        model.set_adapter("act" if cfg.policy_per_role else "default")
        # Dropout off: the ratio at the start of a step must be exp(0) = 1 against a behaviour policy without it.
        self.model = model.eval()
        self.device = next(self.model.parameters()).device
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad if pad is not None else 0)
        self._adapter_params = {n: [p for k, p in self.model.named_parameters()
                                    if "lora_" in k and f".{n}." in k] for n in names}
        self._params = [p for n in names for p in self._adapter_params[n]]
        # Data parallel (WORLD_SIZE > 1, process group initialised by the caller): every rank must
        # start from rank 0's LoRA weights; `step` keeps them equal (same summed gradient everywhere).
        self.world = World.current()
        self.world.broadcast_(self._params)
        self.updates = self.optimizer_steps = 0
        self._reset_optimizer()
        causal = self.model.get_base_model()
        self._backbone, self._head = causal.base_model, causal.get_output_embeddings()
        self._split_head = self._head_is_plain_linear()
        params = inspect.signature(self._backbone.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.2x

    def _reset_optimizer(self) -> None:
        """A fresh AdamW and LR schedule (positioned at iteration `self.updates`)."""
        from transformers import get_scheduler

        c = self.cfg
        self.optimizer = torch.optim.AdamW(self._params, lr=c.learning_rate, weight_decay=0.0)
        name = "constant_with_warmup" if c.lr_scheduler == "constant" and c.warmup_iterations else c.lr_scheduler
        self.scheduler = get_scheduler(name, self.optimizer, num_warmup_steps=c.warmup_iterations,
                                       num_training_steps=c.iterations)
        for _ in range(self.updates):
            self._advance_schedule()

    def _advance_schedule(self) -> None:
        """One LR-schedule step (per iteration), also where no optimizer step preceded it (an
        iteration without trainable rows, a replay after a reset): torch warns then, needlessly."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
            self.scheduler.step()

    def adapter_for(self, role) -> str | None:
        """The adapter a row of `role` trains (per-role policy), or None (one shared adapter)."""
        return ROLE_ADAPTERS[role_name(role)] if self.cfg.policy_per_role else None

    @contextmanager
    def _using(self, adapter: str | None):
        """Run the block with `adapter` active (peft `set_adapter`), then restore the previous one."""
        if adapter is None or adapter == self.model.active_adapter:
            yield
            return
        prev = self.model.active_adapter
        self.model.set_adapter(adapter)
        try:
            yield
        finally:
            self.model.set_adapter(prev)

    def _frozen_packed(self):  # frozen linears (LoRA bases; not the LM head) on packed bf16 copies
        return packed_linear.frozen_packed(self.model, self.packed_frozen and self.compute_dtype == "bfloat16", self.device)

    def _units(self, rows: Sequence[TrainingRow]) -> list[tuple[str | None, list[TrainingRow]]]:
        """(adapter, its rows): one unit of all rows for a shared policy, one per adapter otherwise."""
        if not self.cfg.policy_per_role:
            return [(None, list(rows))]
        by: dict[str, list[TrainingRow]] = {}
        for r in rows:
            by.setdefault(self.adapter_for(r.role), []).append(r)
        return sorted(by.items())

    def _head_is_plain_linear(self) -> bool:
        """True when logits == lm_head(backbone(x)) (no soft-capping/scaling), checked once on 4 ids."""
        if self._head is None or self._backbone is self.model.get_base_model():
            return False
        ids = torch.arange(1, 5, device=self.device).reshape(1, 4)
        with torch.no_grad():
            full = self.model(input_ids=ids, use_cache=False).logits.float()
            split = self._head(self._backbone(input_ids=ids, use_cache=False).last_hidden_state).float()
        return full.shape == split.shape and torch.allclose(full, split, rtol=1e-4, atol=1e-4)

    # --- the update and the step ----------------------------------------------------------------

    def update(self, rows: Sequence[TrainingRow]) -> dict:
        """One training iteration on one rollout batch: `ppo_epochs` passes over the trainable rows in
        mini-batches of `mini_batch_rows` (all rows when None), one `step` each, then one LR-schedule
        step. Mini-batches come from a shuffle seeded by (cfg.seed, self.updates, epoch), so a resumed
        run draws the same ones. The behaviour log-probs stay the rollout's in every epoch.
        Data parallel: every rank passes the same global `rows` and draws the same mini-batches
        (`mini_batch_rows` counts global rows); `step` splits each one across the ranks.

        Returns:
            the `step` metrics averaged over the update's optimizer steps, weighted by their completion
            tokens (loss, clip_frac, approx_kl, ratio_mean, kl_ref, entropy, grad_norm, and
            grad_norm/<adapter> for a per-role policy), plus grad_norm_max, lr (the LR these steps
            used), optimizer_steps, epochs, rows and tokens (of the batch, once), rows_skipped,
            forward_tokens (all epochs), seconds and tokens_per_s (completion tokens trained, all
            epochs, per second).

        An iteration without a trainable row (every reward failed, a frozen role only) makes no
        optimizer step but still advances the schedule; it returns {"note", "lr", "optimizer_steps": 0}.

        Raises:
            ValueError: a malformed row (as `step`).
        """
        cfg, t0 = self.cfg, time.perf_counter()
        lr = float(self.scheduler.get_last_lr()[0])
        if not trainable_rows(rows, cfg.trained_roles):
            self._advance_schedule()
            self.updates += 1
            return {"note": "no trainable rows", "lr": lr, "optimizer_steps": 0}
        keep = self._trainable(rows)
        size = min(cfg.mini_batch_rows or len(keep), len(keep))
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.updates)
        steps = []
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(len(keep), generator=gen).tolist() if size < len(keep) else range(len(keep))
            for k in range(0, len(keep), size):
                steps.append(self.step([keep[i] for i in order[k:k + size]]))
        self._advance_schedule()
        self.updates += 1
        seconds = time.perf_counter() - t0
        counts = {"tokens", "forward_tokens", "rows", "rows_skipped", "seconds", "tokens_per_s"}
        out = {}
        for k in sorted({k for m in steps for k in m} - counts):  # grad_norm/<adapter> may be absent
            have = [m for m in steps if k in m]
            out[k] = sum(m["tokens"] * m[k] for m in have) / sum(m["tokens"] for m in have)
        out.update(grad_norm_max=max(m["grad_norm"] for m in steps), lr=lr, optimizer_steps=len(steps),
                   epochs=cfg.ppo_epochs, rows=len(keep), rows_skipped=len(rows) - len(keep),
                   tokens=sum(len(r.completion_ids) for r in keep),
                   forward_tokens=sum(m["forward_tokens"] for m in steps), seconds=seconds,
                   tokens_per_s=sum(m["tokens"] for m in steps) / seconds)
        return out

    def step(self, rows: Sequence[TrainingRow]) -> dict:
        """One optimizer step over all trainable rows (gradient accumulation over micro-batches).

        Rows with an empty completion, `valid=False` (a failed reward) or a role outside
        `cfg.trained_roles` are skipped (`rows.trainable_rows`). The loss
        equals `policy_loss` over all rows as one batch: "token-mean" divides by the completion
        tokens of the whole step, "seq-mean-token-mean" by its row count. With `policy_per_role`
        each adapter's rows form their own batch (own normalisation, own gradient clipping).
        Does not step the LR schedule (`update` does).

        Data parallel (`self.world.size` W > 1): every rank passes the same `rows` (the step's global
        mini-batch) and runs forward/backward on its contiguous, cost-balanced share only
        (`_shard`); the loss keeps the global normaliser, so summing the ranks' gradients (one
        all-reduce over the LoRA gradients, one over the metric sums) gives every rank the gradient
        and metrics of one process over all rows, up to float summation order. Clipping and AdamW
        then run identically on every rank, so the weights stay equal.

        Returns:
            loss, clip_frac, approx_kl, ratio_mean, kl_ref (0.0 when cfg.kl_beta == 0: not
            computed), grad_norm (before clipping; for a per-role policy the norm over both adapters,
            plus grad_norm/<adapter>), entropy (mean token entropy, nats), tokens (completion tokens
            trained), forward_tokens (prompt + completion), seconds, tokens_per_s (completion
            tokens / s), rows, rows_skipped.

        Raises:
            ValueError: no row remains after skipping, or a row is malformed.
        """
        cfg, t0 = self.cfg, time.perf_counter()
        keep = self._trainable(rows)
        n_tok = sum(len(r.completion_ids) for r in keep)
        out = {k: 0.0 for k in ("loss", "clip_frac", "approx_kl", "ratio_mean", "kl_ref", "entropy")}
        self.optimizer.zero_grad(set_to_none=True)
        units = self._units(keep)
        for adapter, unit in units:
            unit_tok = sum(len(r.completion_ids) for r in unit)
            share = unit_tok / n_tok if cfg.loss_agg == "token-mean" else len(unit) / len(keep)
            mine = self._shard(unit)
            with self._using(adapter), grouped_kv_attention(self.device), self._frozen_packed():
                mbs = self._micro_batches(mine)
                for ks, r in self._root_clusters(mine, mbs):  # a system message shared across micro-batches
                    root = SharedRoot(self._backbone, self._cache_kw, mine[mbs[ks[0]][0]].prompt_ids[:r], self.device,
                                      self.compute_dtype == "bfloat16", cfg.recompute_shared_root) if r else None
                    for k in ks:
                        self._accumulate([mine[i] for i in mbs[k]], unit, unit_tok, n_tok, share, out, root)
                    if root is not None:
                        root.backward()
        if self.world.enabled:
            self._sum_over_ranks(units, out)
        norms = {}
        for adapter, _ in units:  # each adapter's grads are final once all units ran (frozen otherwise)
            params = self._adapter_params[adapter] if adapter else self._params
            norms[adapter] = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        seconds = time.perf_counter() - t0
        out["grad_norm"] = sum(v * v for v in norms.values()) ** 0.5
        out.update({f"grad_norm/{a}": v for a, v in norms.items() if a})
        out.update(tokens=n_tok, seconds=seconds,
                   forward_tokens=sum(len(r.prompt_ids) + len(r.completion_ids) for r in keep),
                   tokens_per_s=n_tok / seconds, rows=len(keep), rows_skipped=len(rows) - len(keep))
        return out

    def _accumulate(self, mb: list[TrainingRow], unit: list[TrainingRow], unit_tok: int, n_tok: int,
                    share: float, out: dict, root: SharedRoot | None = None) -> None:
        """Forward + backward of one micro-batch, its loss scaled so that the unit's accumulated
        gradient equals that of the unit as one batch; adds its share of the metrics to `out`. With
        `root`, the policy's forward starts from that shared prefix (its gradient waits in the root)."""
        cfg = self.cfg
        b = self._collate(mb)
        ref = None
        if cfg.kl_beta > 0:  # reference = same weights, adapters off; no second model copy
            with torch.no_grad(), self.model.disable_adapter():
                ref, _ = self._token_logprobs(b)
        lp, entropy = self._token_logprobs(b, entropy=True, root=root)
        loss, m = policy_loss(lp, b.old, b.adv, b.mask, cfg.clip_eps, cfg.loss_agg, ref, cfg.kl_beta)
        mb_tok = int(b.mask.sum())
        weight = mb_tok / unit_tok if cfg.loss_agg == "token-mean" else len(mb) / len(unit)
        (loss * weight).backward()
        out["loss"] += loss.item() * weight * share
        for k, v in m.items():
            out[k] += v * mb_tok / n_tok
        out["entropy"] += entropy / n_tok

    # --- pieces of the step ----------------------------------------------------------------------

    def _shard(self, unit: list[TrainingRow]) -> list[TrainingRow]:
        """This rank's rows of `unit`: all of them for one process; otherwise a contiguous slice of
        the rows in micro-batch order (prompt-sorted, so GRPO groups stay together) whose cost
        (completion tokens + prompt tokens not shared with the previous row, i.e. what
        `_logits` computes) is about 1/W of the unit's. Same cut on every rank."""
        if not self.world.enabled:
            return list(unit)
        order = sorted(range(len(unit)), key=lambda i: (unit[i].prompt_ids, len(unit[i].completion_ids)))
        costs, prev = [], []
        for i in order:
            p = unit[i].prompt_ids
            lcp = next((k for k in range(min(len(p), len(prev))) if p[k] != prev[k]), min(len(p), len(prev)))
            costs.append(len(p) - lcp + len(unit[i].completion_ids))
            prev = p
        mine = balanced_slices(costs, self.world.size)[self.world.rank]
        return [unit[order[i]] for i in mine]

    def _sum_over_ranks(self, units: list[tuple[str | None, list[TrainingRow]]], out: dict) -> None:
        """Sum the LoRA gradients of the step's adapters and the metric sums in `out` over ranks.

        A rank whose share of an adapter was empty contributes zeros; the summed gradient is then set
        on every rank, also where this rank had none. Adapters without rows in the step keep
        grad None, as in one process, so AdamW leaves them (and their moments) alone.
        """
        params = [p for adapter, _ in units for p in (self._adapter_params[adapter] if adapter else self._params)]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        self.world.all_reduce_sum_(flat)
        for p, g in zip(params, flat.split([p.numel() for p in params])):
            p.grad = g.view_as(p).clone()
        keys = sorted(out)
        sums = self.world.all_reduce_sum_(torch.tensor([out[k] for k in keys], dtype=torch.float64,
                                                       device=flat.device))
        out.update(zip(keys, sums.tolist()))

    def _trainable(self, rows: Sequence[TrainingRow]) -> list[TrainingRow]:
        keep = trainable_rows(rows, self.cfg.trained_roles)
        if not keep:
            roles = sorted({role_name(r.role) for r in rows})
            empty = sum(1 for r in rows if not r.completion_ids)
            invalid = sum(1 for r in rows if not r.valid)
            raise ValueError(f"no trainable row among {len(rows)}: roles present {roles}, cfg.trained_roles "
                             f"{sorted(role_name(r) for r in self.cfg.trained_roles)}, {empty} with empty "
                             f"completion, {invalid} invalid (failed reward)")
        for r in keep:
            if not r.prompt_ids:
                raise ValueError("a training row has an empty prompt: the first completion token "
                                 "needs at least one prompt token to be predicted from")
            if len(r.old_logprobs) != len(r.completion_ids):
                raise ValueError(f"row has {len(r.completion_ids)} completion ids but "
                                 f"{len(r.old_logprobs)} old_logprobs: they must align one to one")
        return keep

    def _root_clusters(self, rows: Sequence[TrainingRow], mbs: list[list[int]]) -> list[tuple[list[int], int]]:
        """`prefix_grad.root_clusters` of micro-batches `mbs` of `rows`; none off the chunked-head path."""
        chunked = self.logprob_chunk_tokens is not None and self._split_head and isinstance(self._head, torch.nn.Linear)
        return root_clusters([[rows[i].prompt_ids for i in mb] for mb in mbs]) if chunked else [([k], 0) for k in range(len(mbs))]

    def _micro_batches(self, rows: Sequence[TrainingRow]) -> list[list[int]]:
        """Indices of `rows` in micro-batches of at most cfg.micro_batch_rows.

        Rows are sorted by prompt ids (lexicographic, then completion length), so the rows of a GRPO
        group (same prompt) and rows sharing a system message are adjacent; `_logits` computes a
        micro-batch's common prefix once. A micro-batch is also closed early when the next row would
        shorten its common prefix by more than `min_shared_prefix` tokens (e.g. at a group boundary):
        a separate batch then costs less than recomputing the lost prefix for every row. Rows whose
        prompt lengths differ by more than `max_prompt_spread` tokens never share a micro-batch
        (the logits cover every row from the shortest prompt on: memory). Nor do rows whose padded tokens past
        their common prefix (counted only from `min_shared_prefix` tokens, as `_hidden` runs it), B × (longest
        prompt + completion − prefix), would exceed cfg.micro_batch_tokens.
        """
        order = sorted(range(len(rows)), key=lambda i: (rows[i].prompt_ids, len(rows[i].completion_ids)))
        budget = self.cfg.micro_batch_tokens
        chunks: list[list[int]] = []
        cur: list[int] = []
        lcp, lo, hi, top = 0, 0, 0, 0
        for i in order:
            p, end = rows[i].prompt_ids, len(rows[i].prompt_ids) + len(rows[i].completion_ids)
            if cur:
                first = rows[cur[0]].prompt_ids
                new = next((k for k in range(min(lcp, len(p))) if p[k] != first[k]), min(lcp, len(p)))
                shared = min(new, lo - 1, len(p) - 1)  # `_collate`'s b.shared, run once by `_hidden` if long enough
                padded = (len(cur) + 1) * (max(top, end) - (shared if shared >= self.min_shared_prefix else 0))
                if len(cur) < self.cfg.micro_batch_rows and not (
                        len(cur) > 1 and lcp - new > self.min_shared_prefix) and \
                        max(hi, len(p)) - min(lo, len(p)) <= self.max_prompt_spread and \
                        (budget is None or padded <= budget):
                    cur.append(i)
                    lcp, lo, hi, top = new, min(lo, len(p)), max(hi, len(p)), max(top, end)
                    continue
                chunks.append(cur)
            cur, lcp, lo, hi, top = [i], len(p), len(p), len(p), end
        return chunks + [cur] if cur else chunks

    def _collate(self, rows: Sequence[TrainingRow]) -> _Batch:
        """Right-pad prompt + completion. Completion token j of a row with prompt length P sits at
        sequence position P + j and is predicted by the logits at P + j - 1 (column P + j - 1 - start)."""
        B = len(rows)
        L = max(len(r.prompt_ids) + len(r.completion_ids) for r in rows)
        start = min(len(r.prompt_ids) for r in rows) - 1
        ids = torch.full((B, L), self.pad_id, dtype=torch.long)
        attn = torch.zeros((B, L), dtype=torch.long)
        mask = torch.zeros((B, L - 1 - start), dtype=torch.bool)
        old = torch.zeros((B, L - 1 - start), dtype=torch.float32)
        for i, r in enumerate(rows):
            P, C = len(r.prompt_ids), len(r.completion_ids)
            ids[i, :P + C] = torch.tensor(list(r.prompt_ids) + list(r.completion_ids), dtype=torch.long)
            attn[i, :P + C] = 1
            col = P - 1 - start
            mask[i, col:col + C] = True
            old[i, col:col + C] = torch.tensor(r.old_logprobs, dtype=torch.float32)
        shared = start
        for r in rows[1:]:
            shared = next((k for k in range(shared) if r.prompt_ids[k] != rows[0].prompt_ids[k]), shared)
        dev = self.device
        return _Batch(ids.to(dev), attn.to(dev), start, shared, ids[:, start + 1:].to(dev), mask.to(dev),
                      old.to(dev), torch.tensor([float(r.advantage) for r in rows], device=dev),
                      torch.tensor([float(r.temperature) for r in rows], device=dev))

    def _token_logprobs(self, b: _Batch, entropy: bool = False, root: SharedRoot | None = None
                        ) -> tuple[torch.Tensor, float]:
        """(log-probs [B, T] float32 of b.targets under the logits / b.temperature, valid where b.mask;
        entropy sum over the masked tokens in nats, 0.0 unless `entropy`).

        With a plain linear head (`_split_head`) and `logprob_chunk_tokens` set, the head runs on
        completion tokens only, that many at a time (`logprobs.chunked_token_logprobs`: no [B, T, V]
        tensor, forward or backward; 0 off the mask). Otherwise the full logits (`_logits`) feed
        `grpo.token_logprobs` and `_entropy_sum`.
        """
        chunked = self._split_head and isinstance(self._head, torch.nn.Linear)
        if self.logprob_chunk_tokens is None or not chunked:
            logits = self._logits(b)
            lp = token_logprobs(logits, b.targets, b.temperature)
            return lp, (self._entropy_sum(logits, b) if entropy else 0.0)
        return chunked_token_logprobs(self._hidden(b, root), self._head, b.targets, b.temperature, b.mask,
                                      self.logprob_chunk_tokens, entropy)

    def _logits(self, b: _Batch) -> torch.Tensor:
        """[B, T, V] float32 logits for positions start .. L-2 only (the completion span)."""
        if self._split_head:
            # The LM head in float32 outside autocast: cheap (completion span only), exact ratios.
            return self._head(self._hidden(b).to(self._head.weight.dtype)).float()
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.compute_dtype == "bfloat16"):
            out = self.model(input_ids=b.input_ids, attention_mask=b.attention_mask, use_cache=False,
                             logits_to_keep=b.input_ids.shape[1] - b.start)
        return out.logits[:, :-1].float()

    def _hidden(self, b: _Batch, root: SharedRoot | None = None) -> torch.Tensor:
        """[B, T, d] final hidden states (the LM head's input) at positions start .. L-2; needs
        `_split_head`. Under bf16 autocast when compute_dtype is bfloat16.

        When the rows share a prefix of >= `min_shared_prefix` tokens (a GRPO group's prompt, a
        system message), it is run once at batch size 1 and its KV cache (with grad) is repeated
        over the rows: same numbers, and its gradient is summed over the rows as in the plain batch. A
        `root` (`prefix_grad.SharedRoot`, R <= b.shared tokens) supplies the first R tokens' cache instead.
        """
        B, n = b.input_ids.shape[0], b.shared
        with torch.autocast(self.device.type, dtype=torch.bfloat16,
                            enabled=self.compute_dtype == "bfloat16"):
            if root is not None:
                cache, r = root.cache(), root.length
                kw = {self._cache_kw: cache}
                if B > 1 and n - r >= self.min_shared_prefix:
                    self._backbone(input_ids=b.input_ids[:1, r:n], use_cache=True, **kw)
                else:
                    n = r
                cache.batch_repeat_interleave(B)
                h = self._backbone(input_ids=b.input_ids[:, n:], attention_mask=b.attention_mask, use_cache=True,
                                   **kw).last_hidden_state
            elif B > 1 and n >= self.min_shared_prefix:
                cache = DynamicCache(config=self._backbone.config)  # filled in place by the call
                self._backbone(input_ids=b.input_ids[:1, :n], use_cache=True, **{self._cache_kw: cache})
                cache.batch_repeat_interleave(B)
                h = self._backbone(input_ids=b.input_ids[:, n:], attention_mask=b.attention_mask,
                                   use_cache=True, **{self._cache_kw: cache}).last_hidden_state
            else:
                n = 0
                h = self._backbone(input_ids=b.input_ids, attention_mask=b.attention_mask,
                                   use_cache=False).last_hidden_state
        return h[:, b.start - n:-1]

    def completion_ce_backward(self, rows: Sequence[tuple[list[int], list[int]]], scale: float) -> float:
        """Backward of ``scale · Σ_rows CE(completion | prompt)`` (summed nats per row) into the
        trainable LoRA weights; returns that scaled loss. Rows with a common prompt prefix run it once
        (`prefix_grad.shared_prefix_ce_backward`: same values and gradients, less compute); a model
        whose logits are not lm_head(backbone(x)) runs each row whole. rows: (prompt ids, completion
        ids, ≥ 1 id)."""
        bf16, total = self.compute_dtype == "bfloat16", 0.0
        with grouped_kv_attention(self.device), self._frozen_packed():
            if self._split_head:
                return shared_prefix_ce_backward(self._backbone, self._head, self._cache_kw, rows, scale, self.device,
                                                 bf16, self.min_shared_prefix, self.cfg.recompute_shared_root)
            for p, c in rows:
                ids = torch.tensor([p + c], device=self.device)
                with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=bf16):
                    logits = self.model(input_ids=ids, use_cache=False, logits_to_keep=len(c) + 1).logits[0, :-1]
                loss = torch.nn.functional.cross_entropy(logits.float(), ids[0, -len(c):], reduction="sum") * scale
                loss.backward()
                total += loss.item()
        return total

    @staticmethod
    def _entropy_sum(logits: torch.Tensor, b: _Batch) -> float:
        """Sum over completion tokens of H(softmax(logits / T)) in nats, from the step's own logits."""
        with torch.no_grad():
            t = b.temperature.reshape(-1, 1, 1).expand(-1, logits.shape[1], 1)[b.mask]  # [K, 1]
            logp = torch.log_softmax(logits.detach()[b.mask] / t, dim=-1)  # [K, V]
            return float(-(logp.exp() * logp).sum())

    # --- evaluation (adapter files and checkpoints: `TrainerPersistence`) -----------------------

    def completion_logprobs(self, rows: Sequence[TrainingRow]) -> list[list[float]]:
        """The current policy's log-probs of each row's completion ids (no grad, same computation as
        `step`: same micro-batching, dtype, attention and temperature). Every row is scored whatever its role;
        a row with an empty completion gets []. Returns lists in the order of `rows`."""
        out: list[list[float]] = [[] for _ in rows]
        for i, r in enumerate(rows):
            if r.completion_ids and not r.prompt_ids:
                raise ValueError(f"row {i} has an empty prompt")
        todo = [i for i, r in enumerate(rows) if r.completion_ids]
        units: dict[str | None, list[int]] = {}
        for i in todo:  # a per-role policy scores each row with its role's adapter
            units.setdefault(self.adapter_for(rows[i].role), []).append(i)
        with torch.no_grad(), grouped_kv_attention(self.device), self._frozen_packed():
            for adapter, unit in units.items():
                with self._using(adapter):
                    for idx in self._micro_batches([rows[i] for i in unit]):
                        chunk = [unit[i] for i in idx]
                        b = self._collate([rows[i] for i in chunk])
                        lp, _ = self._token_logprobs(b)
                        for j, i in enumerate(chunk):
                            out[i] = lp[j][b.mask[j]].tolist()
        return out
