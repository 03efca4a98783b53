"""The model math every torch backend shares: the torch trainer and its teachers, the native engine
and the Megatron trainer all import it, so every side computes the same numbers.

``logprobs``  the trainer's forward (logits from the first trained position on) and the float32
              log-probs, entropies and teacher distributions of one log-softmax
``head``      the FP32 LM head (on CUDA a half GEMM with float32 output)
``dtypes``    the dtypes a config names (``DTYPES``)
``state``     a module's own tensors, sums and gradient norms over ranks, the RNG state a checkpoint keeps
"""
