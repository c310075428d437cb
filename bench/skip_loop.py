"""The skip in a training loop (issue 49): each model runs 12 training steps (forward, loss,
backward, SGD step) in fresh processes, side by side in one run:

  inductor   torch.compile(model, backend="inductor")
  save       torchfarm.compile(model) with a token and TORCHFARM_SKIP_TRACING=1: traces, saves
             the Dynamo package
  restore    the same in a later process: restores the package

Each process also runs the loop eagerly on a copy of the model and reports the largest loss
difference. Printed per model and process: Dynamo's unique graphs and frames traced (more
than inductor's: a recompile), the steady step (median of steps 5-12, ms) and its ratio to
inductor's. Tiny configs, random weights, no downloads.

    .venv/bin/python bench/skip_loop.py [--models llama,qwen3,gpt2,jit-encoder] [--json PATH]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
TOKEN = "bench-loop-token-0123456789"
STEPS = 12
MODELS = ("llama", "qwen3", "mistral", "gpt2", "jit-encoder")


def build(name: str):
    """The model and a batch of token ids (the jit encoder: embeddings)."""
    import torch

    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 32))
    small = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    if name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(**small)), ids
    if name == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        return Qwen3ForCausalLM(Qwen3Config(head_dim=16, **small)), ids
    if name == "mistral":
        from transformers import MistralConfig, MistralForCausalLM

        return MistralForCausalLM(MistralConfig(**small)), ids
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64)
        return GPT2LMHeadModel(config), ids
    from jit_encoder import Encoder

    return Encoder(), torch.randn(2, 32, 64)


def loss_of(out):
    return out.loss if hasattr(out, "loss") else out.square().mean()


def client(mode: str, name: str) -> None:
    """The loop in this process; prints a JSON line."""
    import torch

    model, x = build(name)
    kwargs = {"labels": x} if x.dtype == torch.long else {}
    reference = copy.deepcopy(model)
    if mode == "inductor":
        compiled = torch.compile(model, backend="inductor")
    else:
        import torchfarm

        compiled = torchfarm.compile(model)
    runs = []
    for m, fn in ((model, compiled), (reference, reference)):
        opt = torch.optim.SGD(m.parameters(), lr=1e-2)
        losses, times = [], []
        for _ in range(STEPS):
            started = time.perf_counter()
            loss = loss_of(fn(x, **kwargs))
            loss.backward()
            opt.step()
            opt.zero_grad()
            times.append((time.perf_counter() - started) * 1000)
            losses.append(loss.item())
        runs.append((losses, times))
    (losses, times), (eager, eager_times) = runs
    stats = torch._dynamo.utils.counters
    print(
        json.dumps(
            {
                "graphs": stats["stats"]["unique_graphs"],
                "frames": stats["frames"]["ok"],
                "steady_ms": statistics.median(times[4:]),
                "eager_ms": statistics.median(eager_times[4:]),
                "first_s": times[0] / 1000,
                "loss_err": max(abs(a - b) for a, b in zip(losses, eager)),
            }
        )
    )


def run(mode: str, name: str, env: dict) -> dict:
    caches = tempfile.mkdtemp()
    full = dict(
        os.environ,
        TORCHINDUCTOR_CACHE_DIR=os.path.join(caches, "inductor"),
        TRITON_CACHE_DIR=os.path.join(caches, "triton"),
        **env,
    )
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--client", mode, "--models", name],
        env=full,
        capture_output=True,
        text=True,
    )
    if out.returncode:
        return {"error": out.stderr[-1500:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from torchfarm.gateway.auth import hash_token
    from torchfarm.local_farm import LocalFarm

    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--client", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        return client(args.client, args.models)
    results: dict[str, dict] = {}
    with LocalFarm(tenants=f"bench:{hash_token(TOKEN)}") as farm:
        user = tempfile.mkdtemp()  # the clients' package key file: one user
        skip = dict(
            TORCHFARM_ADDR=farm.addr,
            TORCHFARM_TOKEN=TOKEN,
            TORCHFARM_SKIP_TRACING="1",
            XDG_CACHE_HOME=user,
        )
        for name in args.models.split(","):
            results[name] = {
                "inductor": run("inductor", name, {}),
                "save": run("farm", name, skip),
                "restore": run("farm", name, skip),
            }
            base = results[name]["inductor"].get("steady_ms")
            for mode, r in results[name].items():
                if "error" in r:
                    print(f"{name:<12} {mode:<8} ERROR {r['error'][-400:]}")
                    continue
                print(
                    f"{name:<12} {mode:<8} graphs {r['graphs']:>2} frames {r['frames']:>2} "
                    f"steady {r['steady_ms']:8.1f} ms ({r['steady_ms'] / base:5.2f}x inductor, "
                    f"eager {r['eager_ms']:.1f}) first step {r['first_s']:6.1f} s "
                    f"loss err {r['loss_err']:.1e}",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
