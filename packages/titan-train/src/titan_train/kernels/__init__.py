"""Triton kernels for the trainer's memory-bound steps on CUDA (torch elsewhere).

Each replaces a step where torch.compile's generated code moves more bytes than the step needs
(tools/bench/train_throughput profiles them; docs/benchmarks.md records the figures):
  swiglu.py         SwiGLU over the fused gate/up projection; its backward reads gate, up and the
                    incoming gradient once and writes [dgate | dup] (compile's code for the split's
                    backward read every input twice);
  cross_entropy.py  one chunk of the fused loss: an online log-sum-exp pass and a gradient pass over
                    each row of logits, the gradient written over the logits (compile's code read them
                    three times);
  adamw.py          AdamW on fp32 master weights that also writes the bf16 parameter, one pass
                    (master_adamw.py's optimizer; torch's fused AdamW needs fp32 parameters).
triton is imported only when a kernel runs on a CUDA tensor (or under TRITON_INTERPRET=1 on CPU).
"""
