"""torchtitan's Trainer on one of our recipes' shapes and our token files: the torchrun entry of titan_speed.py.

    torchrun --standalone --nproc-per-node 2 benchmarks/titan_worker.py DIR/spec.json   # DIR: titan_speed.py's

titan_speed.py writes DIR/spec.json (the torchtitan model, its args, our recipe and overrides) and DIR/job.toml
(torchtitan's job config). This registers a TrainSpec made from torchtitan's own llama3 or qwen3 spec with
`dataclasses.replace`: our shape as the flavour "trainbox", a dataloader that serves our token files in the order
our run reads them (trainbox.data: the same windows, the same shuffle, the same per-rank split), no tokenizer
and no validator. Then it runs what torchtitan/train.py's main() runs: torchtitan's ConfigManager on the TOML,
its Trainer, train(), close(). Everything of torchtitan is imported, never copied.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys


def model_args(spec: dict):
    """torchtitan's model-args dataclass of spec["model"], filled from spec["model_args"]."""
    a = dict(spec["model_args"])
    if spec["model"] == "llama3":
        from torchtitan.models.llama3 import TransformerModelArgs
        from torchtitan.models.llama3.model.args import RoPEScalingArgs
        a["rope_scaling_args"] = RoPEScalingArgs(**a.get("rope_scaling_args", {}))
        return TransformerModelArgs(**a)
    from torchtitan.models.moe import MoEArgs
    from torchtitan.models.qwen3 import Qwen3ModelArgs
    a["moe_args"] = MoEArgs(**a["moe_args"])
    return Qwen3ModelArgs(**a)


def trainbox_batches(spec: dict):
    """A build_dataloader_fn: our recipe's training windows, each micro-batch as torchtitan's ({"input"}, labels)."""
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.loss import IGNORE_INDEX

    from trainbox.config import load_config
    from trainbox.data.loader import BatchOrder
    from trainbox.data.sources import open_datasets
    from trainbox.model.build import build_tokenizer

    class TrainboxBatches(BaseDataLoader):
        """Step after step, this rank's micro-batches of that step (BatchOrder: our Trainer's order)."""

        def __init__(self, order: BatchOrder):
            self.order, self.step = order, 0

        def __iter__(self):
            while True:
                for mb in self.order.micro_batches(self.step):
                    labels = mb["y"]
                    if "loss_mask" in mb:
                        labels = labels.masked_fill(~mb["loss_mask"], IGNORE_INDEX)
                    yield {"input": mb["x"]}, labels
                self.step += 1

        def state_dict(self) -> dict:
            return {"step": self.step}

        def load_state_dict(self, state: dict) -> None:
            self.step = state["step"]

    def build(dp_world_size: int, dp_rank: int, tokenizer, job_config, **_) -> TrainboxBatches:
        cfg = load_config(spec["recipe"], spec["overrides"])
        train, _ = open_datasets(cfg.data, build_tokenizer(cfg), spec["model_args"]["vocab_size"])
        t = job_config.training
        local = t.local_batch_size
        global_ = t.global_batch_size if t.global_batch_size > 0 else local * dp_world_size
        assert train.seq_len == t.seq_len, (train.seq_len, t.seq_len)
        order = BatchOrder(train, global_, local, dp_world_size, dp_rank, cfg.run.seed)
        order.check_nonempty()
        return TrainboxBatches(order)

    return build


def tied_unit(parallelize):
    """torchtitan's parallelize function, with the tied embedding and head (and the final norm) in one FSDP unit.

    torchtitan 0.2.2's apply_fsdp shards tok_embeddings and [norm, output] as two units: torch 2.13 refuses the
    shared parameter in two groups, older torch makes it two sharded parameters (the tie is lost). Here that unit
    is sharded first, with the mesh and mixed precision apply_fsdp would use, and hidden from torchtitan's function
    while it runs (its apply_fsdp skips an absent tok_embeddings or output, as it does for pipeline stages), so the
    blocks and the root wrap around it."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.models.llama3.infra.parallelize import disable_fsdp_gradient_division

    def wrapped(model, parallel_dims, job_config):
        if not parallel_dims.fsdp_enabled:
            return parallelize(model, parallel_dims, job_config)
        assert model.output.weight is model.tok_embeddings.weight, "the head is not tied to the embedding"
        t = job_config.training
        mesh = parallel_dims.get_mesh(["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"])
        mp = MixedPrecisionPolicy(param_dtype=TORCH_DTYPE_MAP[t.mixed_precision_param],
                                  reduce_dtype=TORCH_DTYPE_MAP[t.mixed_precision_reduce])
        ends = {"tok_embeddings": model.tok_embeddings, "norm": model.norm, "output": model.output}
        # used first and last in the forward: kept gathered in between, as torchtitan keeps its last unit
        fully_shard(list(ends.values()), mesh=mesh, mp_policy=mp,
                    reshard_after_forward=job_config.parallelism.fsdp_reshard_after_forward == "always")
        for name in ends:
            setattr(model, name, None)
        try:
            model = parallelize(model, parallel_dims, job_config)
        finally:
            for name, module in ends.items():
                setattr(model, name, module)
        disable_fsdp_gradient_division(model)   # torchtitan scales by the global token count itself
        blocks = list(model.layers.values())
        if parallel_dims.ep_enabled and blocks:   # the explicit prefetches apply_fsdp sets under EP, for this unit
            first = [blocks[0], blocks[0].moe.experts] if blocks[0].moe_enabled else [blocks[0]]
            model.tok_embeddings.set_modules_to_forward_prefetch(first)
            last = [blocks[-1], blocks[-1].moe.experts] if blocks[-1].moe_enabled else [blocks[-1]]
            model.output.set_modules_to_backward_prefetch(last)
        assert model.output.weight is model.tok_embeddings.weight, "the tie did not survive sharding"
        return model

    return wrapped


def register(spec: dict) -> str:
    """Register our TrainSpec (torchtitan's own llama3 / qwen3 spec with our flavour and data) -> its name."""
    from torchtitan.protocols.train_spec import get_train_spec, register_train_spec

    base = get_train_spec(spec["model"])
    name = f"trainbox_{spec['model']}"
    register_train_spec(name, dataclasses.replace(
        base, model_args={"trainbox": model_args(spec)}, build_dataloader_fn=trainbox_batches(spec),
        build_tokenizer_fn=None, build_validator_fn=None, state_dict_adapter=None,
        parallelize_fn=tied_unit(base.parallelize_fn) if spec["tie_unit"] else base.parallelize_fn))
    return name


def flops_line(spec: dict, seq_len: int) -> dict:
    """torchtitan's own parameter and FLOP counts of the model (on the meta device); a tied head's matmul, which
    its count leaves out, added as flops_per_token_with_head."""
    import torch
    from torchtitan.protocols.train_spec import get_train_spec

    args = model_args(spec)
    with torch.device("meta"):
        model = get_train_spec(spec["model"]).model_cls(args)
    params, flops = args.get_nparams_and_flops(model, seq_len)
    out = {"params": params, "flops_per_token": flops}
    if getattr(args, "enable_weight_tying", False):
        out["flops_per_token_with_head"] = flops + 6 * args.dim * args.vocab_size
    return out


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    # what torchtitan/train.py's main() does, with our TrainSpec registered first
    import torch
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger, logger
    from torchtitan.train import Trainer

    register(spec)
    init_logger()
    config = ConfigManager().parse_args(["--job.config_file", spec["toml"]])
    if int(os.environ.get("RANK", "0")) == 0:
        print("trainbox-titan: " + json.dumps(flops_line(spec, config.training.seq_len)), flush=True)
    if spec.get("memory_limit_gib"):   # as our train.memory_limit_gib caps ours: as on a smaller GPU
        device = int(os.environ.get("LOCAL_RANK", "0"))
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, spec["memory_limit_gib"] * 2**30 / total), device)
    trainer = None
    try:
        trainer = Trainer(config)
        trainer.train()
    except Exception:
        if trainer:
            trainer.close()
        raise
    else:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        logger.info("Process group destroyed")


if __name__ == "__main__":
    main()
