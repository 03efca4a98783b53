"""The tiny task toolkit: what a run needs to learn something offline on a CPU, with no download,
and what plugins build their own tiny tasks' warm starts with.

``tokenizer``   a byte-level BPE tokenizer with a ChatML template, trained on a generated corpus
``tiny_model``  tiny Qwen3-architecture models, randomly initialised from a seed
``arith``       the arithmetic task (data source ``arith``), train and test splits disjoint by hash
``digit_sort``  the digit-sorting task and its reward (``digit_sort``), answers of 4-21 tokens
``warmstart``   the SFT warm start of the tiny model (model builder ``tiny_arith``), cached by its params
``builds``      a model folder built into the cache once: a lock naming its holder, progress lines
``shapes``      speed workloads: random-weight models of published shapes (``random_init``) and
                prompts of an exact token length (``random_digits``)
"""
