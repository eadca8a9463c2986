"""The built-in trainer ``unicorn-train``: a tiny GPT on PyTorch's own parallel building blocks.

Runs under torchrun on CPU (gloo) or GPU (nccl) with any combination of data parallel
(DDP or FSDP2), tensor parallel (DTensor) and pipeline parallel
(``torch.distributed.pipelining``), and resumes a checkpoint saved at one layout at
another. Modules: :mod:`.config` (validated run, no torch), :mod:`.data` (samples by
global index), :mod:`.model`, :mod:`.parallel`, :mod:`.checkpoint`, :mod:`.loop`.
"""
