"""zerofx's training API on 2 ranks: torchrun --nproc-per-node 2 examples/quickstart.py [OUT_DIR]"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import zerofx
from zerofx.data.genome import bundled_genome, genome_windows
from zerofx.models import DNA_LM_SIZES, DNADecoderLM


def main() -> None:
    cuda = torch.cuda.is_available()  # NCCL on one GPU per rank, else gloo on the CPU
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/quickstart")

    torch.manual_seed(0)  # the same initial weights on every rank
    model = DNADecoderLM(DNA_LM_SIZES["tiny"]).to(device)  # 25k parameters
    # This rank's windows of the bundled lambda phage genome: (2, 128) token ids per batch.
    batches = genome_windows(bundled_genome(), 128, rank=rank, world_size=world_size, batch_size=2, split="train")
    ids = next(batches).to(device)
    config = Path(__file__).with_name("dna_lm_zero3.json")  # ZeRO stage 3, AdamW, warm-up and cosine decay
    engine = zerofx.initialize(model, config=config, example_inputs=(ids,), example_kwargs={"labels": ids})

    for step in range(1, 11):
        loss = engine(ids, labels=ids)  # next-base prediction: the model shifts the labels by one
        engine.backward(loss)
        engine.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
        ids = next(batches).to(device)

    trained = engine.full_state_dict()  # model.state_dict()'s keys and shapes, on every rank (a collective)
    engine.save_checkpoint(out, client_state={"step": step})  # atomic; every rank writes its shards
    client_state = engine.load_checkpoint(out)  # the newest complete one, at any world size or stage
    restored = engine.full_state_dict()
    same = all(torch.equal(trained[k], restored[k]) for k in trained)
    held = {kind: f"{n / 1024:.1f} KiB" for kind, n in engine.memory().items()}  # this rank's shards only
    if rank == 0:
        print(f"checkpoint {out}: step {client_state['step']}, {len(restored)} tensors restored exactly: {same}")
        print(f"rank {rank} of {world_size} holds {held}")
    engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
