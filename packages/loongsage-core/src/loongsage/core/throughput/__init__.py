"""A throughput model of an RL step: ``loongsage plan <recipe>`` asks it.

Physical and small: a step is a rollout (prefill, then decode steps that read the weights and every
live row's keys and values at a calibrated share of the memory bandwidth, plus the controller's
host work per trajectory), a training phase (FLOPs at a calibrated MFU per trainer backend, plus
the seams around it) and a weight push (bytes over the transport). Placements are colocated (the
phases in sequence on every card) or disaggregated (engines and trainer on cards of their own,
overlapping under an asynchronous scheduler). Every constant is in :mod:`.constants` with where it
was measured; ``bench/plan_vs_measured.py`` compares the predictions with every measured step.

* :mod:`.lengths`: response lengths (every sample to ``max_new_tokens``, or log-normal);
* :mod:`.shape`: a model's matmul parameters, weight and KV-cache bytes;
* :mod:`.phases`: the phases as pure functions of a batch and cost models;
* :mod:`.hardware`: cost models of an accelerator from the constants;
* :mod:`.workload`: what a recipe asks for;
* :mod:`.placement`: the placements of ``n`` GPUs, their memory and step times, the pick;
* :mod:`.calibration`: each calibrated constant derived again from its result file;
* :mod:`.report` and :mod:`.command`: the ``plan`` command.
"""
