"""Generic FlyDSL device code and toolchain for AMD MI355X (gfx950); a model family's K1/K2
and backend built on it live in its wing (``models/qwen3_next/flydsl/``).

| module          | what                                                             | needs flydsl |
|-----------------|------------------------------------------------------------------|--------------|
| ``limits``      | gfx950 limits (CUs, VGPR file, LDS, clock), launch constants     | no           |
| ``toolchain``   | offline compile (``COMPILE_ONLY=1 ARCH=gfx950``, LLD shim), ISA  | to compile   |
|                 | metadata parser and the spill/scratch/LDS/residency checks; the  |              |
|                 | launcher and the dry launch (arguments vs the kernel's params)   |              |
| ``primitives``  | device code: tagged words, bounded waits on ``s_memrealtime``,   | yes          |
|                 | health records, sticky failure, peer-buffer all-reduce           |              |
| ``runtime``     | the runtime launches built from the primitives (mailbox, all-    | yes          |
|                 | reduce) and their offline builds                                 |              |

Everything here compiles on a CPU machine; nothing here has run on an MI355X (no such device
was available where it was written): numerics on gfx950 are unverified until the Buildkite
MI355 step runs its device tests there (``.buildkite/gpu_step.sh``).
"""
