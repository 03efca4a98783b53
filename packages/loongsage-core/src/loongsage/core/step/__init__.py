"""The training step: one batch of scored groups in, one optimizer step per mini-batch, metrics out.

:class:`~loongsage.core.step.train_step.TrainStep` runs fixed phases over the step's state
(:mod:`~loongsage.core.step.state`); each optional feature is one object with those phases, in a
module of its own (KL in the reward, the critic, distillation, loss exclusion, the batch audit), so
the step iterates over the active features instead of branching, and a new feature is a new
module. The step talks to the trainer, critic and teacher roles through typed groups
(:mod:`loongsage.core.roles`), so it runs without Ray against in-process stand-ins.
"""
