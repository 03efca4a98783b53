"""Calibrate the tiny arithmetic RL demo: warm start, pass@1 / pass@k, then a plain-torch GRPO loop.

Builds (or reuses from the cache) the supervised warm start of
:mod:`loongsage.core.tinytask.warmstart`, measures held-out greedy accuracy and sampled pass@k,
then runs GRPO exactly as the framework's recipe does it — P prompts x G samples per step,
exact-match reward, group z-score advantage, PPO-clip token-mean loss, one AdamW step per
rollout step — and prints held-out greedy accuracy every ``--eval-every`` steps with wall time.

    uv run python bench/calibrate_tiny_arith.py --rl-steps 200 --rl-lr 1e-4 --rl-seed 0

It uses HF ``generate`` for rollouts and is independent of the framework's own loop, so it
also serves as a reference for what that loop should reach.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time

import torch

from loongsage.core.tinytask.arith import score
from loongsage.core.tinytask.warmstart import WarmStartParams, build_warm_start, cached_warm_start, render_prompt


def encode_prompts(tokenizer, records) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids and attention mask (batched generation needs left padding)."""
    texts = [render_prompt(tokenizer, r.prompt) for r in records]
    rows = tokenizer(texts, add_special_tokens=False)["input_ids"]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return ids, mask


@torch.no_grad()
def generate(model, tokenizer, ids, mask, *, greedy: bool, max_new_tokens: int, n: int = 1):
    """Responses as ``(tokens [B*n, L], response_mask [B*n, L], texts)``; a response ends at eos."""
    out = model.generate(
        input_ids=ids.repeat_interleave(n, 0),
        attention_mask=mask.repeat_interleave(n, 0),
        do_sample=not greedy,
        temperature=1.0 if not greedy else None,
        top_k=0 if not greedy else None,
        top_p=1.0 if not greedy else None,
        max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    resp = out[:, ids.shape[1] :]
    is_eos = resp == tokenizer.eos_token_id
    # Tokens up to and including the first eos are the response; later ones are padding.
    after_eos = (is_eos.cumsum(1) - is_eos.long()) > 0
    resp_mask = (~after_eos).long()
    texts = [
        tokenizer.decode([t for t, m in zip(row, mrow) if m and t != tokenizer.eos_token_id])
        for row, mrow in zip(resp.tolist(), resp_mask.tolist())
    ]
    return resp, resp_mask, texts


def evaluate(model, tokenizer, records, *, max_new_tokens: int, k: int = 0, batch: int = 256) -> dict:
    """Greedy accuracy, and with ``k`` > 0 sampled pass@1 (mean over k samples) and pass@k."""
    greedy, sample_mean, any_ok = [], [], []
    for s in range(0, len(records), batch):
        chunk = records[s : s + batch]
        ids, mask = encode_prompts(tokenizer, chunk)
        _, _, texts = generate(model, tokenizer, ids, mask, greedy=True, max_new_tokens=max_new_tokens)
        greedy += [score(t, r.label) for t, r in zip(texts, chunk)]
        if k:
            _, _, texts = generate(model, tokenizer, ids, mask, greedy=False, max_new_tokens=max_new_tokens, n=k)
            for j, r in enumerate(chunk):
                rewards = [score(t, r.label) for t in texts[j * k : (j + 1) * k]]
                sample_mean.append(sum(rewards) / k)
                any_ok.append(float(any(rewards)))
    result = {"greedy": sum(greedy) / len(greedy)}
    if k:
        result |= {"pass@1": sum(sample_mean) / len(sample_mean), f"pass@{k}": sum(any_ok) / len(any_ok)}
    return result


def token_logprobs(model, input_ids, attention_mask):
    """Log-prob of each token given its prefix, laid out as ``[B, T]`` (position 0 is 0)."""
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)  # as generate does for left padding
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(logp, (1, 0))


def grpo(model, tokenizer, train, test, args) -> list[dict]:
    """The GRPO loop; returns the evaluation curve."""
    torch.manual_seed(args.rl_seed)
    rng = random.Random(f"rl/{args.rl_seed}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.rl_lr, betas=(0.9, 0.99), weight_decay=0.0)
    curve, start, rewards_seen = [], time.perf_counter(), []
    t_gen = t_train = 0.0

    def log(step: int) -> None:
        model.eval()
        acc = evaluate(model, tokenizer, test, max_new_tokens=args.max_new_tokens)["greedy"]
        row = {
            "step": step,
            "greedy": acc,
            "train_reward": sum(rewards_seen) / max(1, len(rewards_seen)),
            "wall_s": time.perf_counter() - start,
            "gen_s": t_gen,
            "train_s": t_train,
        }
        rewards_seen.clear()
        curve.append(row)
        reward = f"{row['train_reward']:.3f}" if step else "  -  "
        print(
            f"rl step {step:4d}  greedy {acc:.3f}  train reward {reward}  "
            f"wall {row['wall_s']:6.1f}s (gen {t_gen:.1f}s, train {t_train:.1f}s)",
            flush=True,
        )

    log(0)
    for step in range(1, args.rl_steps + 1):
        t0 = time.perf_counter()
        records = [train[rng.randrange(len(train))] for _ in range(args.prompts)]
        ids, mask = encode_prompts(tokenizer, records)
        model.eval()
        resp, resp_mask, texts = generate(
            model, tokenizer, ids, mask, greedy=False, max_new_tokens=args.max_new_tokens, n=args.samples
        )
        rewards = torch.tensor(
            [score(t, records[i // args.samples].label) for i, t in enumerate(texts)], dtype=torch.float32
        )
        rewards_seen += rewards.tolist()
        groups = rewards.view(args.prompts, args.samples)
        adv = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)).view(-1)
        t1 = time.perf_counter()

        input_ids = torch.cat([ids.repeat_interleave(args.samples, 0), resp], 1)
        attn = torch.cat([mask.repeat_interleave(args.samples, 0), resp_mask], 1)
        loss_mask = torch.cat([torch.zeros_like(ids).repeat_interleave(args.samples, 0), resp_mask], 1).float()
        model.train()
        logp = token_logprobs(model, input_ids, attn)
        old = logp.detach()  # one optimizer step per rollout: the behaviour policy is the current one
        ratio = torch.exp(logp - old)
        a = adv[:, None]
        per_token = -torch.minimum(ratio * a, ratio.clamp(1 - args.clip_low, 1 + args.clip_high) * a)
        loss = (per_token * loss_mask).sum() / loss_mask.sum().clamp(min=1)  # token-mean
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        t_gen += t1 - t0
        t_train += time.perf_counter() - t1
        if step % args.eval_every == 0 or step == args.rl_steps:
            log(step)
    return curve


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    defaults = WarmStartParams()
    for f in dataclasses.fields(WarmStartParams):
        p.add_argument(
            f"--ws-{f.name.replace('_', '-')}",
            dest=f"ws_{f.name}",
            type=type(getattr(defaults, f.name)),
            default=getattr(defaults, f.name),
            help=f"warm start: {f.name}",
        )
    p.add_argument("--no-cache", action="store_true", help="build the warm start into a temp folder")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--eval-size", type=int, default=256)
    p.add_argument("--k", type=int, default=8, help="samples per prompt for pass@k")
    p.add_argument("--rl-steps", type=int, default=200)
    p.add_argument("--rl-lr", type=float, default=1e-4)
    p.add_argument("--rl-seed", type=int, default=0)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=0, help="0: digits + 3")
    p.add_argument("--clip-low", type=float, default=0.2)
    p.add_argument("--clip-high", type=float, default=0.28)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="write the measurements to this file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    params = WarmStartParams(**{f.name: getattr(args, f"ws_{f.name}") for f in dataclasses.fields(WarmStartParams)})
    args.max_new_tokens = args.max_new_tokens or params.digits + 3

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    if args.no_cache:
        import tempfile

        path = build_warm_start(tempfile.mkdtemp(prefix="tiny-arith-"), params, log_every=50)
    else:
        path = cached_warm_start(params, args.cache_dir, log_every=50)
    ws_info = json.loads((path / "loongsage_warmstart.json").read_text())
    print(
        f"warm start {path}: {ws_info['num_parameters']} params, built in {ws_info['build_seconds']:.1f}s "
        f"(this call {time.perf_counter() - t0:.1f}s), final loss {ws_info['final_loss']:.4f}",
        flush=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    test_task = params.task("test", size=args.eval_size)
    test = [test_task[i] for i in range(len(test_task))]
    train = params.task("train", size=100_000, seed=1000 + args.rl_seed)

    t1 = time.perf_counter()
    before = evaluate(model, tokenizer, test, max_new_tokens=args.max_new_tokens, k=args.k)
    print(f"before RL: {json.dumps(before)} ({time.perf_counter() - t1:.1f}s)", flush=True)
    curve = grpo(model, tokenizer, train, test, args)
    model.eval()
    after = evaluate(model, tokenizer, test, max_new_tokens=args.max_new_tokens, k=args.k)
    print(f"after RL: {json.dumps(after)}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {"warm_start": ws_info, "args": vars(args), "before": before, "curve": curve, "after": after},
                fh,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
