"""TEST-ONLY torchrun worker: unmodified megatron-core GPTModel on CPU/gloo via cpu_shim.

``train``: train ``--steps`` at ``--tp/--pp`` (DP = world / (tp*pp)) and save a
dist_checkpointing (torch_dist) checkpoint; ``eval``: load it at this run's layout.
Both then print ``EVAL_LOSS <value>`` on the last rank: the loss of a fixed batch.

``--memory``: as Megatron-LM under unicorn (``python -m launcher.mcore_ckpt``): the
memory-tier strategies are installed from the ``UNICORN_CKPT_*`` environment, the save
takes Megatron-LM's ``get_default_save_sharded_strategy('torch_dist')`` and the load
megatron-core's default (chosen by the checkpoint's metadata.json).
"""

from __future__ import annotations

import argparse
import os
from functools import partial
from pathlib import Path
from typing import Any

from tests.launcher.mcore import cpu_shim

cpu_shim.install()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import dist_checkpointing, parallel_state  # type: ignore[import-untyped]  # noqa: E402
from megatron.core.dist_checkpointing.serialization import (  # type: ignore[import-untyped]  # noqa: E402
    get_default_save_sharded_strategy,
)
from megatron.core.models.gpt import GPTModel  # type: ignore[import-untyped]  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # type: ignore[import-untyped]  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # type: ignore[import-untyped]  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # type: ignore[import-untyped]  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # type: ignore[import-untyped]  # noqa: E402

SEQ, VOCAB, MB = 16, 64, 2


def batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (MB, 1), generator=g)
    stride = torch.randint(1, VOCAB, (MB, 1), generator=g)
    tokens = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}


def forward_step(data: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
    b = next(data)
    pos = torch.arange(SEQ).unsqueeze(0).expand(MB, -1)
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).tril().logical_not().view(1, 1, SEQ, SEQ)
    out = model(b["tokens"], pos, mask, labels=b["labels"])

    def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = output.float().mean()
        return loss, {"lm loss": loss}

    return out, partial(loss_func)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["train", "eval"])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--memory", action="store_true")
    a = p.parse_args()
    if a.memory:
        from launcher.mcore_ckpt import install_from_env

        assert install_from_env(), "--memory needs UNICORN_CKPT_SNAP_DIR and UNICORN_CKPT_JOB"
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(a.tp, a.pp)
    model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    cfg = TransformerConfig(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        use_cpu_initialization=True,
        tensor_model_parallel_size=a.tp,
        pipeline_model_parallel_size=a.pp,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    fb = get_forward_backward_func()
    if a.mode == "train":
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(a.steps):
            opt.zero_grad()
            fb(
                forward_step_func=forward_step,
                data_iterator=iter([batch(step)]),
                model=model,
                num_microbatches=1,
                seq_length=SEQ,
                micro_batch_size=MB,
                forward_only=False,
            )
            opt.step()
        if dist.get_rank() == 0:
            Path(a.ckpt).mkdir(parents=True, exist_ok=True)  # megatron saves into an existing folder
        dist.barrier()
        strategy = get_default_save_sharded_strategy("torch_dist") if a.memory else None
        dist_checkpointing.save(model.sharded_state_dict(prefix=""), a.ckpt, strategy)
    else:
        state = dist_checkpointing.load(model.sharded_state_dict(prefix=""), a.ckpt)
        model.load_state_dict(state)
    with torch.no_grad():
        out = fb(
            forward_step_func=forward_step,
            data_iterator=iter([batch(999)]),
            model=model,
            num_microbatches=1,
            seq_length=SEQ,
            micro_batch_size=MB,
            forward_only=True,
        )
    if parallel_state.is_pipeline_last_stage() and int(os.environ["RANK"]) == dist.get_world_size() - 1:
        print(f"EVAL_LOSS {float(out[0]['lm loss']):.9e}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
