"""Run by torchrun in test_external_launcher.py: every rank runs this same script.

    torchrun ... external_launcher_script.py OUT.json [--absent-rank R]

Builds the course model's engine at tensor_parallel_size=WORLD_SIZE with
distributed_executor_backend="external_launcher", generates greedily, and rank 0 writes the
tokens (and every rank's "returned" line) to OUT.json. --absent-rank R: rank R never builds
the engine (it waits until rank 0 has written OUT.json), to show rank 0's error; the timeout
is then ABSENT_TIMEOUT_S (rank 0 can only wait it out: no need for room to start).
LLM_STACK_LAUNCH_DEVICE=cuda: one GPU per rank (NCCL), CUDA graphs on.
"""
from __future__ import annotations

import json
import os
import sys
import time

import layer5_parallel as l5

PROMPTS = ["ROMEO.\n", "JULIET.\nO Romeo, Romeo", "HAMLET.\nTo be, or not to be", "KING LEAR.\n"]
# Only a safety net when every rank is there (a wait ends as soon as the peer arrives), so
# room for one rank to load the model well after the other on a busy machine.
TIMEOUT_S = 60.0
ABSENT_TIMEOUT_S = 5.0


def main() -> int:
    out, rank = sys.argv[1], int(os.environ["RANK"])
    absent = int(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[2] == "--absent-rank" else None
    if rank == absent:  # away until rank 0 has reported (torchrun starts it in a session of
        # its own, which the test's kill of torchrun's process group does not reach)
        deadline = time.monotonic() + 30 * ABSENT_TIMEOUT_S
        while not os.path.exists(out) and time.monotonic() < deadline:
            time.sleep(0.2)
        return 0
    timeout_s = TIMEOUT_S if absent is None else ABSENT_TIMEOUT_S
    start = time.monotonic()
    try:
        device = os.environ.get("LLM_STACK_LAUNCH_DEVICE", "cpu")
        llm = l5.LLM(l5.course_model_dir("target"), dtype="float32",
                     device=device, num_blocks=64, cuda_graph=device == "cuda",
                     tensor_parallel_size=int(os.environ["WORLD_SIZE"]), tp_threads=1,
                     tp_timeout_s=timeout_s, distributed_executor_backend="external_launcher")
    except RuntimeError as exc:
        if rank == 0:
            with open(out + ".tmp", "w") as f:
                json.dump({"error": str(exc), "waited_s": time.monotonic() - start}, f)
            os.replace(out + ".tmp", out)
        print(f"rank {rank}: {exc}", file=sys.stderr)
        return 1
    params = l5.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    sampled = l5.SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    mixed = llm.generate(PROMPTS, sampled)  # unseeded: every rank must draw the same tokens
    tokens = [o.outputs[0].token_ids for o in outs]
    print(f"rank {rank} returned", flush=True)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"tokens": tokens, "blocks": llm.config.num_blocks,
                       "sampled": [o.outputs[0].token_ids for o in mixed]}, f)
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
