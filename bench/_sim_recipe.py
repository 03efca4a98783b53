"""The two-source recipe the simulation benchmarks run: ``arith`` and ``sort`` with their own
quotas, sampling and rewards, 8 samples a prompt, over the scaffold model
(:func:`loongsage.core.sim.rollout.scaffold_model`)."""

from __future__ import annotations

TEMPLATE = """
run: {{name: {name}, seed: {seed}, total_steps: 1}}
model: {{path: {model}}}
data_sources:
  - name: arith
    reader: {{name: arith, params: {{split: train, size: 1000000}}}}
    prompts_per_step: {arith}
    samples_per_prompt: 8
    agent: {{name: single_turn, params: {{prompt_template: chat}}}}
    reward: {{name: exact_match}}
    sampling: {{temperature: 1.0, max_new_tokens: 4096}}
  - name: sort
    reader: {{name: digit_sort, params: {{split: train, size: 1000000}}}}
    prompts_per_step: {sort}
    samples_per_prompt: 8
    agent: {{name: single_turn, params: {{prompt_template: chat}}}}
    reward: {{name: digit_sort}}
    sampling: {{temperature: 0.8, top_p: 0.95, max_new_tokens: {sort_max_new_tokens}}}
rollout:
  engine: {{name: native}}
  scheduler: {scheduler}
{rollout_extra}algorithm:
  advantage: {{name: grpo}}
placement: {{colocate: false}}
"""


def two_sources(
    name: str,
    *,
    model: str,
    arith: int,
    sort: int,
    scheduler: str,
    seed: int = 1,
    sort_max_new_tokens: int = 4096,
    rollout: dict[str, int] | None = None,
) -> str:
    """The recipe's text: ``arith`` and ``sort`` prompts a step, ``scheduler`` (a YAML flow mapping),
    and more ``rollout`` keys where a benchmark sets them."""
    extra = "".join(f"  {key}: {value}\n" for key, value in (rollout or {}).items())
    return TEMPLATE.format(
        name=name,
        seed=seed,
        model=model,
        arith=arith,
        sort=sort,
        scheduler=scheduler,
        sort_max_new_tokens=sort_max_new_tokens,
        rollout_extra=extra,
    )
