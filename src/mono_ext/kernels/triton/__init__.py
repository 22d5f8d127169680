"""Generic Triton device code any model family can build on (NVIDIA sm_90).

| module       | what                                                                    |
|--------------|-------------------------------------------------------------------------|
| `primitives` | tagged words, bounded waits on `%globaltimer`, health records, sticky   |
|              | failure, the one-shot peer-buffer all-reduce                            |
| `allreduce`  | the all-reduce runtime launch and its virtual-TP harness               |
| `planes`     | the bf16 / fp8 weight-plane reader (`qdot`) and its scale indexing      |
| `limits`     | launch constants and the plane format codes (no triton import)          |

A family's K1/K2 built from these live in its wing (`models/qwen3_next/triton/`).
"""
