"""The ``triton`` kernel backend of the Qwen3-Next family: persistent K1/K2 launches for NVIDIA
Hopper (sm_90), on the generic device code of ``kernels/triton``.

| module        | what                                                                      |
|---------------|---------------------------------------------------------------------------|
| ``k1``        | K1, the layer front (GDN and attention): launches, tensor checks          |
| ``k1_plan``   | K1's shapes, config, hand-off programs, row maps, RoPE table, S1 tiling   |
| ``k1_kernel`` | K1's device code: the GDN and attention kernels and their stages          |
| ``k1_norm``   | K1's device code: the input RMSNorm (per CTA, or once per row + flags)    |
| ``k1_units``  | K1's device code: S1's units, the GDN row map, the tail tiles' split sum  |
| ``k1_recurrence`` | K1's device code: GDN's S2 (gated delta rule, gated norm)             |
| ``k1_words``  | K1's device code: tagged-word hand-offs and L2 prefetch                   |
| ``k1_stream`` | the attention front on the stream engine's deal: host side (not served)   |
| ``k1_stream_kernel`` | its Gluon program (loader warp, TMA ring, wgmma consumer)          |
| ``k2``        | K2, the layer tail: hand-off program, shapes, launches, contract          |
| ``k2_config`` | K2's build configuration and the measurements behind its defaults         |
| ``k2_kernel`` | K2's device code: the kernel and its stage bits                           |
| ``k2_stages`` | K2's device code: its routing and reduce stages, in the kernel's order    |
| ``k2_experts``| K2's device code: the expert stages, gate_up and down                     |
| ``k2_sync``   | K2's device code: 2-D waits, partial sums, L2 prefetch, trace stamps     |
| ``k2_topk``   | K2's device code: a row's router top-k (threshold rounds)                 |
| ``backend``   | the backend's ``target``: builds per width over one runtime, refusals     |
| ``measured``  | the widths measured faster than each engine's own step, per device        |
| ``offline``   | K1/K2 builds compiled for sm_90a without a device (``tools/ptx_digest.py``)|
"""
