#!/usr/bin/env python3
"""Golden data for the engine's correctness tests (tests/test_engine_golden.cpp), made with an
independent implementation: HuggingFace transformers.

Builds tiny random Llama-family models with transformers, saves each (float32 safetensors) and, for a
few fixed prompts, the float32 logits of the last prompt position and 8 greedy-decoded tokens:

  OUTDIR/<name>/config.json          (save_pretrained)
  OUTDIR/<name>/model.safetensors    (save_pretrained, safe_serialization=True, float32)
  OUTDIR/<name>/golden.json          {"model", "seed", "prompts": [[ids]], "logits_last": [[V floats]],
                                      "greedy": [[8 ids]], "greedy_logits": [[[V floats] per step]],
                                      "greedy_min_margin", "transformers_version", "torch_version", ...}

Models (hidden 64, intermediate 128, 2 layers, 4 heads of 16, vocab 256):
  llama_tiny         Llama, 4 kv heads (MHA), rope_theta 10000
  llama3_rope_tiny   Llama, 2 kv heads, llama3 rope_scaling (factor 8, original_max_position_embeddings 64,
                     so that all three frequency bands of the scaling occur at head_dim 16)
  mistral_gqa_tiny   Mistral, 1 kv head (GQA 4), sliding_window null
  qwen2_tiny         Qwen2, 2 kv heads, q/k/v biases, tied embeddings

Everything runs on the CPU in float32 with attn_implementation="eager", seeds fixed. The weights are
re-initialised from a seeded torch.Generator with unit-scale values (HF's default std 0.02 makes the
logits nearly flat, so greedy decoding would hinge on rounding); a model's seed is advanced until the
smallest top-1/top-2 logit gap over all greedy steps is at least --min-margin, so the token
comparison is robust to fp32 rounding differences. "greedy" comes from model.generate(do_sample=False,
max_new_tokens=8) and is cross-checked against a plain full-recompute argmax loop, whose logits per
step are "greedy_logits" (step k: the logits that chose greedy[k]).

Usage (on the GPU machine, which has torch + transformers; no internet needed):
  python3 scripts/make_golden.py --out $OUT/golden
then copy OUTDIR/* into data/golden/ of the repository. Exits non-zero on any failure.
"""
import argparse
import json
import math
import os
import shutil
import sys

NEW_TOKENS = 8
PROMPT_LENGTHS = (5, 11, 17)
VOCAB = 256
PROMPT_SEED = 1234


def model_specs():
    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        head_dim=16,
        vocab_size=VOCAB,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=512,
        hidden_act="silu",
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return [
        ("llama_tiny", "llama", dict(common, num_key_value_heads=4, tie_word_embeddings=False,
                                     attention_bias=False, mlp_bias=False), 101),
        ("llama3_rope_tiny", "llama", dict(common, num_key_value_heads=2, tie_word_embeddings=False,
                                           attention_bias=False, mlp_bias=False,
                                           rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 64}), 202),
        ("mistral_gqa_tiny", "mistral", dict(common, num_key_value_heads=1, tie_word_embeddings=False,
                                             sliding_window=None), 303),
        ("qwen2_tiny", "qwen2", dict(common, num_key_value_heads=2, tie_word_embeddings=True,
                                     use_sliding_window=False, sliding_window=None), 404),
    ]


def make_prompts(torch):
    g = torch.Generator().manual_seed(PROMPT_SEED)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def build_model(torch, transformers, model_type, kwargs, seed):
    cls_cfg = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
               "qwen2": transformers.Qwen2Config}[model_type]
    cls_model = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
                 "qwen2": transformers.Qwen2ForCausalLM}[model_type]
    config = cls_cfg(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls_model(config).to(torch.float32).eval()
    model.config._attn_implementation = "eager"
    # Unit-scale seeded weights (see the module docstring).
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                v = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
            elif name.endswith(".bias"):
                v = 0.1 * torch.randn(p.shape, generator=g)
            elif "embed_tokens" in name:
                v = torch.randn(p.shape, generator=g)
            else:  # projections and lm_head, [out, in]
                v = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1])
            p.copy_(v.to(torch.float32))
    gc = model.generation_config
    gc.eos_token_id = None
    gc.bos_token_id = None
    gc.pad_token_id = 0  # never used (batch of one, no padding); silences the "no pad token" path
    gc.do_sample = False
    gc.max_new_tokens = NEW_TOKENS
    gc.temperature = None
    gc.top_p = None
    gc.top_k = None
    return model


def greedy_recompute(torch, model, prompt):
    """Full-recompute argmax loop: tokens, per-step logits, smallest top-1/top-2 gap."""
    ids = list(prompt)
    tokens, step_logits, margin = [], [], float("inf")
    for _ in range(NEW_TOKENS):
        with torch.no_grad():
            logits = model(torch.tensor([ids], dtype=torch.long)).logits[0, -1].to(torch.float32)
        top2 = torch.topk(logits, 2).values
        margin = min(margin, float(top2[0] - top2[1]))
        tok = int(torch.argmax(logits))
        tokens.append(tok)
        step_logits.append([float(x) for x in logits.tolist()])
        ids.append(tok)
    return tokens, step_logits, margin


def make_one(torch, transformers, out_dir, name, model_type, kwargs, base_seed, prompts, min_margin, max_tries):
    for attempt in range(max_tries):
        seed = base_seed + attempt
        model = build_model(torch, transformers, model_type, kwargs, seed)
        runs = [greedy_recompute(torch, model, p) for p in prompts]
        margin = min(r[2] for r in runs)
        if margin >= min_margin:
            break
        print(f"  {name}: seed {seed} has greedy margin {margin:.2e} < {min_margin:g}, trying the next seed")
    else:
        raise RuntimeError(f"{name}: no seed in [{base_seed}, {base_seed + max_tries}) reaches greedy margin {min_margin}")

    logits_last, greedy = [], []
    for p, (rec_tokens, _, _) in zip(prompts, runs):
        with torch.no_grad():
            logits = model(torch.tensor([p], dtype=torch.long)).logits[0, -1].to(torch.float32)
        logits_last.append([float(x) for x in logits.tolist()])
        with torch.no_grad():
            out = model.generate(torch.tensor([p], dtype=torch.long),
                                 attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 generation_config=model.generation_config)  # greedy, NEW_TOKENS
        gen = out[0, len(p):].tolist()
        if len(gen) != NEW_TOKENS:
            raise RuntimeError(f"{name}: generate returned {len(gen)} new tokens for prompt of {len(p)}, want {NEW_TOKENS}")
        if gen != rec_tokens:
            raise RuntimeError(f"{name}: generate {gen} != full-recompute greedy {rec_tokens} for prompt {p}")
        if int(torch.argmax(logits)) != gen[0]:
            raise RuntimeError(f"{name}: argmax of logits_last != first generated token")
        greedy.append(gen)

    path = os.path.join(out_dir, name)
    if os.path.exists(path):
        shutil.rmtree(path)
    os.makedirs(path)
    model.save_pretrained(path, safe_serialization=True)
    # Keep only what the engine reads (generation_config.json is harmless but not needed).
    for extra in ("generation_config.json",):
        if os.path.exists(os.path.join(path, extra)):
            os.remove(os.path.join(path, extra))
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        raise RuntimeError(f"{name}: save_pretrained wrote no model.safetensors (files: {os.listdir(path)})")
    golden = {
        "model": name,
        "model_type": model_type,
        "seed": seed,
        "prompts": prompts,
        "logits_last": logits_last,
        "greedy": greedy,
        "greedy_logits": [r[1] for r in runs],
        "greedy_min_margin": margin,
        "new_tokens": NEW_TOKENS,
        "dtype": "float32",
        "attn_implementation": "eager",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
    }
    with open(os.path.join(path, "golden.json"), "w") as f:
        json.dump(golden, f)
        f.write("\n")
    for fn in sorted(os.listdir(path)):
        size = os.path.getsize(os.path.join(path, fn))
        if size > 1 << 20:
            raise RuntimeError(f"{name}/{fn} is {size} bytes (limit 1 MiB)")
        print(f"  wrote {os.path.join(path, fn)} ({size} bytes)")
    print(f"  {name}: seed {seed}, greedy min margin {margin:.3g}, greedy {greedy}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output folder (one sub-folder per model)")
    ap.add_argument("--min-margin", type=float, default=2e-3,
                    help="smallest top-1/top-2 logit gap accepted over all greedy steps")
    ap.add_argument("--max-tries", type=int, default=50, help="seeds tried per model")
    ap.add_argument("--only", default="", help="comma-separated model names (default: all)")
    args = ap.parse_args()

    import torch
    import transformers

    torch.set_grad_enabled(False)
    torch.use_deterministic_algorithms(True)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, python {sys.version.split()[0]}")
    os.makedirs(args.out, exist_ok=True)
    prompts = make_prompts(torch)
    print(f"prompts (lengths {[len(p) for p in prompts]}): {prompts}")
    only = {s for s in args.only.split(",") if s}
    specs = [s for s in model_specs() if not only or s[0] in only]
    if only and len(specs) != len(only):
        raise RuntimeError(f"unknown model in --only {sorted(only)}; known: {[s[0] for s in model_specs()]}")
    for name, model_type, kwargs, seed in specs:
        print(f"{name} ({model_type})")
        make_one(torch, transformers, args.out, name, model_type, kwargs, seed, prompts, args.min_margin, args.max_tries)
    print(f"done: {len(specs)} models in {os.path.abspath(args.out)}; copy its sub-folders into data/golden/")


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # one line, non-zero exit
        print(f"make_golden.py: error: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
