# trainer/ — the actor's parts: what actor.py (and critic.py, train.py) build a training step from.
#
#   recompute.py   the trainer's logprob forward: each token at its recorded sampling, the chunked output
#                  projection, shared prompts computed once (invariant 3's trainer side)
#   lora.py        LoRA adapters (PEFT) over a frozen base: which linears, the adapter's tensors, PEFT's folder
#   centering.py   score centering: the centered ratio-free REINFORCE loss over the sampler's recorded top-k
#   cpu_setup.py   what a CPU process sets up before its first model loads (kept pages, MKL's AVX-512 kernels)
#   viewer.py      the page of a run's traced tokens (train.py view) or of a loopback session (loopback.py)
# Imports only invariants.py, the shared modules (data.py, models.py) and the other packages, never a stage.
