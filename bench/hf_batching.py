"""transformers' continuous batching (what `generate_batch` runs), timed like hqtflow's engine: the manager is built,
warmed up and started outside the timer, then only the generation is timed (submit to the last finished request).
`generate_batch` itself builds, warms, starts, stops and destroys a manager inside each call: timing it whole
measured setup and teardown, not generation."""

from __future__ import annotations

import time

import torch


def _collect(manager, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Submit the prompts and wait for them all: each one's generated tokens, in prompt order."""
    ids = manager.add_requests(inputs=prompts, max_new_tokens=max_new_tokens)
    done: dict[str, list[int]] = {}
    while len(done) < len(ids):
        r = manager.get_result(timeout=1)
        if r is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous-batching thread stopped before the requests finished")
        elif r.is_finished():
            if r.error:
                raise RuntimeError(f"transformers' continuous batching failed a request: {r.error}")
            done[r.request_id] = list(r.generated_tokens)
    return [done[i] for i in ids]


def timed_generate_batch(model, prompts: list[list[int]], max_new_tokens: int, warm: int = 2):
    """(generated tokens per prompt, seconds): greedy, one warmed manager; `warm` prompts run first, untimed."""
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False)
    hints = WorkloadHints(max_prompt_length=max(map(len, prompts)), max_generated_length=max_new_tokens,
                          num_requests=len(prompts))
    with torch.no_grad(), model.continuous_batching_context_manager(generation_config=cfg, block=True, timeout=5,
                                                                     workload_hints=hints) as manager:
        _collect(manager, prompts[:warm], max_new_tokens)
        t = time.perf_counter()
        out = _collect(manager, prompts, max_new_tokens)
        return out, time.perf_counter() - t
