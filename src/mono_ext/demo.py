"""``mono-ext demo``: decode steps of a tiny model, fused-launch path vs the stock layer math.

The main job on an embedded default, with nothing to download: write a random tiny
checkpoint (``mono_ext.tools.checkpoint``), load it with HuggingFace transformers (the
model's own layer code: the "stock" math), prefill a batch of random prompts, then decode
greedily. Each step runs twice on the same inputs:

- stock: the transformers model's forward with its cache;
- mono_ext: embedding -> per layer K1 -> (attention) -> K2 through a kernel backend, on
  states copied out of the prefill cache into the engines' layouts -> final norm -> lm_head.

It prints per-step agreement (logit rel_l2, greedy tokens) and time per step. The
``reference`` backend (exact fp32 torch) runs everywhere; the GPU backends join once their
layer launches exist (``mono-ext doctor`` says which can run here).
"""

from __future__ import annotations

import tempfile
import time

# The reference is fp32 and the model is loaded in fp32: only summation order differs.
AGREE_REL_L2 = 1e-4


def run_demo(preset: str = "qwen3-next-tiny", steps: int = 8, batch: int = 3, seed: int = 0) -> int:
    import torch
    import transformers

    from .core import get_registry
    from .models.qwen3_next.configs import family, get_preset, layer_types
    from .models.qwen3_next.dims import Dims
    from .models.qwen3_next.reference import (
        decoder_layer_step,
        gdn_state_from_hf,
        layer_weights_from_hf,
        rel_l2,
    )
    from .tools.checkpoint import make_checkpoint

    if not 1 <= batch <= 16:
        raise ValueError(f"--batch must be 1..16 (the widths mono_ext serves), got {batch}")
    if steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    transformers.logging.set_verbosity_error()  # its kernel-fallback notices are not ours
    transformers.utils.logging.disable_progress_bar()
    cfg = get_preset(preset)
    fam = family(cfg)
    arch = "Qwen3NextForCausalLM" if fam == "qwen3_next" else "Qwen3_5MoeForCausalLM"
    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory(prefix="mono_ext_demo_") as tmp:
        make_checkpoint(tmp, cfg, seed=seed, dtype="float32", arch=arch)
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    model.eval()
    dims = Dims.from_config(cfg)
    kinds = layer_types(cfg)
    packing = "interleaved" if fam == "qwen3_next" else "contiguous"
    layers = model.model.layers
    weights = [layer_weights_from_hf(layer, dims) for layer in layers]
    n_attn = kinds.count("full_attention")
    print(
        f"mono-ext demo: {preset} ({arch}), {len(kinds)} layers "
        f"({len(kinds) - n_attn} Gated DeltaNet + {n_attn} attention), hidden {dims.hidden}, "
        f"{dims.experts} experts top-{dims.top_k}; batch {batch}, {steps} decode steps"
    )
    for name, b in sorted(get_registry().backends.items()):
        ok, why = b.probe()
        print(f"  backend {name:<9} {'runs' if ok else 'skipped'}: {why}")

    g = torch.Generator().manual_seed(seed + 1)
    prompt_len = 7
    ids = torch.randint(0, cfg["vocab_size"], (batch, prompt_len), generator=g)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    cache = out.past_key_values
    # Engine-layout state pools: slot 0 is vLLM's null slot, requests own 1..batch.
    slots = torch.arange(1, batch + 1)
    t_max = prompt_len + steps
    conv, ssm, kcache, vcache = {}, {}, {}, {}
    for i, kind in enumerate(kinds):
        lc = cache.layers[i]
        if kind == "linear_attention":
            c, s = gdn_state_from_hf(lc.conv_states[0], lc.recurrent_states[0], dims, "time_chan")
            conv[i] = torch.zeros(batch + 1, *c.shape[1:])
            ssm[i] = torch.zeros(batch + 1, *s.shape[1:])
            conv[i][slots], ssm[i][slots] = c, s
        else:
            kcache[i] = torch.zeros(batch + 1, t_max, dims.hkv, dims.head_dim)
            vcache[i] = torch.zeros_like(kcache[i])
            kcache[i][slots, :prompt_len] = lc.keys.transpose(1, 2)
            vcache[i][slots, :prompt_len] = lc.values.transpose(1, 2)

    tok = out.logits[:, -1].argmax(-1)
    worst, agree, t_stock, t_fused = 0.0, 0, 0.0, 0.0
    print(f"{'step':>4}  {'logits rel_l2':>13}  {'greedy tokens':>13}")
    for step in range(steps):
        pos = torch.full((batch,), prompt_len + step)
        with torch.no_grad():
            t0 = time.perf_counter()
            stock = model(input_ids=tok[:, None], past_key_values=cache, use_cache=True).logits[
                :, -1
            ]
            t1 = time.perf_counter()
            hidden, residual = model.model.embed_tokens(tok), None
            for i, kind in enumerate(kinds):
                o = decoder_layer_step(
                    hidden,
                    residual,
                    weights[i],
                    dims,
                    kind="gdn" if kind == "linear_attention" else "attn",
                    slots=slots,
                    positions=pos,
                    conv_state=conv.get(i),
                    ssm_state=ssm.get(i),
                    k_cache=kcache.get(i),
                    v_cache=vcache.get(i),
                    conv_layout="time_chan",
                    packing=packing,
                    null_slot=0,
                )
                hidden, residual = o.hidden_out, o.residual_out
            fused = model.lm_head(model.model.norm(hidden + residual))
            t2 = time.perf_counter()
        t_stock += t1 - t0
        t_fused += t2 - t1
        err = rel_l2(fused, stock)
        same = int((fused.argmax(-1) == stock.argmax(-1)).sum())
        worst, agree = max(worst, err), agree + same
        print(f"{step:>4}  {err:>13.2e}  {same:>6}/{batch}")
        tok = stock.argmax(-1)  # both paths continue from the same tokens
    ok = worst <= AGREE_REL_L2 and agree == steps * batch
    print(
        f"reference backend vs stock layer math: worst logits rel_l2 {worst:.2e} "
        f"(bound {AGREE_REL_L2:g}), greedy tokens {agree}/{steps * batch} equal -> "
        f"{'AGREE' if ok else 'DISAGREE'}"
    )
    print(
        f"time per step (CPU, batch {batch}): stock {t_stock / steps * 1e3:.2f} ms, "
        f"reference {t_fused / steps * 1e3:.2f} ms (both fp32 on the CPU: speed comes from the GPU backends)"
    )
    return 0 if ok else 1
