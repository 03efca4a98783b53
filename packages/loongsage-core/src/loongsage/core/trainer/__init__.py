"""The trainer skeleton every trainer backend is built on, the contract of the model adapter it
drives, and the torch backend (``torch``): an HF causal LM trained in place with AdamW, the PPO
critic and the MOPD teachers that share its forward.

``skeleton``               the step mechanics: token-budget micro-batches, the loss closure per
                           micro-batch, gradient accumulation and reduction, the optimizer, held
                           teachers, checkpoints, exports, offload
``adapter``                the model-adapter contract the skeleton drives (a Protocol, member by member)
``torch_model``            the torch adapter: an HF model, FSDP2 or replicated data parallelism, LoRA
``torch_trainer``          the ``torch`` trainer: the skeleton over the torch adapter, and its params' checks
``critic``                 the PPO value model (``torch_critic``): the policy trunk and a zero-initialised value head
``teacher``                the forward-only MOPD teacher (``embedded``): log-probs, top-k or full vocabulary
``held_teachers``          MOPD teachers held by the trainer's ranks, split as the policy
``micro_batching``         which rows share a micro-batch: consecutive, or grouped by length
``lora``                   LoRA adapters (peft); merged weights for the engine
``master_weights``         float32 master weights of a bf16/fp16 model, gradients summed in float32
``distributed_optimizer``  ZeRO-1: masters and AdamW moments split over the data-parallel ranks
``offload``                the trainer's state to host memory and back, for a colocated engine's turn

The Megatron trainer (``loongsage.megatron``) is the same skeleton over its own adapter. The math
the trainers share with the engine is in :mod:`loongsage.core.model_math`.
"""
