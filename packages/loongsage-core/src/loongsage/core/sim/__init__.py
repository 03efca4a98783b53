"""Simulation of the rollout side at scale: simulated engines behind the real router and service,
in simulated time (:mod:`~loongsage.core.sim.clock`, :mod:`~loongsage.core.sim.engine`), faults
(:mod:`~loongsage.core.sim.faults`), a trainer whose step follows its tokens
(:mod:`~loongsage.core.sim.trainer`), the service driven step by step
(:mod:`~loongsage.core.sim.rollout`), and engines that answer real token ids in real time for the
gateway at scale (:mod:`~loongsage.core.sim.text`)."""
